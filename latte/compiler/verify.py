"""IR verification: every index is proven inside what it indexes, and the IR is well formed.

Two levels, one prover. :func:`verify_neuron` checks a neuron body's indices against the
vectors they index (``self.inputs[k][i]`` needs ``0 <= i < len(self.inputs[k])``: a wrapped
index would stay inside the flat buffer and read a neighbour's data). :func:`verify_kernel`
checks every buffer ref of a synthesized or optimized kernel against its view, every GEMM
operand block against its buffer, and that loop variables are bound and never captured.

A guarded access is proven under its guard: the loop domain (an isl set) is intersected
with the affine conditions of the ifs and conditional expressions around it (an
``else`` with the complement). Conditions that are not affine in integers give no
information, so the access must be proven without them. Integer ``//`` and ``%`` by a
positive constant (flooring, as Python's and codegen's), ``max``/``min`` and integer selects
are modelled exactly; a gather table's entries are the flat source offsets the mapping
analysis built (``-1`` for padding); any other value (a float, a load) is unbounded.
``and``/``or`` guard nothing: codegen evaluates every operand. A local assigned an integer
expression of the loop variables (a derived backward's ``_c = i + 1 < n``) stands for it in
the guards of the statements after it in its block, until something assigns it again.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from typing import Callable

import islpy as isl

from latte.compiler.frontend import NeuronRef
from latte.compiler.ir import (
    EPI_C,
    TID,
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    BoolOp,
    Compare,
    Const,
    Expr,
    Gemm,
    If,
    Kernel,
    Load,
    Loc,
    Loop,
    Node,
    Ref,
    Select,
    UnaryOp,
    Var,
    accesses,
    children,
    remembered,
    to_affine,
    walk,
)
from latte.compiler.printer import fmt_expr
from latte.errors import CompileError

_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


@dataclass(frozen=True)
class Scope:
    """What holds around a node: the loops ``(var, first, last)``, the guards ``(cond,
    holds)``, the innermost statement's source location."""

    loops: tuple[tuple[str, int, int], ...] = ()
    guards: tuple[tuple[Expr, bool], ...] = ()
    loc: Loc | None = None
    known: tuple[tuple[str, Expr], ...] = ()   # locals that hold an expression of the loops

    def bound(self) -> frozenset[str]:
        """The loop variables bound here (remembered by the scope: scopes never change)."""
        return remembered(self, "_bound", lambda: frozenset(v for v, _, _ in self.loops))


def walk_scoped(node: Node, scope: Scope, visit: Callable[[Node, Scope], None]) -> None:
    """Call ``visit(n, scope)`` on every node below ``node`` with the loops and guards that
    hold there (a loop that never runs is skipped)."""
    visit(node, scope)
    if isinstance(node, (Assign, AugAssign, If, Loop)) and node.loc is not None:
        scope = replace(scope, loc=node.loc)
    if isinstance(node, Block):
        known = dict(scope.known)
        for stmt in node.stmts:
            for name in _assigned(stmt) if known else ():   # a local reassigned below
                known.pop(name, None)                        # stands for nothing
            walk_scoped(stmt, replace(scope, known=tuple(known.items())), visit)
            if isinstance(stmt, Assign) and isinstance(stmt.target, Var) \
                    and _of_loops(stmt.value, scope.bound()):
                known[stmt.target.name] = stmt.value
        return
    if isinstance(node, Loop):
        if node.start < node.stop:
            walk_scoped(node.body, replace(scope, loops=(*scope.loops, (node.var, node.start,
                                                                         node.stop - 1))), visit)
        return
    if isinstance(node, (If, Select)):
        arms = (node.then, node.orelse) if isinstance(node, If) else (node.if_true, node.if_false)
        walk_scoped(node.cond, scope, visit)
        for arm, holds in zip(arms, (True, False)):
            walk_scoped(arm, replace(scope, guards=(*scope.guards, (node.cond, holds))), visit)
        return
    for child in children(node):
        walk_scoped(child, scope, visit)


def _assigned(stmt: Node) -> frozenset[str]:
    """The locals ``stmt`` assigns (remembered by the statement: nodes never change)."""
    return remembered(stmt, "_assigned", lambda: frozenset(
        n.target.name for n in walk(stmt)
        if isinstance(n, (Assign, AugAssign)) and isinstance(n.target, Var)))


