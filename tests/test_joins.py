"""Zero-copy joins (latte.compiler.joins): a concat's inputs write into its buffers.

An inception block (convolution branches of different widths, most under a ReLU, joined
along the channels, read by a convolution) at every opt level, 1 and 2 threads, batch 1 and
3 (six of their combinations: each case compiles two nets): every value, every ensemble's
gradient and every parameter gradient against level 0 and against the same net whose join
the compiler must copy; the compiled program: no kernel copies into the join. Joins that
must stay copies, with the reason ``latte explain`` gives, and still right.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers import WeightedSumLoss, fill

from latte import Ensemble, Net, Neuron, add_connections
from latte.compiler.explain import explain_program
from latte.compiler.ir import Gemm, accesses, walk
from latte.lang import ActivationEnsemble, DataEnsemble, NormalizationEnsemble
from latte.stdlib import (
    ConcatLayer,
    ConvolutionLayer,
    FullyConnectedLayer,
    MaxPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
    TanhLayer,
)

SHAPE = (3, 6, 64)   # wide enough rows to be tiled and fused at opt levels 2 and 3


class CopyConcat4(Neuron):
    """A four-input concat the compiler may not make zero-copy: its forward is not exactly a
    sum of its inputs (times 1.0: the same values)."""

    def forward(self):
        self.value = 1.0 * (self.inputs[0][0] + self.inputs[1][0] + self.inputs[2][0]
                            + self.inputs[3][0])

    def backward(self):
        self.grad_inputs[0][0] += self.grad
        self.grad_inputs[1][0] += self.grad
        self.grad_inputs[2][0] += self.grad
        self.grad_inputs[3][0] += self.grad


def copy_concat(name, net, inputs):
    cat = Ensemble(net, name, CopyConcat4, (sum(e.shape[0] for e in inputs), *inputs[0].shape[1:]))
    first = 0
    for e in inputs:
        add_connections(net, e, cat, lambda c, *rest, o=first: (c - o, *rest), padding=0.0)
        first += e.shape[0]
    return cat


def conv_relu(name, net, x, n, k, relu=True):
    conv = ConvolutionLayer(name, net, x, n, k, pad=k // 2)
    return ReLULayer(f"{name}_relu", net, conv) if relu else conv


def block(net, x, concat=ConcatLayer):
    """1x1; 1x1 then 3x3; 1x1 then 5x5 (no ReLU); 3x3 max pool then 1x1: joined, then a 3x3
    convolution reads the join."""
    b1 = conv_relu("b1", net, x, 4, 1)
    b3 = conv_relu("b3", net, conv_relu("b3r", net, x, 3, 1), 5, 3)
    b5 = conv_relu("b5", net, conv_relu("b5r", net, x, 2, 1), 3, 5, relu=False)
    bp = conv_relu("bp", net, MaxPoolingLayer("pool", net, x, 3, 1, 1), 2, 1)
    return ConvolutionLayer("out", net, concat("cat", net, [b1, b3, b5, bp]), 4, 3, pad=1)


def run(build, opt_level: int, threads: int = 1, batch: int = 3, time_steps: int = 1,
        shape=SHAPE):
    """Build ``build(net, x)`` with a weighted-sum loss, one forward and backward; the net
    and every value, ensemble gradient and parameter gradient."""
    net = Net(batch, time_steps=time_steps, opt_level=opt_level, num_threads=threads, seed=7)
    x = MemoryDataLayer(net, "x", shape)
    WeightedSumLoss(net, "loss", build(net, x))
    net.init()
    fill(net, x, np.random.default_rng(0))
    net.forward()
    net.backward()
    out = {}
    for e in net.ensembles:
        if isinstance(e, (NormalizationEnsemble, DataEnsemble)):
            continue
        out[f"value {e.name}"] = net.value(e).copy()
        if not isinstance(e, ActivationEnsemble):
            out[f"grad {e.name}"] = net.grad(e).copy()
    out |= {f"param grad {p.name}": p.grad.copy() for p in net.params}
    return net, out


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        scale = max(float(np.abs(ref).max()), 1e-30)
        err = float(np.abs(got[name] - ref).max()) / scale
        assert err <= 2e-5, f"{what}: {name} off by {err:.2e} of its largest entry"


@functools.cache
def reference(batch: int):
    return run(block, 0, 1, batch)[1]


def zero_copy(net, join: str) -> None:
    """``join`` is zero-copy: no kernel of its own, its inputs' buffers windows of its, no
    kernel accesses those windows, and only its inputs' kernels write its values."""
    program, bufs = net.program, net.program.buffers
    (found,) = [j for j in program.joins if j.ensemble.name == join]
    assert found.why_not is None
    plan = next(p for p in program.plans if p.ensemble is found.ensemble)
    assert all(not k.body.stmts for k in plan.kernels.values())
    value = bufs.value(found.ensemble)
    kernels = [k for s in program.segments() for k in s.kernels]
    used = {a.buffer for k in kernels for a in accesses(k.body)}
    assert not used & bufs.windows.keys()
    writers = {k.name for k in kernels if any(a.written and a.buffer is value for a in accesses(k.body))}
    assert writers and not any(name.startswith(f"{join}.") for name in writers)
    for source, first in found.inputs:
        home, offset = bufs.home(bufs.value(source))
        assert home is value and offset == first * value.size // value.shape[0] // found.ensemble.shape[0]
        assert np.shares_memory(net.value(source), net.value(found.ensemble))
        whole = net.value(found.ensemble)   # (batch, ...) or (steps, batch, ...)
        lead = whole.ndim - len(found.ensemble.shape)
        np.testing.assert_array_equal(net.value(source),
                                      whole[(slice(None),) * lead + (slice(first, first + source.shape[0]),)])


