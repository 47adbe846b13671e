"""Memory safety by construction: every index is proven inside what it indexes, or the
program is rejected naming the neuron's file:line; guarded programs that are safe compile;
``LATTE_CHECK_BOUNDS=1`` catches at run time what a verifier would miss."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import latte.compiler.verify as verify
from latte import Ensemble, Field, Net, Neuron, Param, add_connections
from latte.compiler.codegen import ModuleBuilder
from latte.compiler.ir import (
    Affine,
    Assign,
    BinOp,
    Block,
    Buffer,
    Compare,
    Const,
    If,
    Kernel,
    Load,
    Loc,
    Loop,
    Ref,
    Var,
)
from latte.errors import CompileError, MappingError, NeuronSyntaxError
from latte.stdlib import MemoryDataLayer

SRC = pathlib.Path(__file__).read_text().splitlines()


def bad_line(neuron_type: type) -> int:
    """The line of ``neuron_type``'s forward marked ``# BAD``."""
    first = neuron_type.forward.__code__.co_firstlineno
    return next(n for n, line in enumerate(SRC, 1) if n > first and line.endswith("# BAD"))


def build(neuron_type: type, width: int = 4, n: int = 3, batch: int = 2, **fields) -> Net:
    net = Net(batch, opt_level=0)
    x = MemoryDataLayer(net, "x", (width,))
    ens = Ensemble(net, "ens", neuron_type, (n,), **fields)
    add_connections(net, x, ens, lambda o: (range(width),))
    return net


# ---------------------------------------------------------------- rejected programs

class GuardedParam(Neuron):
    w: Param

    def forward(self):
        for i in range(len(self.inputs[0])):
            if i > 1:
                self.value += self.w[i + 2] * self.inputs[0][i]  # BAD


class ConstantPastTheEnd(Neuron):
    def forward(self):
        self.value = self.inputs[0][5]  # BAD


class Negative(Neuron):
    def forward(self):
        self.value = self.inputs[0][-1]  # BAD


class Spill(Neuron):
    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.inputs[0][i + 1]  # BAD


class GradSpill(Neuron):
    def forward(self):
        self.value = self.inputs[0][0]

    def backward(self):
        for i in range(len(self.inputs[0])):
            if i >= 0:
                self.grad_inputs[0][2 * i] += self.grad