def _of_loops(e: Expr, loops: frozenset[str]) -> bool:
    """Is ``e`` computed from the loop variables ``loops`` and constants alone?"""
    return all(isinstance(n, (Affine, Const, BinOp, UnaryOp, Compare, BoolOp, Select))
               or (isinstance(n, Var) and n.name in loops) for n in walk(e)) \
        and all(n.vars <= loops for n in walk(e) if isinstance(n, Affine))


# ---------------------------------------------------------------- the prover

class _Prover:
    """Translates expressions into isl over a scope's loop variables; non-affine parts become
    existential atoms (one per structurally equal expression) with their constraints."""

    def __init__(self, scope: Scope, threads: int):
        self.scope, self.threads = scope, threads
        self.names = {v: f"v{k}" for k, (v, _, _) in enumerate(scope.loops)}
        self.atoms: dict[Expr, str] = {}
        self.count = 0
        self.facts: list[str] = [f"{lo} <= {self.names[v]} <= {hi}" for v, lo, hi in scope.loops]
        self._domain: list[str] | None = None

    def atom(self, e: Expr | None = None) -> str:
        """A fresh existential (memoized per expression when ``e`` is given)."""
        if e is not None and e in self.atoms:
            return self.atoms[e]
        self.count += 1
        name = f"a{self.count}"
        if e is not None:
            self.atoms[e] = name
        return name

    def is_int(self, e: Expr) -> bool:
        if isinstance(e, Affine):
            return True
        if isinstance(e, Const):
            return isinstance(e.value, int)
        if isinstance(e, Var):
            return e.name in self.names or e.name == TID
        if isinstance(e, BinOp):
            return e.op in ("+", "-", "*", "//", "%", "max", "min") and self.is_int(e.lhs) \
                and self.is_int(e.rhs)
        if isinstance(e, UnaryOp):
            return e.op == "neg" and self.is_int(e.operand)
        if isinstance(e, Select):
            return self.is_int(e.if_true) and self.is_int(e.if_false)
        return isinstance(e, Load) and e.ref.buffer.dtype == "int32"

    def lin(self, e: Expr) -> str:
        """``e`` as an isl quasi-affine expression (atoms for what is not)."""
        if isinstance(e, Affine):
            return " + ".join([f"{c}*{self.var(v)}" for v, c in e.terms] + [str(e.const)])
        if isinstance(e, Const) and isinstance(e.value, int):
            return str(e.value)
        if isinstance(e, Var):
            return self.var(e.name)
        if e in self.atoms:
            return self.atoms[e]
        if not self.is_int(e):
            return self.atom(e)   # a float: unbounded
        if isinstance(e, UnaryOp):
            return f"-({self.lin(e.operand)})"
        if isinstance(e, BinOp) and e.op in "+-":
            return f"({self.lin(e.lhs)}) {e.op} ({self.lin(e.rhs)})"
        if isinstance(e, BinOp) and e.op == "*":
            for k, other in ((e.lhs, e.rhs), (e.rhs, e.lhs)):
                if isinstance(k, Const):
                    return f"{k.value}*({self.lin(other)})"
            return self.atom(e)
        a = self.atom(e)
        if isinstance(e, BinOp) and e.op in ("//", "%"):
            if not (isinstance(e.rhs, Const) and e.rhs.value > 0):
                return a
            x, c, q = self.lin(e.lhs), e.rhs.value, self.atom()
            self.facts.append(f"{c}*{q} <= {x} < {c}*{q} + {c}")   # floor, as Python's
            self.facts.append(f"{a} = {q}" if e.op == "//" else f"{a} = ({x}) - {c}*{q}")
        elif isinstance(e, BinOp) and e.op in ("max", "min"):
            x, y, ge = self.lin(e.lhs), self.lin(e.rhs), ">=" if e.op == "max" else "<="
            self.facts.append(f"({a} = {x} and {x} {ge} {y}) or ({a} = {y} and {y} {ge} {x})")
        elif isinstance(e, Select):
            arms = [f"({a} = {self.lin(v)}{self._and(self.cond(e.cond, holds))})"
                    for v, holds in ((e.if_true, True), (e.if_false, False))]
            self.facts.append(" or ".join(arms))
        elif isinstance(e, Load) and e.ref.buffer.key[1:] == ("table",):
            conn = e.ref.buffer.key[0]   # flat source offsets, -1 where padding is read
            self.facts.append(f"{-1 if conn.padding is not None else 0} <= {a} < {conn.source.size}")
        return a

    def var(self, v: str) -> str:
        """A loop variable, the thread number, or an unbounded atom (a local)."""
        if v in self.names:
            return self.names[v]
        fresh = Var(v) not in self.atoms
        name = self.atom(Var(v))
        if v == TID and fresh:
            self.facts.append(f"0 <= {name} < {self.threads}")
        return name

    @staticmethod
    def _and(c: str | None) -> str:
        return f" and ({c})" if c else ""

    def cond(self, e: Expr, holds: bool) -> str | None:
        """A superset of the points where ``e`` is ``holds``, as isl constraints (None: all)."""
        if isinstance(e, Var) and e.name in dict(self.scope.known):
            return self.cond(dict(self.scope.known)[e.name], holds)
        if isinstance(e, UnaryOp) and e.op == "not":
            return self.cond(e.operand, not holds)
        if isinstance(e, BoolOp):
            parts = [self.cond(v, holds) for v in e.values]
            if (e.op == "and") == holds:   # a conjunction: each part a superset
                kept = [f"({p})" for p in parts if p]
                return " and ".join(kept) or None
            return None if None in parts else " or ".join(f"({p})" for p in parts)
        if isinstance(e, Compare) and self.is_int(e.lhs) and self.is_int(e.rhs):
            op = e.op if holds else _NEGATE[e.op]
            x, y = self.lin(e.lhs), self.lin(e.rhs)
            if op == "!=":
                return f"({x}) < ({y}) or ({x}) > ({y})"
            return f"({x}) {'=' if op == '==' else op} ({y})"
        if not isinstance(e, Compare) and self.is_int(e):   # an int is true when nonzero
            x = self.lin(e)
            return f"({x}) < 0 or ({x}) > 0" if holds else f"({x}) = 0"
        return None

    def domain(self) -> list[str]:
        """The scope's constraints (loops, guards, atoms); translates the guards once."""
        if self._domain is None:
            guards = [c for e, holds in self.scope.guards if (c := self.cond(e, holds))]
            self._domain = [f"({c})" for c in self.facts + guards]
        return self._domain

    def set(self, head: list[str], extra: list[str]) -> str:
        """``{ [head] : exists (every other name : domain and extra) }``, in isl's syntax."""
        cons = self.domain() + [f"({c})" for c in extra]
        names = sorted({w for c in cons for w in re.findall(r"\b[va]\d+\b", c)} - set(head))
        body = " and ".join(cons) or "1 = 1"
        if names:
            body = f"exists ({', '.join(names)} : {body})"
        return f"{{ [{', '.join(head)}] : {body} }}"


