"""Compiler front stages without LLVM: mapping analysis, neuron parsing, layering of imports."""

from __future__ import annotations

import ast
import math
import pathlib
from types import SimpleNamespace

import islpy as isl
import numpy as np
import pytest

import latte
from latte.compiler.frontend import NeuronInfo, NeuronRef, parse_method
from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    Call,
    Compare,
    Const,
    If,
    Loop,
    Select,
    UnaryOp,
    Var,
)
from latte.compiler.mapping import analyze_connection, sink_var
from latte.errors import MappingError, NeuronSyntaxError
from latte.lang import Connection, Neuron, Param


def _conn(src_shape, sink_shape, mapping, padding=None) -> Connection:
    src = SimpleNamespace(name="src", shape=tuple(src_shape))
    sink = SimpleNamespace(name="sink", shape=tuple(sink_shape))
    return Connection(src, sink, mapping, padding)


def _aff(const: int = 0, **coeffs: int) -> Affine:
    """``_aff(1, d0=2)`` is ``1 + 2 * %0`` over sink dims."""
    return Affine.build({sink_var(int(k[1:])): c for k, c in coeffs.items()}, const)


def test_fully_connected_mapping():
    acc = analyze_connection(_conn((2, 3, 3), (4,), lambda o: (range(2), range(3), range(3))))
    assert acc.table is None and acc.in_bounds
    assert [(d.lo, d.step, d.length) for d in acc.dims] == [(_aff(), 1, 2), (_aff(), 1, 3),
                                                             (_aff(), 1, 3)]
    assert acc.length == 18 and acc.shape == (2, 3, 3)
    assert acc.shared_dims() == (0,)
    assert acc.relation.is_equal(isl.Map(
        "{ [d] -> [a, b, c] : 0 <= d < 4 and 0 <= a < 2 and 0 <= b < 3 and 0 <= c < 3 }"))


@pytest.mark.parametrize("stride", [1, 2])
def test_convolution_mapping(stride):
    out = 3
    size = (out - 1) * stride + 3
    acc = analyze_connection(_conn(
        (2, size, size), (4, out, out),
        lambda c, y, x: (range(2), range(stride * y, stride * y + 3), range(stride * x, stride * x + 3))))
    assert acc.table is None and acc.in_bounds
    assert [(d.lo, d.step, d.length) for d in acc.dims] == [
        (_aff(), 1, 2), (_aff(d1=stride), 1, 3), (_aff(d2=stride), 1, 3)]
    assert acc.shared_dims() == (0,)  # every filter reads the same window


def test_padded_convolution_mapping():
    mapping = lambda c, y, x: (range(2), range(y - 1, y + 2), range(x - 1, x + 2))  # noqa: E731
    acc = analyze_connection(_conn((2, 4, 4), (3, 4, 4), mapping, padding=0.0))
    assert not acc.in_bounds
    assert [(d.lo, d.length) for d in acc.dims] == [(_aff(), 2), (_aff(-1, d1=1), 3),
                                                     (_aff(-1, d2=1), 3)]
    with pytest.raises(MappingError, match="outside source 'src'"):
        analyze_connection(_conn((2, 4, 4), (3, 4, 4), mapping))


def test_one_to_one_and_strided_mappings():
    acc = analyze_connection(_conn((5,), (5,), lambda i: (i,)))
    assert [(d.lo, d.step, d.length) for d in acc.dims] == [(_aff(d0=1), 1, 1)]
    assert acc.shared_dims() == ()
    acc = analyze_connection(_conn((4, 6), (2, 3), lambda a, b: (2 * a + 1, range(b, 6, 3))))
    assert [(d.lo, d.step, d.length) for d in acc.dims] == [(_aff(1, d0=2), 1, 1),
                                                             (_aff(d1=1), 3, 2)]
    assert acc.shared_dims() == ()
    acc = analyze_connection(_conn((6,), (2, 3), lambda a, b: (b,)))  # broadcast along dim 0
    assert acc.shared_dims() == (0,)


def test_non_affine_mapping_falls_back_to_a_table():
    n = 7
    acc = analyze_connection(_conn((n,), (n,), lambda i: ((i * i) % n,)))
    assert acc.dims is None and acc.relation is None and acc.in_bounds
    np.testing.assert_array_equal(acc.table, [[(i * i) % n] for i in range(n)])
    assert acc.length == 1 and acc.shared_dims() == ()
    acc = analyze_connection(_conn((3, 3), (4,), lambda i: ((i * i) % 3, range(3))))
    assert acc.dims is None
    np.testing.assert_array_equal(acc.table, [[3 * ((i * i) % 3) + j for j in range(3)]
                                              for i in range(4)])
    acc = analyze_connection(_conn((2, 3), (4,), lambda i: (i % 2, range(3))))
    assert acc.quotients() == {0: 2}   # i % 2 == i - 2*(i // 2): quasi-affine, no table
    acc = analyze_connection(_conn((3,), (2, 2), lambda a, b: ((a * b) % 3,)))
    assert acc.shared_dims() == ()
    acc = analyze_connection(_conn((3,), (2, 3), lambda a, b: ((b * b) % 3,)))
    assert acc.shared_dims() == (0,)


