"""Epilogue folding (:mod:`latte.compiler.passes.epilogue`): an element-wise nest after a
tiled product (a bias, a ReLU, a batch norm and a residual add) runs as the product stores
its tiles. Folded nets give the same bits as unfolded ones and agree with level 0; nests
that do not assign exactly the product's region, element for element, stay."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers import WeightedSumLoss, assert_scaled_close, run_alike, vector_registers

import latte.stdlib as stdlib
from latte import Net, Phase
from latte.compiler import Segment, TimeSteps
from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    Buffer,
    Call,
    Const,
    Gemm,
    Kernel,
    Load,
    Loop,
    LoopKind,
    Ref,
    walk,
)
from latte.compiler.passes.epilogue import fold_epilogues
from latte.compiler.program import HostStep
from latte.compiler.schedule import _fold_across
from latte.stdlib import (
    ConvolutionLayer,
    FullyConnectedLayer,
    LSTMLayer,
    MaxPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
    SoftmaxLossLayer,
)
from latte.zoo.nets import bottleneck


def _kernels(net: Net) -> list[Kernel]:
    out = []
    for step in (*net.program.forward, *net.program.test):
        segs = step.steps if isinstance(step, TimeSteps) else [step]
        out += [k for s in segs if isinstance(s, Segment) for k in s.kernels]
    return out


def _biased(net: Net) -> set[str]:
    """The biases added by tiled products in ``net``'s forward and test code."""
    return {op[0].name for k in _kernels(net) for g in walk(k.body) if isinstance(g, Gemm)
            for op in g.operands() if op[0].name.endswith(".bias")}


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
    monkeypatch.setenv("LATTE_FOLD_EPILOGUES", "0")
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
             and {op[0].name for op in g.operands()} & {"c1.bias", "c2.bias"}]
    assert gemms and all([op[2:] for op in g.operands()] == [(1, 0)] for g in gemms)
    assert all(any(isinstance(n, BinOp) and n.op == "max" for n in walk(g.epilogue))
               for g in gemms)
    assert not any(isinstance(n, Assign) and isinstance(n.value, BinOp) and n.value.op == "max"
                   and isinstance(n.target, Ref) and n.target.buffer in {g.c_buf for g in gemms}
                   for k in _kernels(net) for n in walk(k.body))


def test_products_blas_runs_keep_their_nests(monkeypatch):
    monkeypatch.setenv("LATTE_PACK", "0")
    net = _mlp(3)
    assert not _biased(net) and _bias_nests(net) == {"fc1.bias", "fc2.bias", "out.bias"}


def _bottleneck(level: int, batch: int) -> Net:
    """A ResNet bottleneck with a strided 1x1 projection (a stage's first block), batch
    norm statistics and parameters away from 0 and 1."""
    net = Net(batch, opt_level=level, num_threads=2, seed=0)
    x = MemoryDataLayer(net, "x", (16, 14, 14))
    WeightedSumLoss(net, "loss", bottleneck(stdlib, "b", net, x, 8, 2))
    net.init()
    rng = np.random.default_rng(1)
    for p in net.params:
        p.value[...] += 0.3 * rng.standard_normal(p.value.shape)
    for key, v in net.state.items():
        v[...] = rng.uniform(0.5, 2.0, v.shape) if key.endswith("var") else rng.standard_normal(v.shape)
    net.value(x)[...] = rng.standard_normal(net.value(x).shape)
    return net