class Halves(Neuron):
    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.inputs[0][i // 2 + 2]  # BAD


@pytest.mark.parametrize("neuron_type, message", [
    (GuardedParam, r"index i \+ 2 of self.w ranges over 4..5, outside its length 4"),
    (ConstantPastTheEnd, r"index 5 of self.inputs\[0\] ranges over 5..5, outside its length 4"),
    (Negative, r"index -1 of self.inputs\[0\] ranges over -1..-1, outside its length 4"),
    (Spill, r"index i \+ 1 of self.inputs\[0\] ranges over 1..4, outside its length 4"),
    (Halves, r"index \(i // 2\) \+ 2 of self.inputs\[0\] ranges over 2..3, outside its length 3"),
])
def test_out_of_range_index_is_rejected_naming_the_line(neuron_type, message):
    width = 3 if neuron_type is Halves else 4
    fields = {"w": np.ones((3, 4), np.float32)} if neuron_type is GuardedParam else {}
    net = build(neuron_type, width, **fields)
    with pytest.raises(CompileError,
                       match=rf"test_safety.py:{bad_line(neuron_type)}: ensemble 'ens': {message}"):
        net.init()


def test_backward_index_is_checked_too():
    net = build(GradSpill)
    with pytest.raises(CompileError, match=r"ensemble 'ens': index 2 \* i of self.grad_inputs\[0\] "
                                           r"ranges over 0..6, outside its length 4 \(in backward"):
        net.init()


class Fractional(Neuron):
    def forward(self):
        self.value = self.inputs[0][0.5]  # BAD


class FloatLocalIndex(Neuron):
    def forward(self):
        k = 1
        self.value = self.inputs[0][k]  # BAD


class DividedIndex(Neuron):
    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.inputs[0][i / 2]  # BAD


@pytest.mark.parametrize("neuron_type", [Fractional, FloatLocalIndex, DividedIndex])
def test_non_integer_index_is_rejected(neuron_type):
    net = build(neuron_type)
    with pytest.raises(NeuronSyntaxError,
                       match=rf"test_safety.py:{bad_line(neuron_type)}: index .* is not an integer"):
        net.init()


class AssignedUnderIf(Neuron):
    def forward(self):
        for i in range(len(self.inputs[0])):
            if self.inputs[0][i] > 0:
                t = self.inputs[0][i]
        self.value = t  # BAD


class AssignedInOneBranch(Neuron):
    def forward(self):
        if self.inputs[0][0] > 0:
            t = 1.0
        else:
            self.value = 2.0
        self.value += t  # BAD


class AssignedInEmptyLoop(Neuron):
    def forward(self):
        for i in range(0):
            t = self.inputs[0][i]
        self.value = t  # BAD


class UpdatedUnderIf(Neuron):
    def forward(self):
        if self.inputs[0][0] > 0:
            t = 1.0
        t += 1.0  # BAD
        self.value = t


@pytest.mark.parametrize("neuron_type", [AssignedUnderIf, AssignedInOneBranch, AssignedInEmptyLoop,
                                         UpdatedUnderIf])
def test_possibly_unassigned_local_is_rejected(neuron_type):
    net = build(neuron_type)
    with pytest.raises(NeuronSyntaxError,
                       match=rf"test_safety.py:{bad_line(neuron_type)}: local 't' .* before it is "
                             "assigned on some path"):
        net.init()


def test_large_mapping_reading_far_outside_at_one_neuron_is_rejected():
    net = Net(1, opt_level=0)
    x = MemoryDataLayer(net, "x", (70, 70))
    ens = Ensemble(net, "ens", ConstantPastTheEnd, (70, 70))   # 4900 neurons: never sampled
    add_connections(net, x, ens, lambda y, z: (y, z) if (y, z) != (33, 44) else (1000, z))
    with pytest.raises(MappingError, match=r"test_safety.py:\d+: connection 'x' -> 'ens': sink "
                                           r"neuron \(33, 44\) of 'ens' reads \(1000, 44\) outside"):
        net.init()


# ---------------------------------------------------------------- safe programs compile

class Copy(Neuron):
    def forward(self):
        self.value = self.inputs[0][0]


class NextDifference(Neuron):
    def forward(self):
        for i in range(len(self.inputs[0])):
            if i + 1 < len(self.inputs[0]):
                self.value += self.inputs[0][i + 1] - self.inputs[0][i]
            else:
                self.value += self.inputs[0][i] if i > 0 else self.inputs[0][i - 1]
        pick = 0.0
        if self.inputs[0][0] > 0:
            pick = self.inputs[0][1]
        else:
            pick = self.inputs[0][2]
        self.value += pick + self.inputs[0][(2 * len(self.inputs[0]) - 1) // 2]


class Scaled(Neuron):
    w: Field

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.w[i % 2] * self.inputs[0][max(i - 1, 0)]


@pytest.mark.parametrize("opt_level", [0, 3])
def test_guarded_and_derived_indices_compile_and_compute(opt_level):
    net = Net(2, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (2, 5))
    nd = Ensemble(net, "nd", NextDifference, (2,))
    add_connections(net, x, nd, lambda c: (c, range(5)))
    sc = Ensemble(net, "sc", Scaled, (2,), w=np.array([[1.0, 2.0], [3.0, 4.0]], np.float32))
    add_connections(net, x, sc, lambda c: (c, range(5)))
    net.init()
    v = np.random.default_rng(0).standard_normal((2, 2, 5)).astype(np.float32)
    net.value(x)[...] = v
    net.forward()
    v = v.astype(np.float64)
    want = (v[..., 4] - v[..., 0]) + v[..., 4] + np.where(v[..., 0] > 0, v[..., 1], v[..., 2]) \
        + v[..., 4]
    np.testing.assert_allclose(net.value(nd), want, rtol=1e-5, atol=1e-5)
    w = np.array([[1.0, 2.0], [3.0, 4.0]])
    prev = v[..., [0, 0, 1, 2, 3]]
    np.testing.assert_allclose(net.value(sc), (w[None, :, [0, 1, 0, 1, 0]] * prev).sum(-1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opt_level", [0, 3])
def test_large_mapping_breaking_its_pattern_at_one_neuron_is_gathered(opt_level):
    """4900 neurons (more than the old sample threshold): one neuron reads another source
    neuron; every neuron is checked, so the mapping is a gather, and computes what it says."""
    net = Net(1, opt_level=opt_level)
    x = MemoryDataLayer(net, "x", (70, 70))
    ens = Ensemble(net, "ens", Copy, (70, 70))
    add_connections(net, x, ens, lambda y, z: (y, z) if (y, z) != (33, 44) else (0, 7))
    net.init()
    assert net.program.plans[0].accesses[0].dims is None   # not affine: a gather table
    v = np.random.default_rng(1).standard_normal((1, 70, 70)).astype(np.float32)
    net.value(x)[...] = v
    net.forward()
    want = v.copy()
    want[0, 33, 44] = v[0, 0, 7]
    np.testing.assert_array_equal(net.value(ens), want)


# ---------------------------------------------------------------- the kernel verifier

BUF = Buffer(("t", "b"), "b", (8,))
LOC = Loc("net.py", 12)


def _kernel(*stmts) -> Kernel:
    return Kernel("k.forward", Block(stmts))


def _store(index, loc=LOC):
    return Assign(Ref(BUF, (index,), (8,)), Const(1.0), loc)


def test_verify_kernel_proves_guarded_accesses():
    i = Affine.of("i")
    guarded = If(Compare("<", i + 2, Const(8)), Block((_store(i + 2),)))
    halves = _store(BinOp("%", BinOp("//", i + 5, Const(2)), Const(8)))
    clamped = _store(BinOp("min", i + 3, Const(7)))
    other = If(Compare(">=", i, Const(4)), Block(()), Block((_store(i + 4),)))  # else: i < 4
    verify.verify_kernel(_kernel(Loop("i", 0, 10, Block((guarded, halves, clamped, other)))))


@pytest.mark.parametrize("stmt, message", [
    (_store(Affine.of("i", 1, 1)), r"net.py:12: k.forward: index i \+ 1 \(dimension 0\) of b "
                                   r"ranges over 1..9, outside its extent 8"),
    (If(Compare("<", Affine.of("i"), Const(9)), Block((_store(Affine.of("i")),))),
     r"ranges over 0..8"),
    (If(Compare("<", Load(Ref(BUF, (Affine(),), (8,))), Const(3.0)), Block((_store(Affine.of("i")),))),
     r"ranges over 0..8"),   # a float condition proves nothing
    (_store(BinOp("//", Affine.of("i", 1, -3), Const(2))), r"ranges over -2..2"),
    (_store(Var("x")), r"variable 'x' is neither a loop variable nor a local"),
    (_store(Affine.of("j")), r"unbound variable\(s\) \['j'\]"),
    (Loop("i", 0, 2, Block(())), r"loop variable 'i' captures"),
])
def test_verify_kernel_rejects(stmt, message):
    with pytest.raises(CompileError, match=message):
        verify.verify_kernel(_kernel(Loop("i", 0, 9, Block((stmt,)))))


# ---------------------------------------------------------------- LATTE_CHECK_BOUNDS

class Shifted(Neuron):
    w: Param

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.w[i + 1] * self.inputs[0][i]


def test_check_bounds_mode_catches_what_the_verifier_misses(monkeypatch, tmp_path):
    """A verifier that proves everything (a stand-in for a verifier bug) lets ``w[i + 1]``
    through; the checked code skips the access past the buffer and the executor names it."""
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LATTE_CHECK_BOUNDS", "1")
    monkeypatch.setattr(verify, "index_range", lambda *args, **kwargs: None)
    for _ in range(2):   # the second compile comes from the disk cache
        net = build(Shifted, w=np.ones((3, 4), np.float32))
        net.init()
        with pytest.raises(CompileError, match=r"kernel ens.forward: buffer ens.w \(12 elements\)"
                                               r".*offset 12, outside the buffer"):
            net.forward()
    assert net.program.library.from_cache
    net.value(net.ensembles[0])[...] = 1.0   # the flag was cleared: the error repeats, no crash
    with pytest.raises(CompileError, match="ens.w"):
        net.forward()


def test_check_bounds_changes_the_code(monkeypatch):
    kernel = _kernel(Loop("i", 0, 8, Block((_store(Affine.of("i")),))))

    def text() -> str:
        mb = ModuleBuilder({BUF: 0})
        mb.add_segment("seg", [kernel])
        return str(mb.module)

    plain = text()
    monkeypatch.setenv("LATTE_CHECK_BOUNDS", "1")
    checked = text()
    assert "latte_bounds_site" in checked and "latte_bounds_site" not in plain
