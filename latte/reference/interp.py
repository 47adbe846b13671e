"""The neuron-body interpreter: runs the frontend's neuron-level IR for every neuron of an
ensemble and every batch item at once.

Values are Python scalars (constants, loop variables and what is computed from them alone)
or float64/int/bool numpy arrays that broadcast to ``(batch, neurons)``. Loop bounds are
compile-time constants, so loops run in Python; an ``if``, a conditional expression and
``and``/``or`` whose condition varies between neurons run both ways under masks, each side
only where its condition holds (an index or a local read is checked only where it runs).
Arithmetic follows Python: ``//`` and ``%`` floor, ``/`` is true division, booleans count as
0 and 1; float math is IEEE (``log(-1)`` is NaN, ``1.0 / 0.0`` infinite) as compiled code has
it. ``and``/``or`` yield truth values (0/1), not an operand. A frame with a jitter
perturbs what ``+ - * /`` and ``exp``, ``log``, ``tanh``, ``sqrt`` compute (see
``Reference.jitter``); on a bounded frame every float carries its float32 rounding bound
(:mod:`latte.reference.tape` and ``rounding``).
"""

from __future__ import annotations

import numpy as np

from latte.compiler.autodiff import is_sigmoid
from latte.compiler.frontend import NeuronRef
from latte.compiler.ir import (
    Assign,
    AugAssign,
    BinOp,
    Block,
    BoolOp,
    Call,
    Compare,
    Const,
    If,
    Loop,
    Select,
    UnaryOp,
    Var,
)
from latte.reference import tape
from latte.reference.frame import Frame, Mask, is_int

_CMP = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
        "==": np.equal, "!=": np.not_equal}
_MATH = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt, "abs": np.abs}


def truth(v):
    """``v``'s truth value: a Python bool or a bool array."""
    v = tape.raw(v)
    return np.not_equal(v, 0) if isinstance(v, np.ndarray) else bool(v)


def _both(mask: Mask, cond) -> Mask:
    return cond if mask is True else mask & cond


