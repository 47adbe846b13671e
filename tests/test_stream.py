"""Streamed stores (:mod:`latte.compiler.passes.stream`): a store-bound tiled product that
writes more than the L2s hold stores its vectors past the caches. The values are those of
stores through the caches, bit for bit, and level 0's; products that do much work per
element, write little or cannot be proven aligned keep their stores."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_scaled_close, run_alike, vector_registers

from latte import Net
from latte.compiler import Segment, TimeSteps, pipeline
from latte.compiler.ir import Gemm, walk
from latte.compiler.passes import stream
from latte.compiler.pipeline import llvm_ir
from latte.stdlib import (
    ConvolutionLayer,
    FullyConnectedLayer,
    MaxPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
    SoftmaxLossLayer,
)


def _conv(level: int, channels: int = 1, size: int = 224) -> Net:
    """A first 3x3 convolution (64 outputs, a bias and a ReLU) over ``channels`` x ``size``
    x ``size`` images at batch 2 on 2 threads, then a pooling and a classifier."""
    net = Net(2, opt_level=level, num_threads=2, seed=11)
    x = MemoryDataLayer(net, "x", (channels, size, size))
    label = MemoryDataLayer(net, "label", (1,))
    h = ReLULayer("r1", net, ConvolutionLayer("c1", net, x, 64, 3, pad=1))
    h = MaxPoolingLayer("pool", net, h, 4)
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("out", net, h, 10), label)
    net.init()
    return net


def _streamed(net: Net) -> dict[str, int]:
    """The C buffer of each streaming product in ``net``'s code -> its stores' alignment."""
    out = {}
    for step in (*net.program.forward, *net.program.backward, *net.program.test):
        segs = step.steps if isinstance(step, TimeSteps) else [step]
        for seg in segs:
            if isinstance(seg, Segment):
                out |= {g.c_buf.name: g.stream for k in seg.kernels for g in walk(k.body)
                        if isinstance(g, Gemm) and g.stream}
    return out


def _llvm(net: Net) -> str:
    p = net.program
    return "".join(module() for module in llvm_ir(p.segments(), p.buffer_index(), 2))


def _same(streamed: Net, cached: Net, base: Net) -> None:
    for name in ("c1", "r1", "pool", "out"):
        np.testing.assert_array_equal(streamed.value(name), cached.value(name))
        assert_scaled_close(streamed.value(name), base.value(name), 1e-5, f"{name} values")
    for p, q in zip(cached.params, streamed.params, strict=True):
        np.testing.assert_array_equal(q.grad, p.grad)


def _caches(monkeypatch, l3: int) -> None:
    """Compile as for a core with a 1 MiB L2 and an L3 of ``l3`` bytes."""
    monkeypatch.setattr(pipeline, "cache_sizes", lambda: {1: 32 << 10, 2: 1 << 20, 3: l3})


@pytest.fixture
def tiled(monkeypatch):
    """Products tiled on any host, with 16-float vectors (wider vectors are correct
    anywhere; whatever this machine's trials say), and a 32 MiB L3."""
    vector_registers(monkeypatch, 512, 32)
    monkeypatch.setenv("LATTE_IN_PLACE", "1")
    _caches(monkeypatch, 32 << 20)
    return monkeypatch


def test_a_first_convolution_streams_its_output_with_the_same_bits(tiled):
    """One input channel: 9 multiply-adds per output, 25.7 MB written by the forward (more
    than the two L2s), the program's buffers more than the L3, each vector on a 64-byte
    boundary (224 columns, 16-float vectors). Two threads write rows the pooling then reads
    across them."""
    streamed = _conv(3)
    tiled.setenv("LATTE_STREAM", "0")
    cached, base = _conv(3), _conv(0)
    assert _streamed(streamed)["c1.value"] == 64
    assert not _streamed(cached)
    code = _llvm(streamed)
    assert "align 64, !nontemporal" in code and "call void @\"llvm.x86.sse.sfence\"()" in code
    assert "nontemporal" not in _llvm(cached)
    run_alike([base, cached, streamed], 10)
    _same(streamed, cached, base)


@pytest.mark.parametrize("channels,size,l3", [(64, 224, 32 << 20), (1, 32, 1 << 20),
                                              (1, 224, 1 << 30)])
def test_products_with_much_work_or_a_small_output_store_through_the_caches(tiled, channels,
                                                                            size, l3):
    """64 input channels: 576 multiply-adds per output hide the stores; 32 x 32 images:
    512 KB written, which the L2s hold for the pooling (the program outgrowing a 1 MiB L3);
    a 1 GiB L3 holds the whole program from one run to the next."""
    _caches(tiled, l3)
    assert "c1.value" not in _streamed(_conv(3, channels, size))


def test_the_random_testers_switch_streams_unaligned_products_with_the_same_bits(tiled):
    """With :data:`~latte.compiler.passes.stream.EVERY` (as the random tester sets it) a
    product streams whatever its size and alignment: 15 x 15 images put C's rows 225
    floats apart, so its stores are known aligned to 4 bytes only (LLVM splits them)."""
    tiled.setattr(stream, "EVERY", True)
    streamed = _conv(3, 3, 15)
    tiled.setattr(stream, "EVERY", False)
    cached, base = _conv(3, 3, 15), _conv(0, 3, 15)
    assert _streamed(streamed).get("c1.value") == 4
    assert not _streamed(cached)
    run_alike([base, cached, streamed], 10)
    _same(streamed, cached, base)
