"""Floating-point operations a compiled step performs (the profiler's GFLOP/s).

Counted on the loop IR the compiler generated, not on the layer's formula:

* a :class:`~latte.compiler.ir.Gemm` is ``2 * m * n * k`` (exact), ``m * n`` more with a
  bias added as it stores;
* in a loop body, each float ``+ - * / max min``, each float comparison and each call
  (``exp``, ``log``, ``tanh``, ``sqrt``, ``abs``) is one operation, and so is a float
  ``+=`` (``-=``, ...) itself; loads, stores, selects, negations and integer index
  arithmetic are free; a select costs its dearer arm;
* each is multiplied by the number of iterations that run it: loop trip counts, narrowed by
  every ``if`` whose condition is integer arithmetic on loop variables (padding guards,
  strides), counted exactly by enumerating the variables it names (up to
  :data:`ENUMERATE_LIMIT` points); any other condition counts its dearer branch in every
  iteration (an upper bound);
* a :class:`~latte.compiler.program.TimeSteps` loop counts its steps ``time_steps`` times;
  host steps (normalization ensembles' array code) count nothing.
"""

from __future__ import annotations

import functools

import numpy as np

from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    BoolOp,
    Call,
    Compare,
    Const,
    Expr,
    Gemm,
    If,
    Kernel,
    Load,
    Loop,
    Node,
    Select,
    UnaryOp,
    Var,
)
from latte.compiler.program import Segment, TimeSteps

#: The most iteration points an ``if`` condition is evaluated on to count them exactly.
ENUMERATE_LIMIT = 1 << 22

_Loops = tuple[tuple[str, int, int], ...]   # (var, start, stop) of the enclosing loops
_Guards = tuple[tuple[Expr, bool], ...]      # conditions on them, each required true/false


def step_flops(step, time_steps: int = 1) -> int:
    """Operations one run of ``step`` performs (a segment, a time loop or a host step)."""
    if isinstance(step, Segment):
        return sum(kernel_flops(k) for k in step.kernels)
    if isinstance(step, TimeSteps):
        return time_steps * sum(step_flops(s, time_steps) for s in step.steps)
    return 0


def kernel_flops(kernel: Kernel) -> int:
    """Operations one run of ``kernel`` performs."""
    return _Counter().stmt(kernel.body, (), ())


class _Counter:
    """Walks statements in order, remembering which locals hold integer conditions."""

    def __init__(self) -> None:
        self.int_locals: dict[str, Expr] = {}   # local -> the integer expression it holds

    def stmt(self, s: Node, loops: _Loops, guards: _Guards) -> int:
        if isinstance(s, Block):
            return sum(self.stmt(c, loops, guards) for c in s.stmts)
        if isinstance(s, Loop):
            return self.stmt(s.body, (*loops, (s.var, s.start, s.stop)), guards)
        if isinstance(s, Gemm):   # the product, then its epilogue on each element
            epilogue = 0 if s.epilogue is None else self.stmt(s.epilogue, loops, guards)
            return 2 * s.k * s.m * s.n * _points(loops, guards) + epilogue
        if isinstance(s, If):
            cond = self.inline(s.cond)
            here = _expr_flops(cond, loops) * _points(loops, guards)
            if _integer(cond, {v for v, _, _ in loops}):
                return (here + self.stmt(s.then, loops, (*guards, (cond, True)))
                        + self.stmt(s.orelse, loops, (*guards, (cond, False))))
            return here + max(self.stmt(s.then, loops, guards), self.stmt(s.orelse, loops, guards))
        if isinstance(s, (Assign, AugAssign)):
            names = {v for v, _, _ in loops}
            if isinstance(s, Assign) and isinstance(s.target, Var):
                if _integer(s.value, names | self.int_locals.keys()):
                    self.int_locals[s.target.name] = self.inline(s.value)
                else:
                    self.int_locals.pop(s.target.name, None)
            own = isinstance(s, AugAssign) and _is_float(_target_expr(s.target), names)
            return (own + _expr_flops(s.value, loops)) * _points(loops, guards)
        return 0

    def inline(self, e: Expr) -> Expr:
        """``e`` with the locals that hold integer conditions replaced by what they hold."""
        if isinstance(e, Var) and e.name in self.int_locals:
            return self.int_locals[e.name]
        if isinstance(e, BinOp):
            return BinOp(e.op, self.inline(e.lhs), self.inline(e.rhs))
        if isinstance(e, Compare):
            return Compare(e.op, self.inline(e.lhs), self.inline(e.rhs))
        if isinstance(e, BoolOp):
            return BoolOp(e.op, tuple(self.inline(v) for v in e.values))
        if isinstance(e, UnaryOp):
            return UnaryOp(e.op, self.inline(e.operand))
        return e


def _target_expr(target) -> Expr:
    return target if isinstance(target, Var) else Load(target)