def index_range(index: Expr, extent: int, scope: Scope, threads: int = 1) -> tuple | None:
    """None when ``0 <= index < extent`` holds everywhere in ``scope``; else the range the
    index takes there, ``(lo, hi)`` with None for an unbounded end."""
    aff = to_affine(index)
    if aff is not None and aff.vars <= scope.bound():   # a box: exact without guards
        lo, hi = aff.bounds({v: (a, b) for v, a, b in scope.loops})
        if 0 <= lo and hi < extent:
            return None
        if not scope.guards:
            return lo, hi
    prover = _Prover(scope, threads)
    x = prover.lin(index)
    if _empty(prover.set([], [f"({x}) < 0 or ({x}) >= {extent}"])):
        return None
    return _ends(prover.set(["x"], [f"x = {x}"]))


@functools.lru_cache(maxsize=4096)
def _empty(text: str) -> bool:
    """Is the isl set ``text`` empty? (The passes re-verify a kernel after every step that
    changes it, asking mostly the same questions.)"""
    return isl.Set(text).is_empty()


@functools.lru_cache(maxsize=4096)
def _ends(text: str) -> tuple:
    """The least and greatest value of the one-dimensional isl set ``text`` (None: unbounded
    or not a constant)."""
    values, ends = isl.Set(text), []
    for end in (values.dim_min, values.dim_max):
        try:
            ends.append(end(0).get_pieces()[0][1].get_constant_val().to_python())
        except (isl.Error, IndexError):
            ends.append(None)
    return tuple(ends)


def fmt_range(rng: tuple) -> str:
    lo, hi = ("-inf" if rng[0] is None else rng[0]), ("inf" if rng[1] is None else rng[1])
    return f"{lo}..{hi}"


def _fmt(e: Expr) -> str:
    text = fmt_expr(e)
    return text[1:-1] if text.startswith("(") and text.endswith(")") else text


def _where(scope: Scope) -> str:
    return f"{scope.loc}: " if scope.loc is not None else ""


# ---------------------------------------------------------------- neuron level

