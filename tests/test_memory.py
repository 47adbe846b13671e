"""Transient buffers (a pass's temporaries, filled before they are read at every run) of
different kernels share memory; those of one kernel do not, nor one that a kernel reads
without filling it. The test forward's intermediate values share it too, each apart from
those in use with it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import WeightedSumLoss

from latte import Net, Phase, stdlib
from latte.aligned import ALIGN
from latte.compiler.codegen import kernel_buffers
from latte.compiler.explain import explain_program
from latte.compiler.ir import accesses
from latte.stdlib import (
    ConvolutionLayer,
    FullyConnectedLayer,
    LSTMLayer,
    MemoryDataLayer,
    ReLULayer,
)
from latte.zoo import nets


def _convs(level: int, seed: int = 0):
    """Two Winograd convolutions of different widths (each transforms its weights into its
    own U), run twice: the second run finds the other layer's values in the shared memory."""
    net = Net(2, opt_level=level, num_threads=2, seed=1)
    x = MemoryDataLayer(net, "x", (8, 16, 16))
    x.needs_grad = True
    conv = ConvolutionLayer("conv1", net, x, 16, 3, pad=1)
    out = ConvolutionLayer("conv2", net, ReLULayer("relu", net, conv), 12, 3, pad=1)
    WeightedSumLoss(net, "loss", out)
    net.init()
    rng = np.random.default_rng(seed)
    for _ in range(2):
        net.value(x)[...] = rng.standard_normal((2, 8, 16, 16))
        net.forward()
        net.backward()
    return net, [net.value(out).copy(), net.grad(x).copy(), *[p.grad.copy() for p in net.params]]


def _transients(net) -> dict[str, np.ndarray]:
    return {b.name: net._memory[b] for b in net.program.buffers.transient}


@pytest.mark.parametrize("level", [2, 3])
def test_winograd_layers_share_their_temporaries_and_equal_level_0(level):
    net, got = _convs(level)
    _, want = _convs(0)
    for g, w in zip(got, want):
        assert np.abs(g - w).max() <= 2e-5 * max(float(np.abs(w).max()), 1e-3)
    arrays = _transients(net)
    kernels = [k for seg in net.program.segments() for k in seg.kernels]
    own = [[arrays[b.name] for b in kernel_buffers(k) if b.name in arrays] for k in kernels]
    for bufs in own:   # one kernel's temporaries never overlap
        for a, b in itertools.combinations(bufs, 2):
            assert not np.shares_memory(a, b)
    assert any(np.shares_memory(a, b) for x, y in itertools.combinations(own, 2)
               for a in x for b in y)
    text = explain_program(net.program)
    alone = sum(-(-a.nbytes // ALIGN) * ALIGN for a in arrays.values()) / 2**20
    assert f"temporaries of passes {len(arrays)} buffers, {alone:.1f} MiB;" in text
    if level == 2:   # each layer a kernel of its own: the weights' transforms share
        u = [a for name, a in arrays.items() if ".forward.winograd" in name and name.endswith(".U")]
        assert len(u) == 2 and np.shares_memory(*u)


def test_sharing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LATTE_SHARE_TRANSIENTS", "0")
    net, _ = _convs(3)
    for a, b in itertools.combinations(_transients(net).values(), 2):
        assert not np.shares_memory(a, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_weights_packed_before_a_time_loop_keep_their_own_memory(threads):
    """The recurrent weights are packed by one kernel before the loop and read by the step's
    kernel: they must outlive the first, so they share with nothing."""
    net = Net(4, time_steps=3, num_threads=threads, seed=0)
    x = MemoryDataLayer(net, "x", (16,))
    h = LSTMLayer("lstm", net, x, 32)
    WeightedSumLoss(net, "loss", FullyConnectedLayer("out", net, h, 8))
    net.init()
    arrays = _transients(net)
    read_only = {b.name for seg in net.program.segments() for k in seg.kernels
                 for b in kernel_buffers(k) if b.name in arrays
                 and b not in {a.buffer for a in accesses(k.body) if a.written}}
    assert read_only   # the packed recurrent weights, in the step's kernels
    for name in read_only:
        assert not any(np.shares_memory(arrays[name], a) for other, a in arrays.items()
                       if other != name)


def _bottlenecks(level: int):
    """Two ResNet-50 bottlenecks (1x1, 3x3, 1x1 convolutions with batch norms, a residual
    add) and an FC under a loss, after one training step's forward: a test forward's values
    and the training forward's values of its first convolution."""
    net = Net(2, opt_level=level, num_threads=2, seed=0)
    x = MemoryDataLayer(net, "x", (16, 8, 8))
    y = x
    for i in range(2):
        y = nets.bottleneck(stdlib, f"b{i}", net, y, 4, 1)
    out = FullyConnectedLayer("fc", net, y, 5)
    WeightedSumLoss(net, "loss", out)
    net.init()
    rng = np.random.default_rng(3)
    net.value(x)[...] = rng.standard_normal(net.value(x).shape)
    net.forward()
    trained = net.value("b0_conv1").copy()
    net.value(x)[...] = rng.standard_normal(net.value(x).shape)
    net.forward(Phase.TEST)
    return net, net.value(out).copy(), trained


@pytest.mark.parametrize("level", [2, 3])
def test_test_forward_keeps_intermediate_values_in_the_arena(level):
    """The test forward's intermediate values share the arena, none with one in use at the
    same kernel; their buffers keep the training forward's values; the output equals level
    0's, and so does ``predict`` of an intermediate (which the training program computes)."""
    net, got, trained = _bottlenecks(level)
    base, want, _ = _bottlenecks(0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    program, memory = net.program, net._memory
    names = {b.name for b in program.test_values}
    assert "b0_conv2.value" in names and "b1_add.value" in names
    assert not names & {"x.value", "fc.value"}   # the input, the loss's input
    np.testing.assert_array_equal(net.value("b0_conv1"), trained)
    arrays = memory.test_arrays
    assert set(arrays) == set(program.test_values)
    lives = program._test_lifetimes
    for i, _ in enumerate(program.test_kernels()):
        live = [arrays[b] for b, span in lives.items() if i in span]
        for a, b in itertools.combinations(live, 2):
            assert not np.shares_memory(a, b)
    assert any(np.shares_memory(a, b) for a, b in itertools.combinations(arrays.values(), 2))
    alone = sum(a.nbytes for a in arrays.values())
    assert max(a.ctypes.data + a.nbytes for a in arrays.values()) - min(
        a.ctypes.data for a in arrays.values()) < alone
    x = np.random.default_rng(4).standard_normal((3, 16, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(net.predict(x, "b1_conv2_bn"), base.predict(x, "b1_conv2_bn"),
                               rtol=1e-5, atol=1e-5)
    assert "the test forward's intermediate values" in explain_program(program)


def test_test_forward_values_can_keep_their_buffers(monkeypatch):
    monkeypatch.setenv("LATTE_SHARE_TRANSIENTS", "0")
    net, _, _ = _bottlenecks(3)
    assert not net._memory.test_arrays
    assert list(net._memory.test_table) == list(net._memory.table)