class Interpreter:
    """Runs one neuron body over a :class:`Frame` (one ensemble, one phase)."""

    def __init__(self, frame: Frame):
        self.frame = frame
        self.loop_vars: dict[str, int] = {}
        self.locals: dict[str, tuple[object, Mask]] = {}   # name -> (value, where assigned)

    # ------------------------------------------------------------ statements
    def block(self, block: Block, mask: Mask) -> None:
        for s in block.stmts:
            self.frame.loc = s.loc or self.frame.loc
            self.stmt(s, mask)

    def stmt(self, s, mask: Mask) -> None:
        if isinstance(s, Loop):
            for i in range(s.start, s.stop):
                self.loop_vars[s.var] = i
                self.block(s.body, mask)
            self.loop_vars.pop(s.var, None)
        elif isinstance(s, If):
            cond = truth(self.expr(s.cond, mask))
            if not isinstance(cond, np.ndarray):
                self.block(s.then if cond else s.orelse, mask)
                return
            for branch, m in ((s.then, _both(mask, cond)), (s.orelse, _both(mask, ~cond))):
                if branch.stmts and m.any():
                    self.block(branch, m)
        elif isinstance(s, Assign):
            self.assign(s.target, self.expr(s.value, mask), mask)
        elif isinstance(s, AugAssign):
            value = self.expr(s.value, mask)
            t = s.target
            if isinstance(t, NeuronRef) and t.kind in ("grad_input", "grad_field"):
                self.frame.accumulate(t, self.indices(t, mask), value, s.op, mask)
            else:
                self.assign(t, self.binop(s.op, self.read(t, mask), value, mask), mask)
        else:
            raise self.frame.fail(f"unexpected statement {type(s).__name__}", mask)

    def assign(self, target, value, mask: Mask) -> None:
        if isinstance(target, Var):
            old = self.locals.get(target.name)
            if old is None or mask is True:
                self.locals[target.name] = (value, mask if old is None else True)
            else:
                self.locals[target.name] = (self.merge(mask, value, old[0]), _either(old[1], mask))
            return
        self.frame.write(target, self.indices(target, mask), value, mask, self.merge)

    def merge(self, mask: Mask, new, old):
        """``new`` where ``mask`` holds, else ``old`` (traced when either is)."""
        if mask is True:
            return new
        out = np.where(mask, tape.raw(new), tape.raw(old))
        return tape.where(mask, new, old, out)

    # ------------------------------------------------------------ expressions
    def expr(self, e, mask: Mask):
        if isinstance(e, Const):
            return self.frame.constant(e.value)
        if isinstance(e, Var):
            return self.var(e.name, mask)
        if isinstance(e, NeuronRef):
            return self.read(e, mask)
        if isinstance(e, BinOp):
            x = is_sigmoid(e)   # as the compiler's derivation sees it
            if x is not None:
                return self.sigmoid(self.expr(x, mask))
            return self.binop(e.op, self.expr(e.lhs, mask), self.expr(e.rhs, mask), mask)
        if isinstance(e, UnaryOp):
            v = self.expr(e.operand, mask)
            if e.op == "not":
                t = truth(v)
                return ~t if isinstance(t, np.ndarray) else not t
            return self.frame.note(tape.call("neg", v, -tape.raw(v)))
        if isinstance(e, Compare):
            a, b = tape.raw(self.expr(e.lhs, mask)), tape.raw(self.expr(e.rhs, mask))
            out = _CMP[e.op](a, b)
            return out if isinstance(out, np.ndarray) else bool(out)
        if isinstance(e, BoolOp):
            return self.boolop(e, mask)
        if isinstance(e, Select):
            return self.select(e, mask)
        if isinstance(e, Call):
            (arg,) = e.args
            v = self.expr(arg, mask)
            x = tape.raw(v)
            if e.fn == "abs" and is_int(v):
                return abs(x)
            with np.errstate(all="ignore"):
                out = _MATH[e.fn](np.float64(x) if not isinstance(x, np.ndarray) else x)
            out = float(out) if np.ndim(out) == 0 else out
            return self.frame.note(tape.call(e.fn, v, out if e.fn == "abs" else
                                             self.frame.rounded(out)))
        raise self.frame.fail(f"unexpected expression {type(e).__name__}", mask)

    def sigmoid(self, v):
        """``1 / (1 + exp(-v))``, one operation of the tape: compiled code differentiates
        it as one (:mod:`latte.reference.tape`)."""
        x = tape.raw(v)
        with np.errstate(over="ignore"):
            out = 1.0 / (1.0 + np.exp(-np.float64(x) if not isinstance(x, np.ndarray) else -x))
        out = float(out) if np.ndim(out) == 0 else out
        return self.frame.note(tape.call("sigmoid", v, self.frame.rounded(out)))

    def var(self, name: str, mask: Mask):
        if name in self.loop_vars:
            return self.loop_vars[name]
        value, assigned = self.locals.get(name, (None, False))
        if assigned is not True:
            unset = ~np.asarray(assigned, bool) if mask is True else mask & ~np.asarray(assigned, bool)
            if np.any(unset):
                raise self.frame.fail(f"local {name!r} is read before it is assigned",
                                      np.broadcast_to(unset, self.frame.lanes))
        return value

    def read(self, ref: NeuronRef | Var, mask: Mask):
        if isinstance(ref, Var):
            return self.var(ref.name, mask)
        return self.frame.read(ref, self.indices(ref, mask), mask)

    def indices(self, ref: NeuronRef, mask: Mask) -> tuple:
        return tuple(self.expr(i, mask) for i in ref.index)

    def binop(self, op: str, a, b, mask: Mask):
        x, y = tape.raw(a), tape.raw(b)
        if op in ("//", "%") and is_int(a) and is_int(b):
            zero = np.equal(y, 0) if mask is True else _both(mask, np.equal(y, 0))
            if np.any(zero):
                raise self.frame.fail(f"integer {op} by zero", np.broadcast_to(zero, self.frame.lanes))
        scalar = not isinstance(x, np.ndarray) and not isinstance(y, np.ndarray)
        if op in ("max", "min"):
            pick = (x > y) if op == "max" else (x < y)
            out = (x if pick else y) if scalar else np.where(pick, x, y)
        else:
            with np.errstate(all="ignore"):
                if scalar and op == "/":
                    out = float(np.float64(x) / y)
                elif scalar and op in ("//", "%") and y == 0:   # float by zero: IEEE
                    out = float({"//": np.floor_divide, "%": np.mod}[op](np.float64(x), y))
                else:
                    out = {"+": lambda: x + y, "-": lambda: x - y, "*": lambda: x * y,
                           "/": lambda: np.true_divide(x, y), "//": lambda: x // y,
                           "%": lambda: x % y}[op]()
            if op in ("+", "-", "*", "/"):
                out = self.frame.rounded(out)
        return self.frame.note(tape.binop(op, a, b, out))

    def boolop(self, e: BoolOp, mask: Mask):
        want = e.op == "and"   # `and` goes on while values are true, `or` while false
        result = truth(self.expr(e.values[0], mask))
        for v in e.values[1:]:
            going = result if want else (~result if isinstance(result, np.ndarray) else not result)
            if not isinstance(going, np.ndarray):
                if not going:
                    return result
                result = truth(self.expr(v, mask))
                continue
            sub = _both(mask, going)
            if not np.any(sub):
                return result
            nxt = truth(self.expr(v, sub))
            result = (result & nxt) if want else (result | nxt)
        return result

    def select(self, e: Select, mask: Mask):
        cond = truth(self.expr(e.cond, mask))
        if not isinstance(cond, np.ndarray):
            return self.expr(e.if_true if cond else e.if_false, mask)
        yes, no = _both(mask, cond), _both(mask, ~cond)
        a = self.expr(e.if_true, yes) if np.any(yes) else 0.0
        b = self.expr(e.if_false, no) if np.any(no) else 0.0
        return self.merge(cond, a, b)


def _either(a: Mask, b: Mask) -> Mask:
    return True if a is True or b is True else a | b


def run(body: Block, frame: Frame) -> None:
    """Run ``body`` (a parsed forward or backward) for every neuron and batch item."""
    Interpreter(frame).block(body, True)

