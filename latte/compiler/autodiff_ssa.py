"""The forward of a neuron as the SSA program ``P`` that the derived backward replays and
reverses (see :mod:`latte.compiler.autodiff`).

``P`` is neuron-level IR plus three statement kinds: :class:`Kill` (a carried local
overwritten inside a loop, with the ``_last_*`` locals that record the iteration of its last
write), :class:`PLoop` (a loop with its carried locals) and :class:`PIf` (an ``if`` whose
condition is hoisted into a local). Locals are renamed per assignment, ``self.value`` is a
local, joins are copies at the end of both branches, and a local carried from one iteration
to the next keeps one name in its loop, other statements reading it through snapshots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from latte.compiler.frontend import NeuronInfo, NeuronRef
from latte.compiler.ir import (
    Assign,
    AugAssign,
    BinOp,
    Block,
    Const,
    Expr,
    If,
    Loop,
    NameGen,
    Node,
    Var,
    rewrite,
    walk,
)


@dataclass(frozen=True)
class Kill:
    """``target = value`` overwriting a carried local; its adjoint goes to the last write,
    the write ``guard`` records: ``(last_local, what)`` pairs, ``what`` a loop variable or
    the write's number among the local's writes (when it has several)."""

    target: str
    value: Expr
    guard: tuple[tuple[str, Expr], ...]
    loc: object = None


@dataclass(frozen=True)
class PLoop:
    loop: Loop                              # its body holds P statements
    carried: tuple[str, ...]                # names carried by this loop (its writes)
    restores: tuple[tuple[str, str], ...]   # (target, source) copies before its adjoint
    kills: tuple[tuple[str, str], ...]      # (carried name, its first _last local)


@dataclass(frozen=True)
class PIf:
    cond: str                               # the hoisted condition local
    then: tuple
    orelse: tuple
    loc: object = None


def at(stmt, loc):
    """``stmt`` with the source location ``loc`` (a forward statement's) where there is one."""
    return stmt if loc is None else dataclasses.replace(stmt, loc=loc)


def local_vars(e: Node) -> set[str]:
    return {n.name for n in walk(e) if isinstance(n, Var)}


def _assigned(stmts) -> set[str]:
    out = set()
    for s in stmts:
        if isinstance(s, Assign) and isinstance(s.target, Var):
            out.add(s.target.name)
        elif isinstance(s, Loop):
            out |= _assigned(s.body.stmts)
        elif isinstance(s, If):
            out |= _assigned(s.then.stmts) | _assigned(s.orelse.stmts)
    return out


def _live_in(stmts, live: set[str]) -> set[str]:
    """Locals read before being assigned, running ``stmts`` with ``live`` read afterwards."""
    for s in reversed(stmts):
        if isinstance(s, Assign):
            live = (live - {s.target.name} if isinstance(s.target, Var) else live) | local_vars(s.value)
        elif isinstance(s, If):
            live = local_vars(s.cond) | _live_in(s.then.stmts, live) | _live_in(s.orelse.stmts, live)
        elif isinstance(s, Loop):
            head = set(live)
            while True:
                new = live | _live_in(s.body.stmts, head)
                if new == head:
                    break
                head = new
            live = head
    return live


class DerivationError(Exception):
    def __init__(self, message: str, loc=None):
        super().__init__(message)
        self.loc = loc


class SSA:
    """Normalized forward (``x op= e`` as ``x = x op e``, value as a local) -> P."""

    def __init__(self, names: NameGen, value: str, loop_vars: set[str]):
        self.names, self.value, self.loop_vars = names, value, loop_vars
        self.cur: dict[str, str] = {}
        self.carried: list[set[str]] = []      # carried names of the enclosing loops
        self.loop_stack: list[str] = []        # their variables
        self.kill_sites: dict[str, list] = {}  # carried name -> the guard of each write
        self.source: dict[str, str] = {}       # SSA name -> source name
        self.all_carried: set[str] = set()

    def fresh(self, src: str) -> str:
        name = self.names(src)
        self.source[name] = src
        return name

    def read(self, e: Expr, out: list, keep: str | None = None) -> Expr:
        """``e`` over SSA names; carried locals other than ``keep`` read through snapshots."""
        all_carried = set().union(set(), *self.carried)
        def fn(n):
            if isinstance(n, Var) and n.name in self.cur:
                name = self.cur[n.name]
                if name in all_carried and name != keep:
                    snap = self.fresh(self.source.get(name, name))
                    out.append(Assign(Var(snap), Var(name)))
                    return Var(snap)
                return Var(name)
            return None
        return rewrite(e, fn)

    def block(self, stmts, live: set[str]) -> list:
        out: list = []
        for k, s in enumerate(stmts):
            after = _live_in(stmts[k + 1:], live)
            if isinstance(s, Assign):
                self.assign(s, out)
            elif isinstance(s, If):
                self.if_(s, after, out)
            else:
                self.loop(s, after, out)
        return out

    def assign(self, s: Assign, out: list) -> None:
        src = s.target.name
        name = self.cur.get(src)
        loc = getattr(s, "loc", None)
        if name in set().union(set(), *self.carried):
            v = s.value
            acc = (isinstance(v, BinOp) and v.op in "+-" and v.lhs == Var(src)
                   and src not in local_vars(v.rhs))
            if acc:
                out.append(at(Assign(Var(name), BinOp(v.op, Var(name), self.read(v.rhs, out))), loc))
            elif src not in local_vars(v) and name in self.kill_sites:
                value = self.read(v, out)
                out.append(Kill(name, value, self.kill_sites[name].pop(0), loc))
            else:
                out.append(at(Assign(Var(name), self.read(v, out, keep=name)), loc))
            return
        value = self.read(s.value, out)
        name = self.fresh(src)
        self.cur[src] = name
        out.append(at(Assign(Var(name), value), loc))

    def if_(self, s: If, after: set[str], out: list) -> None:
        cond = self.fresh("_c")
        out.append(Assign(Var(cond), self.read(s.cond, out)))
        before = dict(self.cur)
        then = self.block(s.then.stmts, after)
        cur_then, self.cur = self.cur, dict(before)
        orelse = self.block(s.orelse.stmts, after)
        cur_else = self.cur
        for src in sorted(set(cur_then) | set(cur_else)):
            a, b = cur_then.get(src), cur_else.get(src)
            if a == b or a is None or b is None:
                self.cur[src] = a or b
                continue
            m = self.fresh(src)
            then.append(Assign(Var(m), Var(a)))
            orelse.append(Assign(Var(m), Var(b)))
            self.cur[src] = m
        out.append(PIf(cond, tuple(then), tuple(orelse), getattr(s, "loc", None)))

    def loop(self, s: Loop, after: set[str], out: list) -> None:
        head = set(after)
        while True:
            new = after | _live_in(s.body.stmts, head)
            if new == head:
                break
            head = new
        written = _assigned(s.body.stmts)
        carried_src = sorted(written & (_live_in(s.body.stmts, head) | after))
        outer = set().union(set(), *self.carried)
        names, restores, kills = [], [], []
        for src in carried_src:
            if src in self.cur and self.cur[src] in outer:       # carried further out
                snap = self.fresh(src)
                out.append(Assign(Var(snap), Var(self.cur[src])))
                names.append(self.cur[src])
                restores.append((self.cur[src], snap))
                continue
            name = self.fresh(src)
            if src in self.cur:
                out.append(Assign(Var(name), Var(self.cur[src])))
                restores.append((name, self.cur[src]))
            self.cur[src] = name
            names.append(name)
            sites = _kill_sites(s, src, [s.var])
            if sites and None not in sites:
                lasts = {v: self.fresh(f"_last_{src}") for site in sites for v in site}
                which = self.fresh(f"_which_{src}") if len(sites) > 1 else None
                self.kill_sites[name] = [
                    (*((lasts[v], Var(v)) for v in site), *(((which, Const(k)),) if which else ()))
                    for k, site in enumerate(sites)]
                out.extend(Assign(Var(last), Const(-1.0)) for last in (*lasts.values(), which)
                           if last)
                kills.append((name, lasts[s.var]))
        self.carried.append(set(names))
        self.all_carried |= set(names)
        body = self.block(s.body.stmts, head)
        self.carried.pop()
        out.append(PLoop(dataclasses.replace(s, body=Block(tuple(body))), tuple(names),
                          tuple(restores), tuple(kills)))


def _kill_sites(s: Loop, src: str, loops: list[str]) -> list:
    """Per write of ``src`` below loop ``s``: the loop variables around it if it overwrites
    ``src`` (reads no ``src``), else None."""
    out = []
    def visit(stmts, loops):
        for t in stmts:
            if isinstance(t, Assign) and t.target == Var(src):
                out.append(list(loops) if src not in local_vars(t.value) else None)
            elif isinstance(t, If):
                visit(t.then.stmts, loops)
                visit(t.orelse.stmts, loops)
            elif isinstance(t, Loop):
                visit(t.body.stmts, [*loops, t.var])
    visit(s.body.stmts, loops)
    return out


def normalize(stmts, info: NeuronInfo, value: str) -> list:
    """Forward statements with ``self.value`` as the local ``value``, ``x op= e`` as
    ``x = x op e``, and field stores (a ``Batch`` arg-max) dropped: forward stored them."""
    written = {s.target.name for s in _flat(stmts)
               if isinstance(s, (Assign, AugAssign)) and isinstance(s.target, NeuronRef)
               and s.target.kind == "field"}

    def expr(e: Expr, loc) -> Expr:
        def fn(n):
            if not isinstance(n, NeuronRef):
                return None
            if n.kind == "value":
                return Var(value)
            if n.kind in ("grad", "grad_input", "grad_field"):
                raise DerivationError("forward reads a gradient", loc)
            if n.kind == "field" and n.name in written:
                raise DerivationError(f"forward reads self.{n.name}, which it also writes", loc)
            return None
        return rewrite(e, fn)

    out = []
    for s in stmts:
        loc = getattr(s, "loc", None)
        if isinstance(s, Loop):
            out.append(dataclasses.replace(s, body=Block(tuple(normalize(s.body.stmts, info,
                                                                          value)))))
        elif isinstance(s, If):
            out.append(dataclasses.replace(s, cond=expr(s.cond, loc),
                                           then=Block(tuple(normalize(s.then.stmts, info, value))),
                                           orelse=Block(tuple(normalize(s.orelse.stmts, info,
                                                                         value)))))
        else:
            t = s.target
            if isinstance(t, NeuronRef) and t.kind == "field":
                if t.name in info.params:
                    raise DerivationError(f"forward writes the parameter self.{t.name}", loc)
                continue
            if isinstance(t, NeuronRef) and t.kind != "value":
                raise DerivationError(f"forward writes a gradient (self.{t.kind})", loc)
            target = Var(value) if isinstance(t, NeuronRef) else t
            rhs = expr(s.value, loc)
            if isinstance(s, AugAssign):
                rhs = BinOp(s.op, target, rhs)
            out.append(at(Assign(target, rhs), loc))
    return out


def _flat(stmts):
    for s in stmts:
        yield s
        if isinstance(s, Loop):
            yield from _flat(s.body.stmts)
        elif isinstance(s, If):
            yield from _flat(s.then.stmts)
            yield from _flat(s.orelse.stmts)


def replay(stmts, suppress: frozenset) -> list:
    """P as plain IR; the ``_last`` records of loops in ``suppress`` are left out (their
    adjoint loop is running and reads the finished records)."""
    out = []
    for s in stmts:
        if isinstance(s, Kill):
            out.append(at(Assign(Var(s.target), s.value), s.loc))
            if s.target not in suppress:
                out.extend(Assign(Var(last), what) for last, what in s.guard)
        elif isinstance(s, PIf):
            out.append(at(If(Var(s.cond), Block(tuple(replay(s.then, suppress))),
                              Block(tuple(replay(s.orelse, suppress)))), s.loc))
        elif isinstance(s, PLoop):
            out.append(dataclasses.replace(s.loop, body=Block(tuple(
                replay(s.loop.body.stmts, suppress)))))
        else:
            out.append(s)
    return out


def p_reads(stmts) -> set[str]:
    out = set()
    for s in stmts:
        if isinstance(s, (Assign, Kill)):
            out |= local_vars(s.value)
        elif isinstance(s, PIf):
            out |= p_reads(s.then) | p_reads(s.orelse)
        elif isinstance(s, PLoop):
            out |= p_reads(s.loop.body.stmts)
    return out


def p_defs(stmts) -> set[str]:
    out = set()
    for s in stmts:
        if isinstance(s, Assign):
            out.add(s.target.name)
        elif isinstance(s, Kill):
            out.add(s.target)
        elif isinstance(s, PIf):
            out |= {s.cond} | p_defs(s.then) | p_defs(s.orelse)
        elif isinstance(s, PLoop):
            out |= {s.loop.var} | p_defs(s.loop.body.stmts)
    return out


def kills(s: PIf) -> list[Kill]:
    out = []
    for t in (*s.then, *s.orelse):
        if isinstance(t, Kill):
            out.append(t)
        elif isinstance(t, PIf):
            out += kills(t)
    return out


def without(stmts, drop: list[Kill]) -> list:
    """``stmts`` less the writes in ``drop`` (a write is its target and guard)."""
    keys = {(k.target, k.guard) for k in drop}
    out = []
    for t in stmts:
        if isinstance(t, Kill) and (t.target, t.guard) in keys:
            continue
        if isinstance(t, PIf):
            t = PIf(t.cond, tuple(without(t.then, drop)), tuple(without(t.orelse, drop)), t.loc)
        out.append(t)
    return out


def p_assignments(stmts) -> dict[str, Expr]:
    out: dict[str, Expr] = {}
    for s in stmts:
        if isinstance(s, Assign):
            out[s.target.name] = s.value
        elif isinstance(s, PIf):
            out.update(p_assignments(s.then), **p_assignments(s.orelse))
        elif isinstance(s, PLoop):
            out.update(p_assignments(s.loop.body.stmts))
    return out