@pytest.mark.parametrize("opt_level,threads,batch",
                         [(0, 1, 3), (1, 1, 3), (1, 2, 1), (2, 2, 3), (3, 1, 1), (3, 2, 3)])
def test_inception_block(opt_level, threads, batch):
    net, got = run(block, opt_level, threads, batch)
    assert_same(got, reference(batch), f"level {opt_level} against level 0")
    copied, want = run(lambda n, x: block(n, x, copy_concat), opt_level, threads, batch)
    assert_same(got, want, "zero-copy against the copy")
    assert not copied.program.joins   # 1.0 * (...) is no join: a copy at every level
    if opt_level == 0:
        assert net.program.joins[0].why_not.startswith("opt level 0")
        return
    zero_copy(net, "cat")
    # the GEMMs of the 1x1 convolutions write their outputs straight into the join's buffer
    cat = net.program.buffers.value(net.ensemble("cat"))
    gemms = [n for p in net.program.plans for k in p.kernels.values() for n in walk(k.body)
             if isinstance(n, Gemm) and n.c_buf is cat]
    assert gemms
    # gradient zeroing: the join's gradient once (or folded into its reader), no window
    zero = next(k for s in net.program.backward for k in getattr(s, "kernels", ())
                if k.name == "zero_grads")
    assert not {a.buffer for a in accesses(zero.body)} & net.program.buffers.windows.keys()


def _pair(net, x):
    return [conv_relu("a", net, x, 3, 3), ConvolutionLayer("b", net, x, 2, 1)]


def _also_read(net, x):
    a, b = _pair(net, x)
    WeightedSumLoss(net, "loss_a", ConvolutionLayer("c", net, a, 2, 1))
    return ConcatLayer("cat", net, [a, b])


