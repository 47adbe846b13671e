"""Bias folding (:mod:`latte.compiler.passes.bias`): a bias nest after a tiled product (and
a ReLU after it) is applied as the product stores its tiles. Folded nets give the same bits
as unfolded ones and agree with level 0; nests that do not add a bias to (or take the ReLU
of) exactly the product's output stay."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers import assert_scaled_close, run_alike, vector_registers

from latte import Net
from latte.compiler import Segment, TimeSteps
from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    Buffer,
    Const,
    Gemm,
    Kernel,
    Load,
    Loop,
    LoopKind,
    Ref,
    walk,
)
from latte.compiler.passes.bias import fold_bias
from latte.stdlib import (
    ConvolutionLayer,
    FullyConnectedLayer,
    LSTMLayer,
    MaxPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
    SoftmaxLossLayer,
)


def _kernels(net: Net) -> list[Kernel]:
    out = []
    for step in (*net.program.forward, *net.program.test):
        segs = step.steps if isinstance(step, TimeSteps) else [step]
        out += [k for s in segs if isinstance(s, Segment) for k in s.kernels]
    return out


def _biased(net: Net) -> set[str]:
    """The biases added by tiled products in ``net``'s forward and test code."""
    return {g.bias_buf.name for k in _kernels(net) for g in walk(k.body)
            if isinstance(g, Gemm) and g.bias_buf is not None}


def _bias_nests(net: Net) -> set[str]:
    """The biases still added by a nest of their own."""
    return {n.value.ref.buffer.name for k in _kernels(net) for n in walk(k.body)
            if isinstance(n, AugAssign) and isinstance(n.value, Load)
            and n.value.ref.buffer.name.endswith(".bias")}


def _mlp(level: int, batch: int = 37, threads: int = 2) -> Net:
    net = Net(batch, opt_level=level, num_threads=threads, seed=3)
    x = MemoryDataLayer(net, "x", (300,))
    label = MemoryDataLayer(net, "label", (1,))
    h = ReLULayer("r1", net, FullyConnectedLayer("fc1", net, x, 200))
    h = ReLULayer("r2", net, FullyConnectedLayer("fc2", net, h, 77))
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("out", net, h, 10), label)
    net.init()
    return net


def _lstm(level: int, threads: int = 2) -> Net:
    net = Net(13, time_steps=4, opt_level=level, num_threads=threads, seed=5)
    x = MemoryDataLayer(net, "x", (9,))
    label = MemoryDataLayer(net, "label", (1,))
    h = LSTMLayer("lstm", net, x, 150)
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("out", net, h, 6), label)
    net.init()
    return net


def _convnet(level: int, threads: int = 2) -> Net:
    """A 3x3 and a 5x5 convolution (direct: no Winograd) with biases and ReLUs (3 channels
    in, as an image's first layer), a pooling and a classifier."""
    net = Net(3, opt_level=level, num_threads=threads, seed=7)
    x = MemoryDataLayer(net, "x", (3, 16, 16))
    label = MemoryDataLayer(net, "label", (1,))
    h = ReLULayer("r1", net, ConvolutionLayer("c1", net, x, 16, 3, pad=1))
    h = ReLULayer("r2", net, ConvolutionLayer("c2", net, h, 32, 5, pad=2))
    h = MaxPoolingLayer("pool", net, h, 2)
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("out", net, h, 10), label)
    net.init()
    return net


@pytest.mark.parametrize("build,classes,outputs,folds", [
    (_mlp, 10, ("fc1", "fc2", "out"), ("fc1", "fc2")),
    (_lstm, 6, ("lstm", "out"), ("lstm.hh", "out")),
    (_convnet, 10, ("c1", "c2", "out"), ("c1", "c2")),
])
def test_folded_biases_give_the_same_bits(monkeypatch, build, classes, outputs, folds):
    """The tiled projections' biases are folded (an MLP's split unevenly over the threads,
    an LSTM's recurrent one at every step), with the same values and gradients as the
    separate nests, bit for bit, and as level 0. The products are tiled on any host: an
    AVX-512 host's registers (made one here: wider vectors are correct anywhere; AVX2's 16
    keep small products with BLAS) and ``LATTE_IN_PLACE=1`` (whatever this machine's trials
    say)."""
    vector_registers(monkeypatch, 512, 32)
    monkeypatch.setenv("LATTE_IN_PLACE", "1")
    folded = build(3)
    monkeypatch.setenv("LATTE_FOLD_BIAS", "0")
    apart, base = build(3), build(0)
    assert not _biased(apart) and not _biased(folded) & _bias_nests(folded)
    assert _biased(folded) | _bias_nests(folded) == _bias_nests(apart)
    assert {f"{name}.bias" for name in folds} <= _biased(folded)
    run_alike([base, folded, apart], classes)
    for name in outputs:
        np.testing.assert_array_equal(folded.value(name), apart.value(name))
        assert_scaled_close(folded.value(name), base.value(name), 1e-5, f"{name} values")
    for p, q in zip(apart.params, folded.params, strict=True):
        np.testing.assert_array_equal(q.grad, p.grad)