def _is_float(e: Expr, loop_vars: set[str]) -> bool:
    """Whether codegen computes ``e`` in float (locals are float, loop variables integer)."""
    if isinstance(e, Const):
        return isinstance(e.value, float)
    if isinstance(e, Var):
        return e.name not in loop_vars
    if isinstance(e, Load):
        return e.ref.buffer.dtype != "int32"
    if isinstance(e, BinOp):
        return e.op == "/" or _is_float(e.lhs, loop_vars) or _is_float(e.rhs, loop_vars)
    if isinstance(e, UnaryOp):
        return e.op != "not" and _is_float(e.operand, loop_vars)
    if isinstance(e, Call):
        return True
    if isinstance(e, Select):
        return _is_float(e.if_true, loop_vars) or _is_float(e.if_false, loop_vars)
    return False   # Affine, Compare, BoolOp


def _expr_flops(e: Expr, loops: _Loops) -> int:
    """Operations one evaluation of ``e`` performs."""
    names = {v for v, _, _ in loops}
    if isinstance(e, BinOp):
        return _is_float(e, names) + _expr_flops(e.lhs, loops) + _expr_flops(e.rhs, loops)
    if isinstance(e, Compare):
        own = _is_float(e.lhs, names) or _is_float(e.rhs, names)
        return own + _expr_flops(e.lhs, loops) + _expr_flops(e.rhs, loops)
    if isinstance(e, Call):
        return 1 + sum(_expr_flops(a, loops) for a in e.args)
    if isinstance(e, BoolOp):
        return sum(_expr_flops(v, loops) for v in e.values)
    if isinstance(e, UnaryOp):
        return _expr_flops(e.operand, loops)
    if isinstance(e, Select):
        return _expr_flops(e.cond, loops) + max(_expr_flops(e.if_true, loops),
                                                _expr_flops(e.if_false, loops))
    return 0   # loads, constants, variables, affine forms


def _integer(e: Expr, names: set[str]) -> bool:
    """Whether ``e`` is integer arithmetic and comparisons on the variables ``names``."""
    if isinstance(e, Affine):
        return e.vars <= names
    if isinstance(e, Const):
        return isinstance(e.value, int)
    if isinstance(e, Var):
        return e.name in names
    if isinstance(e, BinOp):
        return e.op != "/" and _integer(e.lhs, names) and _integer(e.rhs, names)
    if isinstance(e, Compare):
        return _integer(e.lhs, names) and _integer(e.rhs, names)
    if isinstance(e, BoolOp):
        return all(_integer(v, names) for v in e.values)
    if isinstance(e, UnaryOp):
        return e.op == "not" and _integer(e.operand, names)
    return False


@functools.lru_cache(maxsize=4096)
def _points(loops: _Loops, guards: _Guards) -> int:
    """Iterations of ``loops`` where every guard holds as required (each guard is integer
    arithmetic on the loop variables); an upper bound past :data:`ENUMERATE_LIMIT`."""
    total = 1
    for _, start, stop in loops:
        total *= max(stop - start, 0)
    if not guards or total == 0:
        return total
    named = set().union(*(_names(c) for c, _ in guards))
    bound = {v: (start, stop) for v, start, stop in loops}   # an inner loop shadows
    inner = [(v, start, stop) for v, (start, stop) in bound.items() if v in named]
    grid = 1
    for _, start, stop in inner:
        grid *= stop - start
    if grid > ENUMERATE_LIMIT:
        return total
    values = {v: np.arange(start, stop).reshape([-1 if i == j else 1 for j in range(len(inner))])
              for i, (v, start, stop) in enumerate(inner)}
    mask = np.ones([stop - start for _, start, stop in inner], dtype=bool)
    for cond, holds in guards:
        mask &= (np.asarray(_evaluate(cond, values)) != 0) == holds
    return int(mask.sum()) * (total // grid)


def _names(e: Expr) -> set[str]:
    if isinstance(e, Affine):
        return set(e.vars)
    if isinstance(e, Var):
        return {e.name}
    if isinstance(e, (BinOp, Compare)):
        return _names(e.lhs) | _names(e.rhs)
    if isinstance(e, BoolOp):
        return set().union(*(_names(v) for v in e.values))
    if isinstance(e, UnaryOp):
        return _names(e.operand)
    return set()


_OPS = {"+": np.add, "-": np.subtract, "*": np.multiply, "//": np.floor_divide,
        "%": np.mod, "max": np.maximum, "min": np.minimum, "<": np.less,
        "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
        "!=": np.not_equal}


def _evaluate(e: Expr, values: dict[str, np.ndarray]):
    """An integer expression over broadcast arrays of the loop variables' values."""
    if isinstance(e, Affine):
        out = e.const
        for v, c in e.terms:
            out = out + c * values[v]
        return out
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return values[e.name]
    if isinstance(e, (BinOp, Compare)):
        return _OPS[e.op](_evaluate(e.lhs, values), _evaluate(e.rhs, values))
    if isinstance(e, BoolOp):
        parts = [np.asarray(_evaluate(v, values)) != 0 for v in e.values]
        return functools.reduce(np.logical_and if e.op == "and" else np.logical_or, parts)
    return np.logical_not(_evaluate(e.operand, values))   # UnaryOp "not"
