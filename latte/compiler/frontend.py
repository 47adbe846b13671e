"""Frontend: a neuron's ``forward``/``backward`` Python source -> kernel IR of one neuron.

The result uses :class:`NeuronRef` for the neuron's own fields (``self.value``,
``self.inputs[k][i]``, ``self.weights[i]``...); synthesis turns those into buffer refs.
Anything outside the neuron language is a :class:`NeuronSyntaxError` naming file and line,
and so are indices that are not integers and reads of locals that may be unassigned (a
local assigned only in one branch, or only in a loop that may not run): compiled code
would read the previous neuron's value. Every statement carries its :class:`Loc`.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from dataclasses import dataclass

from latte.compiler.ir import (
    Assign,
    AugAssign,
    BinOp,
    Block,
    BoolOp,
    Call,
    Compare,
    Const,
    Expr,
    If,
    Loc,
    Loop,
    Select,
    UnaryOp,
    Var,
)
from latte.errors import NeuronSyntaxError


@dataclass(frozen=True)
class NeuronRef(Expr):
    """A neuron's own field: ``kind`` is value, grad, input, grad_input, field or grad_field."""

    kind: str
    name: str = ""            # field name (field / grad_field)
    conn: int = -1            # connection number (input / grad_input)
    index: tuple[Expr, ...] = ()


@dataclass(frozen=True)
class NeuronInfo:
    """What the frontend needs to know of the ensemble a body is compiled for."""

    input_lengths: tuple[int, ...]          # len(self.inputs[k])
    field_lengths: dict[str, int]           # len(self.<field>) (vector size)
    params: frozenset[str]


_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
           ast.Mod: "%"}
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_MATH = {math.exp: "exp", math.log: "log", math.tanh: "tanh", math.sqrt: "sqrt"}
_BUILTINS = {"max": "max", "min": "min", "abs": "abs"}


def parse_method(neuron_type: type, method: str, info: NeuronInfo) -> Block:
    """Parse ``neuron_type.<method>`` into a Block of neuron-level IR."""
    func = getattr(neuron_type, method)
    try:
        lines, first = inspect.getsourcelines(func)
        filename = inspect.getsourcefile(func) or "<unknown>"
    except (OSError, TypeError) as exc:
        raise NeuronSyntaxError(f"cannot read the source of {neuron_type.__name__}.{method}: "
                                f"{exc}") from exc
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise NeuronSyntaxError(f"{neuron_type.__name__}.{method} must be a plain method",
                                filename, first)
    env = dict(func.__globals__)
    if func.__closure__:
        env.update(zip(func.__code__.co_freevars, (c.cell_contents for c in func.__closure__)))
    parser = _Parser(filename, first - 1, info, env, fdef.args.args[0].arg if fdef.args.args else "self")
    return parser.block(fdef.body)


