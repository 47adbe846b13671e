"""Zero-init folding rewrites a first write only where nothing else touched the buffer."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WeightedSumLoss, fill

from latte import Ensemble, Net, Neuron, add_connections
from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    Block,
    Buffer,
    Const,
    Kernel,
    Load,
    Loop,
    Ref,
    walk,
)
from latte.compiler.passes.zero_init import fold_across, fold_zero_init, region
from latte.stdlib import ConvolutionLayer, MemoryDataLayer


class CrossChannelNorm(Neuron):
    """An LRN written the natural way: its own input one-to-one, and a window of channels
    over the same source; backward writes the one-to-one gradient first."""

    def forward(self):
        s = 0.0
        for i in range(len(self.inputs[1])):
            s += self.inputs[1][i] * self.inputs[1][i]
        self.value = self.inputs[0][0] / (1.0 + 0.1 * s)

    def backward(self):
        s = 0.0
        for i in range(len(self.inputs[1])):
            s += self.inputs[1][i] * self.inputs[1][i]
        d = 1.0 + 0.1 * s
        x = self.inputs[0][0]
        self.grad_inputs[0][0] += self.grad / d
        for i in range(len(self.inputs[1])):
            self.grad_inputs[1][i] += -self.grad * x * 0.2 * self.inputs[1][i] / (d * d)


def _conv_norm(opt_level: int) -> dict[str, np.ndarray]:
    net = Net(2, opt_level=opt_level, num_threads=1, seed=1)
    x = MemoryDataLayer(net, "x", (4, 6, 6))
    conv = ConvolutionLayer("conv", net, x, 5, 3, pad=1)
    norm = Ensemble(net, "norm", CrossChannelNorm, (5, 6, 6))
    add_connections(net, conv, norm, lambda c, y, x_: (c, y, x_))
    add_connections(net, conv, norm, lambda c, y, x_: (range(c - 1, c + 2), y, x_), padding=0.0)
    WeightedSumLoss(net, "loss", norm)
    net.init()
    fill(net, x, np.random.default_rng(0))
    net.forward()
    net.backward()
    return {"conv.grad": net.grad(conv).copy(), **{p.name: p.grad.copy() for p in net.params}}


@pytest.mark.parametrize("opt_level", (1, 2, 3))
def test_window_and_one_to_one_into_one_gradient(opt_level):
    """The window's ``+=`` from a neighbouring neuron (an earlier iteration of the same
    nest) reaches an element before the one-to-one write does: folding that write into a
    store wiped it out (a 3e-2 weight-gradient error before the fix)."""
    want, got = _conv_norm(0), _conv_norm(opt_level)
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                                   err_msg=name)


def test_zero_init_folds_only_the_zeroed_run():
    """Hand-built IR: a producer's zeroing of its run ``[4, 12)`` of each item of a join's
    ``(2, 16)`` buffer folds into a ``+=`` over exactly that run (which becomes a store);
    not into one over part of it, nor, for a buffer zeroed whole before the kernel (a
    gradient), into a write of one run."""
    buf = Buffer(("cat", "value"), "cat.value", (2, 16), batched=True)

    def nest(body_of, extent: int):
        return Loop("n", 0, 2, Block((Loop("i", 0, extent, Block((body_of(
            Ref(buf, (Affine.of("n"), Affine.build({"i": 1}, 4)), (2, 16))),))),)))

    zero = nest(lambda ref: Assign(ref, Const(0.0)), 8)
    run, part = (nest(lambda ref: AugAssign(ref, "+", Const(1.0)), n) for n in (8, 4))
    for write, kinds in ((run, [Assign]), (part, [Assign, AugAssign])):
        out, _ = fold_zero_init(Kernel("k", Block((zero, write)), None, "forward"))
        assert [type(n) for n in walk(out.body) if isinstance(n, (Assign, AugAssign))] == kinds
    out, folded = fold_zero_init(Kernel("k", Block((run,)), None, "backward"), frozenset({buf}))
    assert not folded and isinstance(out.body.stmts[0].body.stmts[0].body.stmts[0], AugAssign)
    assert region(4, [(16, 2), (1, 8), (3, 1)]) == (4, ((1, 8), (16, 2)))
    assert region(0, [(4, 4), (1, 4)]) == (0, ((1, 16),))
    assert region(0, [(1, 4), (2, 3)]) is None   # element 2 twice


def test_a_tile_of_stores_folds_together_but_not_two_stores_of_one_element():
    """Hand-built IR: the four stores of a Winograd 2x2 output tile (offsets ``0, 1, W,
    W + 1`` apart under the same loops) overwrite a zeroed buffer together; two ``+=`` of
    the same element (a window of one and a one-to-one read of one source, random case
    140) must stay sums."""
    buf = Buffer(("out", "value"), "out.value", (2, 4, 4), batched=True)
    zero = Loop("z", 0, buf.size, Block((Assign(Ref(buf, (Affine.of("z"),), (buf.size,)),
                                                Const(0.0)),)))

    def tile(offsets):
        stores = tuple(AugAssign(Ref(buf, (Affine.of("n"), Affine.build({"y": 2}, i),
                                           Affine.build({"x": 2}, j)), buf.shape), "+", Const(1.0))
                       for i, j in offsets)
        return Loop("n", 0, 2, Block((Loop("y", 0, 2, Block((Loop("x", 0, 2, Block(stores)),))),)))

    def kinds(write):
        out, _ = fold_zero_init(Kernel("k", Block((zero, write)), None, "forward"))
        return [type(n).__name__ for n in walk(out.body) if isinstance(n, (Assign, AugAssign))]

    assert kinds(tile([(0, 0), (0, 1), (1, 0), (1, 1)])) == ["Assign"] * 4
    assert kinds(tile([(0, 0), (0, 0)])) == ["Assign", "AugAssign", "AugAssign"]
    assert kinds(tile([(0, 0), (0, 1), (1, 0)])) == ["Assign", "AugAssign", "AugAssign", "AugAssign"]


def test_writes_in_several_kernels_overwrite_together_before_the_first_read():
    """Hand-built IR: two kernels each storing half of every row of a zeroed ``(4, 8)``
    buffer, under sibling loops alike (an LSTM step's gates), overwrite it together, and a
    third kernel reading it afterwards is left alone; a read before the second half is
    written, or a half written twice, keeps the sums."""
    buf = Buffer(("g", "grad"), "g.grad", (4, 8), batched=True)

    def ref(half):
        return Ref(buf, (Affine.of("n"), Affine.build({"i": 1}, 4 * half)), buf.shape)

    def write(half):
        return Kernel(f"w{half}", Block((Loop("n", 0, 4, Block((Loop("i", 0, 4, Block((
            AugAssign(ref(half), "+", Const(1.0)),))),))),)), None, "backward")

    read = Kernel("r", Block((Loop("n", 0, 4, Block((Loop("i", 0, 4, Block((
        AugAssign(ref(0), "+", Load(ref(1))),))),))),)), None, "backward")

    def kinds(kernels):
        out = fold_across(kernels, buf)
        return None if out is None else [type(n).__name__ for k in out for n in walk(k.body)
                                         if isinstance(n, (Assign, AugAssign))]

    assert kinds([write(0), write(1), read]) == ["Assign", "Assign", "AugAssign"]
    assert kinds([write(0), read, write(1)]) is None
    assert kinds([write(0), write(0), write(1)]) is None
    assert kinds([write(0)]) is None