@pytest.mark.parametrize("batch", [1, 2])
def test_a_test_forward_runs_batch_norm_add_and_relu_as_the_products_epilogue(monkeypatch,
                                                                              batch):
    """The test forward of a bottleneck at opt 3: the 1x1 convolutions' products run their
    batch norm and ReLU (the projection's: its batch norm, the residual add and the ReLU)
    as they store their tiles, and store no C of their own (nothing reads it). The output and
    every training gradient equal level 0's; the training forward keeps its nests."""
    vector_registers(monkeypatch, 512, 32)
    monkeypatch.setenv("LATTE_IN_PLACE", "1")
    fused, plain = _bottleneck(3, batch), _bottleneck(0, batch)
    tested = {g.c_buf.name.split(".")[0]: g for step in fused.program.test
              if isinstance(step, Segment) for k in step.kernels for g in walk(k.body)
              if isinstance(g, Gemm)}
    # at batch 2 the first batch norm starts a skewed group with the 3x3 convolution
    for conv in ("b_conv1", "b_conv3", "b_proj")[batch - 1:]:
        g = tested[conv]
        assert g.epilogue is not None and not g.c_stored, conv
        assert {f"{conv}_bn.scale", f"{conv}_bn_mean.value"} <= {op[0].name for op in g.operands()}
    assert "b_add.value" in {op[0].name for op in tested["b_proj"].operands()}
    trained = [g for step in fused.program.forward if isinstance(step, Segment)
               for k in step.kernels for g in walk(k.body) if isinstance(g, Gemm)]
    assert trained and not any(op[0].name.endswith("_bn.scale") for g in trained
                               for op in g.operands())
    for phase in (Phase.TEST, Phase.TRAIN, Phase.TEST):
        for net in (fused, plain):
            net.forward(phase)
        assert_scaled_close(fused.value("b_relu"), plain.value("b_relu"), 1e-5, f"{phase}")
        if phase is Phase.TRAIN:
            fused.backward()
            plain.backward()
            for p, q in zip(fused.params, plain.params, strict=True):
                assert_scaled_close(p.grad, q.grad, 1e-4, f"gradient of {p.name}")


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
          bias: bool = True, relu: Buffer | None = None, floor: float = 0.0,
          source: Buffer | None = None, call: bool = False) -> Loop:
    """``target[i, j] op= bias[j]`` over ``rows`` rows (``bias[i]`` with ``by_row``;
    ``exp(bias[j])`` with ``call``), then, given ``relu``, ``relu[i, j] = max(source[i, j],
    floor)`` (``source`` ``relu`` if None)."""
    i, j = Affine.of("i"), Affine.of("j")
    value = Load(Ref(BIAS, (i if by_row else j, Affine()), (N, 1)))
    stmts = (AugAssign(Ref(target, (i, j), (M, N)), op,
                       Call("exp", (value,)) if call else value),) * bias
    if relu is not None:
        at = Ref(relu, (i, j), (M, N))
        stmts += (Assign(at, BinOp("max", Load(Ref(source or relu, (i, j), (M, N))),
                                   Const(floor))),)
    return Loop("i", 0, rows, Block((Loop("j", 0, N, Block(stmts)),)), LoopKind.PARALLEL)


def _fold(*stmts) -> tuple:
    return fold_epilogues(Kernel("k", Block(stmts))).body.stmts


def _ops(body: Block) -> list[str]:
    """The operators of an epilogue's statements, in order."""
    return [n.op for n in walk(body) if isinstance(n, BinOp)]