class _Parser:
    def __init__(self, filename: str, line_offset: int, info: NeuronInfo, env: dict, selfname: str):
        self.filename, self.offset, self.info, self.env, self.self = (
            filename, line_offset, info, env, selfname)
        self.loop_vars: set[str] = set()
        self.locals: set[str] = set()
        self.assigned: set[str] = set()   # locals assigned on every path to this point

    def error(self, node: ast.AST, message: str) -> NeuronSyntaxError:
        return NeuronSyntaxError(message, self.filename, self.offset + getattr(node, "lineno", 1))

    def loc(self, node: ast.AST) -> Loc:
        return Loc(self.filename, self.offset + node.lineno)

    # ------------------------------------------------------------ statements
    def block(self, body: list[ast.stmt]) -> Block:
        out = []
        for stmt in body:
            s = self.stmt(stmt)
            if s is not None:
                out.append(s)
        return Block(tuple(out))

    def stmt(self, node: ast.stmt):
        if isinstance(node, ast.Pass) or (isinstance(node, ast.Expr)
                                          and isinstance(node.value, ast.Constant)
                                          and isinstance(node.value.value, str)):
            return None
        if isinstance(node, ast.Assign):
            if len(node.targets) != 1:
                raise self.error(node, "chained assignment is not supported in a neuron body")
            value = self.expr(node.value)
            return Assign(self.target(node.targets[0]), value, self.loc(node))
        if isinstance(node, ast.AugAssign):
            op = _BINOPS.get(type(node.op))
            if op not in ("+", "-", "*", "/"):
                raise self.error(node, f"augmented assignment {type(node.op).__name__} is not supported")
            target = self.target(node.target, augmented=True)
            return AugAssign(target, op, self.expr(node.value), self.loc(node))
        if isinstance(node, ast.For):
            return self.for_loop(node)
        if isinstance(node, ast.If):
            cond, before = self.expr(node.test), set(self.assigned)
            then = self.block(node.body)
            after_then, self.assigned = self.assigned, before
            orelse = self.block(node.orelse)
            self.assigned &= after_then   # assigned after the if: assigned in both branches
            return If(cond, then, orelse, self.loc(node))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            raise self.error(node, f"the call `{ast.unparse(node.value)}` is not supported in a "
                                   "neuron body (use for/range, if/else, assignments)")
        raise self.error(node, f"{type(node).__name__} statements are not supported in a neuron "
                               "body (use for/range, if/else, assignments)")

    def for_loop(self, node: ast.For) -> Loop:
        if not isinstance(node.target, ast.Name):
            raise self.error(node, "a for loop must bind a single name")
        if node.orelse:
            raise self.error(node, "for/else is not supported")
        it = node.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
                and it.func.id == "range" and 1 <= len(it.args) <= 2 and not it.keywords):
            raise self.error(node, "loops must be `for i in range(stop)` or `range(start, stop)`")
        bounds = [self.const_int(a) for a in it.args]
        start, stop = (0, bounds[0]) if len(bounds) == 1 else bounds
        var = node.target.id
        if var in self.locals:
            raise self.error(node, f"loop variable {var!r} is also used as a local variable")
        if var in self.loop_vars:
            raise self.error(node, f"loop variable {var!r} shadows the enclosing loop's")
        self.loop_vars.add(var)
        before = set(self.assigned)
        body = self.block(node.body)
        self.loop_vars.discard(var)   # out of scope after the loop (compiled code has no value)
        if stop <= start:   # the body never runs: what it assigns stays unassigned
            self.assigned = before
        return Loop(var, start, max(start, stop), body, loc=self.loc(node))

    def target(self, node: ast.expr, augmented: bool = False):
        if isinstance(node, ast.Name):
            if node.id in self.loop_vars:
                raise self.error(node, f"cannot assign to loop variable {node.id!r}")
            if augmented and node.id not in self.assigned:
                raise self.error(node, f"local {node.id!r} is updated before it is assigned"
                                       + self._unassigned_why(node.id))
            self.locals.add(node.id)
            self.assigned.add(node.id)
            return Var(node.id)
        ref = self.expr(node)
        if not isinstance(ref, NeuronRef) or ref.kind == "input":
            raise self.error(node, "only self.value, self.grad, self.grad_inputs[k][i], fields "
                                   "and local variables can be assigned")
        return ref

    # ------------------------------------------------------------ expressions
    def const_int(self, node: ast.expr) -> int:
        """A compile-time integer: literals, len(self.inputs[k]), len(self.<field>), arithmetic."""
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return int(node.value)
        if isinstance(node, ast.Name) and isinstance(self.env.get(node.id), int):
            return int(self.env[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv):
            a, b = self.const_int(node.left), self.const_int(node.right)
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b,
                    ast.FloorDiv: a // b if b else 0}[type(node.op)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len"
                and len(node.args) == 1):
            ref = self.expr(node.args[0], allow_vector=True)
            if isinstance(ref, NeuronRef) and ref.kind in ("input", "grad_input"):
                return self.info.input_lengths[ref.conn]
            if isinstance(ref, NeuronRef) and ref.kind in ("field", "grad_field"):
                return self.info.field_lengths[ref.name]
        raise self.error(node, "loop bounds must be integer constants or len(self.inputs[k]) / "
                               "len(self.<field>) expressions")

    def expr(self, node: ast.expr, allow_vector: bool = False) -> Expr:
        if isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, float)):
            return Const(float(node.value) if isinstance(node.value, float) else int(node.value))
        if isinstance(node, ast.Name):
            if node.id in self.locals and node.id not in self.assigned:
                raise self.error(node, f"local {node.id!r} may be read before it is assigned"
                                       + self._unassigned_why(node.id))
            if node.id in self.loop_vars or node.id in self.locals:
                return Var(node.id)
            val = self.env.get(node.id)
            if isinstance(val, (int, float)) and not isinstance(val, bool):
                return Const(val)
            raise self.error(node, f"unknown name {node.id!r} in a neuron body")
        if isinstance(node, ast.Attribute):
            return self.attribute(node, allow_vector)
        if isinstance(node, ast.Subscript):
            return self.subscript(node, allow_vector)
        if isinstance(node, ast.BinOp):
            op = _BINOPS.get(type(node.op))
            if op is None:
                raise self.error(node, f"operator {type(node.op).__name__} is not supported")
            return BinOp(op, self.expr(node.left), self.expr(node.right))
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.USub):
                return UnaryOp("neg", self.expr(node.operand))
            if isinstance(node.op, ast.UAdd):
                return self.expr(node.operand)
            if isinstance(node.op, ast.Not):
                return UnaryOp("not", self.expr(node.operand))
            raise self.error(node, f"operator {type(node.op).__name__} is not supported")
        if isinstance(node, ast.Compare):
            parts, left = [], self.expr(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                right = self.expr(right_node)
                if type(op) not in _CMPOPS:
                    raise self.error(node, f"comparison {type(op).__name__} is not supported")
                parts.append(Compare(_CMPOPS[type(op)], left, right))
                left = right
            return parts[0] if len(parts) == 1 else BoolOp("and", tuple(parts))
        if isinstance(node, ast.BoolOp):
            return BoolOp("and" if isinstance(node.op, ast.And) else "or",
                          tuple(self.expr(v) for v in node.values))
        if isinstance(node, ast.IfExp):
            return Select(self.expr(node.test), self.expr(node.body), self.expr(node.orelse))
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "len" and "len" not in self.env:
                return Const(self.const_int(node))
            return self.call(node)
        raise self.error(node, f"{type(node).__name__} expressions are not supported in a neuron body")

    @staticmethod
    def _unassigned_why(name: str) -> str:
        return (f" on some path: assign {name!r} before the if/for (or in every branch, or in "
                "a loop that runs at least once); compiled code would keep the previous "
                "neuron's value")

    def index(self, node: ast.expr, what: str) -> Expr:
        """An index expression, which must be integer-valued."""
        e = self.expr(node)
        if not self._is_int(e):
            raise self.error(node, f"index {ast.unparse(node)} of {what} is not an integer: "
                                   "indices are built from loop variables, integer constants, "
                                   "len(...) and + - * // % max min (locals and / give floats)")
        return e

    def _is_int(self, e: Expr) -> bool:
        if isinstance(e, Const):
            return isinstance(e.value, int)
        if isinstance(e, Var):
            return e.name in self.loop_vars and e.name not in self.locals
        if isinstance(e, BinOp):
            return e.op in ("+", "-", "*", "//", "%", "max", "min") and self._is_int(e.lhs) \
                and self._is_int(e.rhs)
        if isinstance(e, UnaryOp):
            return e.op == "neg" and self._is_int(e.operand)
        if isinstance(e, Select):
            return self._is_int(e.if_true) and self._is_int(e.if_false)
        return False

    def call(self, node: ast.Call) -> Expr:
        fn = self.resolve(node.func)
        if node.keywords:
            raise self.error(node, "keyword arguments are not supported in a neuron body")
        args = tuple(self.expr(a) for a in node.args)
        if fn in ("max", "min"):
            if len(args) < 2:
                raise self.error(node, f"{fn}() needs at least two arguments")
            out = args[0]
            for a in args[1:]:
                out = BinOp(fn, out, a)
            return out
        if fn in ("abs", "exp", "log", "tanh", "sqrt"):
            if len(args) != 1:
                raise self.error(node, f"{fn}() takes one argument")
            return Call(fn, args)
        raise self.error(node, "only max, min, abs and math.exp/log/tanh/sqrt can be called "
                               "in a neuron body")

    def resolve(self, func: ast.expr) -> str | None:
        if isinstance(func, ast.Name):
            if func.id in _BUILTINS and func.id not in self.env:
                return _BUILTINS[func.id]
            obj = self.env.get(func.id)
        elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
              and self.env.get(func.value.id) is math):
            obj = getattr(math, func.attr, None)
        else:
            return None
        if obj in (max, min, abs):
            return obj.__name__
        return _MATH.get(obj) if callable(obj) else None

    def attribute(self, node: ast.Attribute, allow_vector: bool) -> Expr:
        if not (isinstance(node.value, ast.Name) and node.value.id == self.self):
            raise self.error(node, "attribute access is only allowed on the neuron (self.<field>)")
        name = node.attr
        if name in ("value", "grad"):
            return NeuronRef(name)
        if name in ("inputs", "grad_inputs"):
            if allow_vector:
                return NeuronRef("vectors")
            raise self.error(node, f"self.{name} must be indexed as self.{name}[k][i]")
        kind, fname = ("grad_field", name[5:]) if name.startswith("grad_") else ("field", name)
        if fname not in self.info.field_lengths or (kind == "grad_field"
                                                    and fname not in self.info.params):
            raise self.error(node, f"the neuron has no field {name!r}")
        ref = NeuronRef(kind, fname)
        if allow_vector:
            return ref
        if self.info.field_lengths[fname] != 1:
            raise self.error(node, f"self.{name} is a vector; index it as self.{name}[i]")
        return NeuronRef(kind, fname, index=(Const(0),))

    def subscript(self, node: ast.Subscript, allow_vector: bool) -> Expr:
        inner = node.value
        # self.inputs[k] / self.grad_inputs[k]
        if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
                and inner.value.id == self.self and inner.attr in ("inputs", "grad_inputs")):
            k = self.const_int(node.slice)
            if not 0 <= k < len(self.info.input_lengths):
                raise self.error(node, f"self.{inner.attr}[{k}]: the ensemble has "
                                       f"{len(self.info.input_lengths)} input connection(s)")
            ref = NeuronRef("input" if inner.attr == "inputs" else "grad_input", conn=k)
            if allow_vector:
                return ref
            raise self.error(node, f"self.{inner.attr}[{k}] is a vector; index it as "
                                   f"self.{inner.attr}[{k}][i]")
        base = self.expr(inner, allow_vector=True)
        if not isinstance(base, NeuronRef) or base.index or base.kind in ("value", "grad", "vectors"):
            raise self.error(node, "only self.inputs[k][i], self.grad_inputs[k][i] and neuron "
                                   "fields can be indexed")
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        what = ast.unparse(inner)
        return NeuronRef(base.kind, base.name, base.conn, tuple(self.index(e, what) for e in elts))