COPIES = {   # joins that must stay copies: the net and the reason explain gives
    "axis 1": (lambda net, x: ConcatLayer("cat", net, [conv_relu("a", net, x, 2, 3),
                                                       ConvolutionLayer("b", net, x, 2, 1)], axis=1),
               "joined along dimension 1, not the first"),
    "read elsewhere": (_also_read, "'a_relu' is also read by 'c'"),
    "data": (lambda net, x: ConcatLayer("cat", net, [x, _pair(net, x)[1]]),
             "'x' is a data ensemble"),
    "twice": (lambda net, x: ConcatLayer("cat", net, [_pair(net, x)[1]] * 2),
              "'b' is joined twice"),
    "in place on it": (lambda net, x: TanhLayer("act", net, ConcatLayer("cat", net, _pair(net, x))),
                       "the in-place activation 'act' works on its buffers"),
}


@pytest.mark.parametrize("case", sorted(COPIES))
def test_joins_that_stay_copies(case):
    build, why = COPIES[case]
    want = run(build, 0, shape=(3, 4, 8))[1]
    for level in (1, 3):
        net, got = run(build, level, threads=2, shape=(3, 4, 8))
        (join,) = [j for j in net.program.joins if j.ensemble.name == "cat"]
        assert join.why_not is not None and join.why_not.startswith(why), join.why_not
        assert f"'cat': a copy: {join.why_not}" in explain_program(net.program)
        assert not net.program.buffers.windows
        assert_same(got, want, f"{case} at level {level}")


def test_latte_joins_0_keeps_every_join_a_copy(monkeypatch):
    build = lambda net, x: ConcatLayer("cat", net, _pair(net, x))  # noqa: E731
    want = run(build, 0, shape=(3, 4, 8))[1]
    monkeypatch.setenv("LATTE_JOINS", "0")
    net, got = run(build, 3, shape=(3, 4, 8))
    assert [j.why_not for j in net.program.joins] == ["LATTE_JOINS=0 keeps every join a copy"]
    assert not net.program.buffers.windows
    assert_same(got, want, "LATTE_JOINS=0 at level 3")


def _nested(net, x):
    a, b = _pair(net, x)
    inner = ConcatLayer("inner", net, [a, b])
    return ConcatLayer("cat", net, [ConvolutionLayer("c", net, x, 1, 1), inner])


def _vectors(net, x):
    """FC branches (one under an in-place tanh) of a net with time steps (no recurrence:
    they run once over every step's items)."""
    a = TanhLayer("a", net, FullyConnectedLayer("fa", net, x, 3))
    cat = ConcatLayer("cat", net, [a, FullyConnectedLayer("b", net, x, 2)])
    return FullyConnectedLayer("out", net, cat, 2)


@pytest.mark.parametrize("opt_level", (1, 3))
def test_nested_joins_and_vectors_over_time_steps(opt_level):
    want = run(_nested, 0, shape=(3, 4, 8))[1]
    net, got = run(_nested, opt_level, threads=2, shape=(3, 4, 8))
    assert_same(got, want, "nested")
    zero_copy(net, "cat")
    assert "'inner': zero-copy: 'a_relu' from channel 0, 'b' from channel 3" in explain_program(net.program)
    bufs = net.program.buffers
    home, offset = bufs.home(bufs.value(net.ensemble("a")))
    assert home is bufs.value(net.ensemble("cat")) and offset == 1 * 4 * 8   # after c's channel
    assert np.shares_memory(net.value("a"), net.value("cat"))

    want = run(_vectors, 0, time_steps=2, shape=(5,))[1]
    net, got = run(_vectors, opt_level, threads=2, time_steps=2, shape=(5,))
    assert_same(got, want, "vectors over time steps")
    zero_copy(net, "cat")
    assert net.value("a").shape == (2, 3, 3)
    # d loss / d cat stays what the copy has: the tanh's backward writes fa's own gradient
    assert net.program.buffers.grad(net.ensemble("fa")) not in net.program.buffers.windows


@pytest.mark.parametrize("output", ("b5", "cat"))
def test_predict_a_join_and_its_input(output):
    x = np.random.default_rng(1).standard_normal((5, *SHAPE)).astype(np.float32)
    want = run(block, 0)[0].predict(x, output)
    net = run(block, 3, threads=2)[0]
    got = net.predict(x, output)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())