@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_the_bias_follows_each_threads_block(rows, beta):
    (loop,) = _fold(_split_product(rows, beta), _nest())
    g = loop.body.stmts[0]
    # columns split: thread _c's block starts at column 32 * _c, and so does its bias
    assert g.operands() == ((BIAS, Affine() if rows else Affine.of("_c", N // 2), 0, 1),)
    assert g.beta == beta and _ops(g.epilogue) == ["+"]


@pytest.mark.parametrize("rows", [True, False])
def test_a_bias_per_row_follows_each_threads_rows(rows):
    (loop,) = _fold(_split_product(rows), _nest(by_row=True, relu=C))
    g = loop.body.stmts[0]
    # rows split: thread _c's block starts at row 4 * _c, and so does its bias
    assert g.operands() == ((BIAS, Affine.of("_c", M // 2) if rows else Affine(), 1, 0),)
    assert _ops(g.epilogue) == ["+", "max"]


def test_a_relu_alone_and_a_product_inside_a_tile_loop_fold():
    (loop,) = _fold(_split_product(False), _nest(bias=False, relu=C))
    assert not loop.body.stmts[0].operands() and _ops(loop.body.stmts[0].epilogue) == ["max"]
    tiles = Loop("t", 0, 3, Block((_split_product(True), _nest())))
    ((inner,),) = [s.body.stmts for s in _fold(tiles)]
    assert [op[0] for op in inner.body.stmts[0].operands()] == [BIAS]


def test_a_relu_is_folded_into_blocks_of_k():
    """A product run in blocks of ``k`` (each adding to C) takes the bias and the ReLU too:
    its last block runs them on the finished sum (the micro-kernel's tests check the
    numbers)."""
    product = _split_product(False)
    blocked = replace(product, body=Block((replace(product.body.stmts[0], k_block=2),)))
    (folded,) = _fold(blocked, _nest(relu=C))
    assert _ops(folded.body.stmts[0].epilogue) == ["+", "max"]


def test_a_nest_into_another_buffer_and_one_after_it_fold():
    """Any element-wise arithmetic over the product's element folds: a product, then its
    clamp at 1 into another buffer, then a second nest (the product scaled by the column's
    bias): the second nest's statements run after the first's. A third nest, which touches
    the other buffer alone, stays (its place in the product's blocks is not C's)."""
    out = Buffer(("out",), "out", (M, N))
    third = _nest(target=out)
    loop, rest = _fold(_split_product(False), _nest(bias=False, relu=out, floor=1.0, source=C),
                       _nest(op="*"), third)
    g = loop.body.stmts[0]
    assert [op[0] for op in g.operands()] == [out, BIAS]
    assert _ops(g.epilogue) == ["max", "*"] and rest is third


@pytest.mark.parametrize("nest", [
    _nest(rows=M // 2),            # half the product's rows
    _nest(target=A),               # another buffer alone: no element of the product
    _nest(relu=A),                 # writes the product's A
    _nest(bias=False, relu=A, source=C),   # the same, from C
    _nest(call=True),              # a function the epilogue does not compute
])
def test_nests_other_than_element_wise_arithmetic_over_the_output_stay(nest):
    product = _split_product(False)
    assert _fold(product, nest) == (product, nest)


def test_blas_products_and_the_switch_keep_the_nest(monkeypatch):
    product = _split_product(False)
    blas = Loop("_c", 0, 2, Block((replace(product.body.stmts[0], panel=()),)), LoopKind.PARALLEL)
    assert len(_fold(blas, _nest())) == 2
    monkeypatch.setenv("LATTE_FOLD_EPILOGUES", "0")
    assert len(_fold(product, _nest())) == 2


def test_a_nest_in_the_next_kernel_folds_into_the_product_of_the_test_forward():
    """The test forward folds across kernels (and segments) where nothing runs between
    them: the nest's kernel, its nest now the product's epilogue, keeps its other
    statements (none here) and its place, in the product's segment; a host step between
    them keeps them apart."""
    product, nest = Kernel("p", Block((_split_product(False),))), Kernel("q", Block((_nest(),)))
    other = Kernel("r", Block((_nest(target=A),)))
    steps, pairs = _fold_across([Segment("s0", (product,)), Segment("s1", (nest, other))])
    ((folded, emptied, rest),) = [s.kernels for s in steps]
    assert pairs == {"p": (product, nest)} and rest is other
    assert folded.name == "p" and emptied.name == "q" and not emptied.body.stmts
    assert [op[0] for op in folded.body.stmts[0].body.stmts[0].operands()] == [BIAS]
    host = HostStep(None, "test")
    apart = [Segment("s0", (product,)), host, Segment("s1", (nest,))]
    assert _fold_across(apart) == (apart, {})


def test_a_sum_over_the_rows_stays():
    """``s[j] += C[i, j]``: every row writes the same elements; in tiles, in any order and
    on any thread, the sum would come out otherwise."""
    i, j = Affine.of("i"), Affine.of("j")
    total = Buffer(("s",), "s", (N,))
    nest = Loop("i", 0, M, Block((Loop("j", 0, N, Block((
        AugAssign(Ref(total, (j,), (N,)), "+", Load(Ref(C, (i, j), (M, N)))),))),)))
    product = _split_product(True)
    assert _fold(product, nest) == (product, nest)


@pytest.mark.parametrize("kind", [LoopKind.PARALLEL, LoopKind.SERIAL])
def test_a_batch_loop_folds_into_the_products_unless_only_theirs_runs_in_parallel(kind):
    """Per item, a product, then per item a bias nest: one loop, each item's nest in its
    product's epilogue, where the nest's loop runs in parallel too (its items proven
    independent) or the products' does not; a serial nest loop after parallel products
    stays."""
    items = Buffer(("c2",), "c2", (2, M, N))
    g = Gemm(M, N, K, A, Affine(), K, False, B, Affine(), N, False, items,
             Affine.of("n", M * N), N, beta=0.0, panel=(4, 32, 16), packed=False)
    i, j = Affine.of("i"), Affine.of("j")
    nest = Loop("i", 0, M, Block((Loop("j", 0, N, Block((AugAssign(
        Ref(items, (Affine.of("n2"), i, j), (2, M, N)), "+",
        Load(Ref(BIAS, (j, Affine()), (N, 1)))),))),)))
    products = Loop("n", 0, 2, Block((g,)), LoopKind.PARALLEL)
    folded = _fold(products, Loop("n2", 0, 2, Block((nest,)), kind))
    if kind is LoopKind.SERIAL:
        assert len(folded) == 2
    else:
        ((product,),) = [s.body.stmts for s in folded]
        assert [op[0] for op in product.operands()] == [BIAS]
    serial = _fold(replace(products, kind=LoopKind.SERIAL), Loop("n2", 0, 2, Block((nest,))))
    assert len(serial) == 1 and serial[0].body.stmts[0].epilogue is not None


def test_a_bias_over_one_row_folds():
    """An FC layer at batch 1: its product has one row, the nest's row loop one item."""
    g = Gemm(1, N, K, A, Affine(), K, False, B, Affine(), N, False, C, Affine(), N,
             beta=0.0, panel=(1, 32, 16), packed=False)
    (folded,) = _fold(g, _nest(rows=1))
    assert [op[0] for op in folded.operands()] == [BIAS]