def verify_neuron(body: Node, extents: Callable[[NeuronRef], tuple[int, ...]], ensemble: str,
                  method: str) -> None:
    """Raise :class:`CompileError` naming file:line if an index in a neuron body can leave
    the vector it indexes; ``extents(ref)`` gives the extent of each of ``ref``'s indices."""
    def visit(node: Node, scope: Scope) -> None:
        if not isinstance(node, NeuronRef) or not node.index:
            return
        what = (f"self.{'inputs' if node.kind == 'input' else 'grad_inputs'}[{node.conn}]"
                if node.conn >= 0 else f"self.{'grad_' if node.kind == 'grad_field' else ''}{node.name}")
        for dim, (idx, n) in enumerate(zip(node.index, extents(node))):
            rng = index_range(idx, n, scope)
            if rng is not None:
                which = f" (dimension {dim})" if len(node.index) > 1 else ""
                size = "its length" if len(node.index) == 1 else "its extent"
                raise CompileError(f"{_where(scope)}ensemble {ensemble!r}: index {_fmt(idx)}"
                                   f"{which} of {what} ranges over {fmt_range(rng)}, outside "
                                   f"{size} {n} (in {method}; guard it with an if on the "
                                   "loop variables, or fix the loop bounds)")
    walk_scoped(body, Scope(), visit)


# ---------------------------------------------------------------- kernel level

def verify_kernel(kernel: Kernel) -> None:
    """Raise :class:`CompileError` (naming the neuron's file:line where known) unless every
    buffer ref of ``kernel`` stays inside its view and every GEMM operand block inside its
    buffer, every loop variable an index uses is bound, and no loop variable or local
    captures an enclosing loop's variable."""
    threads = max([b.shape[0] for b in _per_thread(kernel)] or [1])
    locals_ = {n.target.name for n in walk(kernel.body)
               if isinstance(n, (Assign, AugAssign)) and isinstance(n.target, Var)} | {EPI_C}
    where = f"ensemble {kernel.ensemble.name!r} ({kernel.name})" if kernel.ensemble is not None \
        else kernel.name

    def fail(scope: Scope, message: str) -> CompileError:
        return CompileError(f"{_where(scope)}{where}: {message}")

    def visit(node: Node, scope: Scope) -> None:
        bound = scope.bound() | {TID}
        if isinstance(node, Loop) and (node.var in bound or node.var in locals_):
            raise fail(scope, f"loop variable {node.var!r} captures another variable of that name")
        if isinstance(node, Affine) and not node.vars <= bound:
            raise fail(scope, f"index {_fmt(node)} uses unbound variable(s) "
                              f"{sorted(node.vars - bound)}")
        if isinstance(node, Var) and node.name not in bound and node.name not in locals_:
            raise fail(scope, f"variable {node.name!r} is neither a loop variable nor a local")
        if isinstance(node, (Assign, AugAssign)) and isinstance(node.target, Var) \
                and node.target.name in bound:
            raise fail(scope, f"local {node.target.name!r} captures a loop variable")
        if isinstance(node, Ref):
            for n in (n for idx in node.index for n in walk(idx)):
                if isinstance(n, (Affine, Var)):   # unbound variables name the real mistake
                    visit(n, scope)
            if len(node.index) != len(node.view) or _prod(node.view) > node.buffer.size:
                raise fail(scope, f"ref of {node.buffer.name} has index {len(node.index)}-d "
                                  f"over view {node.view} of a buffer of shape {node.buffer.shape}")
            for dim, (idx, n) in enumerate(zip(node.index, node.view)):
                rng = index_range(idx, n, scope, threads)
                if rng is not None:
                    raise fail(scope, f"index {_fmt(idx)} (dimension {dim}) of "
                                      f"{node.buffer.name} ranges over {fmt_range(rng)}, outside "
                                      f"its extent {n} (view {node.view})")
        if isinstance(node, Gemm):   # its operands' blocks (its epilogue's refs: above)
            for acc in (a for a in accesses(node) if a.index is None):
                rng = index_range(acc.offset, acc.buffer.size - acc.span, scope, threads)
                if rng is not None:
                    raise fail(scope, f"GEMM block of {acc.buffer.name} starts at "
                                      f"{fmt_range(rng)}: its last element leaves the buffer "
                                      f"({acc.buffer.size} elements)")
    walk_scoped(kernel.body, Scope(), visit)


def _per_thread(kernel: Kernel) -> list:
    """Buffers with one slice per thread (indexed by the thread number)."""
    return [n.buffer for n in walk(kernel.body) if isinstance(n, Ref)
            and n.index and n.index[0] == Affine.of(TID)]


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