def test_a_conv_tile_adds_its_bias_per_channel_and_takes_the_relu_as_it_stores(monkeypatch):
    """A convolution's tile: the bias of each output channel (a row of the product) and the
    ReLU after it, fused in the same group, are applied by the product; no nest of either
    is left on its output."""
    vector_registers(monkeypatch, 512, 32)
    monkeypatch.setenv("LATTE_IN_PLACE", "1")
    net = _convnet(3)
    gemms = [g for k in _kernels(net) for g in walk(k.body) if isinstance(g, Gemm)
             and g.bias_buf is not None and g.bias_buf.name in ("c1.bias", "c2.bias")]
    assert gemms and all(g.bias_rows and g.relu for g in gemms)
    assert not any(isinstance(n, Assign) and isinstance(n.value, BinOp) and n.value.op == "max"
                   and n.target.buffer in {g.c_buf for g in gemms}
                   for k in _kernels(net) for n in walk(k.body))


def test_products_blas_runs_keep_their_nests(monkeypatch):
    monkeypatch.setenv("LATTE_PACK", "0")
    net = _mlp(3)
    assert not _biased(net) and _bias_nests(net) == {"fc1.bias", "fc2.bias", "out.bias"}


# ---------------------------------------------------------------- the pass on IR

M, N, K = 8, 64, 5
A, B, C = Buffer(("a",), "a", (M, K)), Buffer(("b",), "b", (K, N)), Buffer(("c",), "c", (M, N))
BIAS = Buffer(("bias",), "bias", (N, 1))


def _split_product(rows: bool, beta: float = 0.0) -> Loop:
    """The product over 2 threads, by rows or by columns."""
    m, n = (M // 2, N) if rows else (M, N // 2)
    g = Gemm(m, n, K, A, Affine.of("_c", m * K if rows else 0), K, False, B,
             Affine.of("_c", 0 if rows else n), N, False, C,
             Affine.of("_c", m * N if rows else n), N, beta=beta, panel=(4, 32, 16), packed=False)
    return Loop("_c", 0, 2, Block((g,)), LoopKind.PARALLEL)


def _nest(rows: int = M, target: Buffer = C, by_row: bool = False, op: str = "+",
          bias: bool = True, relu: Buffer | None = None, floor: float = 0.0) -> Loop:
    """``target[i, j] += bias[j]`` over ``rows`` rows (``bias[i]`` with ``by_row``), then,
    given ``relu``, ``relu[i, j] = max(relu[i, j], floor)``."""
    i, j = Affine.of("i"), Affine.of("j")
    stmts = (AugAssign(Ref(target, (i, j), (M, N)), op,
                       Load(Ref(BIAS, (i if by_row else j, Affine()), (N, 1)))),) * bias
    if relu is not None:
        at = Ref(relu, (i, j), (M, N))
        stmts += (Assign(at, BinOp("max", Load(at), Const(floor))),)
    return Loop("i", 0, rows, Block((Loop("j", 0, N, Block(stmts)),)), LoopKind.PARALLEL)


def _fold(*stmts) -> tuple:
    return fold_bias(Kernel("k", Block(stmts))).body.stmts


@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_the_bias_follows_each_threads_block(rows, beta):
    (loop,) = _fold(_split_product(rows, beta), _nest())
    g = loop.body.stmts[0]
    assert g.bias_buf is BIAS and g.beta == beta
    # columns split: thread _c's block starts at column 32 * _c, and so does its bias
    assert g.bias_off == (Affine() if rows else Affine.of("_c", N // 2))
    assert not g.bias_rows and not g.relu


@pytest.mark.parametrize("rows", [True, False])
def test_a_bias_per_row_follows_each_threads_rows(rows):
    (loop,) = _fold(_split_product(rows), _nest(by_row=True, relu=C))
    g = loop.body.stmts[0]
    assert g.bias_buf is BIAS and g.bias_rows and g.relu
    # rows split: thread _c's block starts at row 4 * _c, and so does its bias
    assert g.bias_off == (Affine.of("_c", M // 2) if rows else Affine())


def test_a_relu_alone_and_a_product_inside_a_tile_loop_fold():
    (loop,) = _fold(_split_product(False), _nest(bias=False, relu=C))
    assert loop.body.stmts[0].relu and loop.body.stmts[0].bias_buf is None
    tiles = Loop("t", 0, 3, Block((_split_product(True), _nest())))
    ((inner,),) = [s.body.stmts for s in _fold(tiles)]
    assert inner.body.stmts[0].bias_buf is BIAS


def test_a_relu_is_folded_into_blocks_of_k():
    """A product run in blocks of ``k`` (each adding to C) takes the bias and the ReLU too:
    its last block applies ``max(x, 0)`` to the finished sum (the micro-kernel's tests check
    the numbers)."""
    product = _split_product(False)
    blocked = replace(product, body=Block((replace(product.body.stmts[0], k_block=2),)))
    (folded,) = _fold(blocked, _nest(relu=C))
    assert folded.body.stmts[0].relu and folded.body.stmts[0].bias_buf is BIAS


@pytest.mark.parametrize("nest", [
    _nest(rows=M // 2),            # half the product's rows
    _nest(target=A),               # another buffer
    _nest(op="*"),                 # not an add
    _nest(relu=A),                 # the ReLU of another buffer
    _nest(relu=C, floor=1.0),      # not a ReLU
])
def test_nests_other_than_a_bias_over_the_output_stay(nest):
    product = _split_product(False)
    assert _fold(product, nest) == (product, nest)


def test_blas_products_and_the_switch_keep_the_nest(monkeypatch):
    product = _split_product(False)
    blas = Loop("_c", 0, 2, Block((replace(product.body.stmts[0], panel=()),)), LoopKind.PARALLEL)
    assert len(_fold(blas, _nest())) == 2
    monkeypatch.setenv("LATTE_FOLD_BIAS", "0")
    assert len(_fold(product, _nest())) == 2