def test_non_affine_mapping_with_padding_marks_pads():
    acc = analyze_connection(_conn((4,), (4,), lambda i: ((i * i) % 5 - 1,), padding=0.0))
    assert not acc.in_bounds
    np.testing.assert_array_equal(acc.table[:, 0], [-1, 0, 3, 3])
    with pytest.raises(MappingError, match=r"sink neuron \(0,\)"):
        analyze_connection(_conn((4,), (4,), lambda i: ((i * i) % 5 - 1,)))


def test_mapping_errors():
    with pytest.raises(MappingError, match="must be int or range"):
        analyze_connection(_conn((4,), (4,), lambda i: (float(i),)))
    with pytest.raises(MappingError, match=r"ZeroDivisionError.*sink neuron \(0,\)"):
        analyze_connection(_conn((4,), (4,), lambda i: (4 // i,)))
    with pytest.raises(MappingError, match="same number"):
        analyze_connection(_conn((4,), (4,), lambda i: (range((i * i) % 3 + 1),)))


# ---------------------------------------------------------------- parse_method

class DotNeuron(Neuron):
    weights: Param

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.weights[i] * self.inputs[0][i]

    def backward(self):
        t = self.grad * 2.0
        if t > 0.0:
            self.grad_weights[0] += max(t, 1.0)
        else:
            self.grad_inputs[0][1] += math.exp(-t) if t < -1.0 else 0.0


INFO = NeuronInfo(input_lengths=(3,), field_lengths={"weights": 3}, params=frozenset({"weights"}))


def test_parse_forward():
    body = parse_method(DotNeuron, "forward", INFO)
    i = Var("i")
    expected = Block((Loop("i", 0, 3, Block((
        AugAssign(NeuronRef("value"), "+",
                  BinOp("*", NeuronRef("field", "weights", index=(i,)),
                        NeuronRef("input", conn=0, index=(i,)))),))),))
    assert body == expected


def test_parse_backward_locals_branches_and_calls():
    body = parse_method(DotNeuron, "backward", INFO)
    t = Var("t")
    assert body.stmts[0] == Assign(t, BinOp("*", NeuronRef("grad"), Const(2.0)))
    branch = body.stmts[1]
    assert isinstance(branch, If) and branch.cond == Compare(">", t, Const(0.0))
    assert branch.then == Block((AugAssign(NeuronRef("grad_field", "weights", index=(Const(0),)),
                                           "+", BinOp("max", t, Const(1.0))),))
    assert branch.orelse == Block((AugAssign(
        NeuronRef("grad_input", conn=0, index=(Const(1),)), "+",
        Select(Compare("<", t, UnaryOp("neg", Const(1.0))), Call("exp", (UnaryOp("neg", t),)),
               Const(0.0))),))


class SyntaxNeuron(Neuron):
    weights: Param

    def forward(self):
        self.value = 1.0
        for i in range(3):
            i += 1  # BAD


def test_parse_errors_name_the_line():
    first = SyntaxNeuron.forward.__code__.co_firstlineno
    src = pathlib.Path(__file__).read_text().splitlines()
    bad = next(n for n, line in enumerate(src, 1) if n > first and line.endswith("# BAD"))
    with pytest.raises(NeuronSyntaxError, match=f"test_frontend.py:{bad}: cannot assign to loop"):
        parse_method(SyntaxNeuron, "forward", INFO)


class VectorFieldNeuron(Neuron):
    weights: Param

    def forward(self):
        self.value = self.weights


def test_unindexed_vector_field_is_an_error():
    with pytest.raises(NeuronSyntaxError, match="self.weights is a vector"):
        parse_method(VectorFieldNeuron, "forward", INFO)


# ---------------------------------------------------------------- layering

def test_lang_does_not_import_compiler_or_runtime():
    lang = pathlib.Path(latte.__file__).parent / "lang"
    files = sorted(lang.glob("*.py"))
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # resolve relative imports from latte.lang
                module = node.module or ""
                if node.level:
                    module = ".".join(["latte", "lang"][: 3 - node.level] + [module]).rstrip(".")
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(("latte.compiler", "latte.runtime", "latte.net")), (
                    f"{path.name} imports {name}")
