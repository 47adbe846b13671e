"""Derived backward: reverse mode over a neuron's ``forward`` (neuron-level IR -> same IR).

The result is what a hand-written ``backward`` parses to (``+=`` into ``grad_inputs`` and
parameter gradients), so synthesis and every pass treat it alike (an FC's derived backward
still becomes GEMMs). How: the forward becomes an SSA program ``P`` (locals renamed per
assignment, ``self.value`` a local starting at zero, ``if`` conditions hoisted into locals,
``if`` joins as copies). A local carried from one loop iteration to the next keeps one name
in its loop; reads of it are snapshotted into SSA locals. The derived body replays ``P``
(recomputation, never a stored tape) and then walks it backwards, keeping adjoints as
expressions and materializing them as ``_d_*`` locals around loops and branches.

Assumes: adjoint loops run their iterations in forward order, so each carried local's adjoint
must be the same at the start and end of an iteration (``c += e``); a carried local that a
loop overwrites (``if x > best: best = x``) passes its adjoint to the *last* write only: the
replay records that iteration in ``_last_*`` locals (the first arg-max on ties, as max-pool's).
Anything else is a :class:`NeuronSyntaxError` naming the line and asking for a backward.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

from latte.compiler.frontend import NeuronInfo, NeuronRef, parse_method
from latte.compiler.ir import (
    Assign,
    AugAssign,
    BinOp,
    Block,
    BoolOp,
    Buffer,
    Call,
    Compare,
    Const,
    Expr,
    If,
    Loop,
    NameGen,
    Node,
    Ref,
    Select,
    UnaryOp,
    Var,
    rewrite,
    walk,
)
from latte.compiler.printer import format_ir
from latte.errors import NeuronSyntaxError
from latte.lang import ActivationEnsemble

ZERO = Const(0.0)


def defines_backward(neuron_type: type) -> bool:
    """Whether a class between ``neuron_type`` and ``Neuron`` defines ``backward``."""
    return any("backward" in c.__dict__ for c in neuron_type.__mro__
               if c.__name__ != "Neuron" and c is not object)


def derived_backward(ens, info: NeuronInfo) -> Block:
    """The backward of ``ens``'s neuron type, derived from its ``forward``."""
    return derive_backward(parse_method(ens.neuron_type, "forward", info), info,
                           inplace=isinstance(ens, ActivationEnsemble),
                           where=_where(ens.neuron_type))


def _where(neuron_type: type) -> str:
    try:
        _, line = inspect.getsourcelines(neuron_type.forward)
        return f"{inspect.getsourcefile(neuron_type.forward)}:{line}"
    except (OSError, TypeError):
        return neuron_type.__name__


def format_neuron(block: Block) -> str:
    """A neuron-level body as the Python a user would write (``self.grad_inputs[0][i]``)."""
    def fn(n):
        if not isinstance(n, NeuronRef):
            return None
        base = {"value": "self.value", "grad": "self.grad", "field": f"self.{n.name}",
                "grad_field": f"self.grad_{n.name}", "input": f"self.inputs[{n.conn}]",
                "grad_input": f"self.grad_inputs[{n.conn}]"}[n.kind]
        if not n.index:
            return Var(base)
        return Ref(Buffer((base,), base, ()), n.index, ())
    return format_ir(rewrite(block, fn))


# ---------------------------------------------------------------- the SSA program

@dataclass(frozen=True)
class _Kill:
    """``target = value`` overwriting a carried local; its adjoint goes to the last write,
    the iteration ``guard`` records (``(last_local, loop_var)`` pairs)."""

    target: str
    value: Expr
    guard: tuple[tuple[str, str], ...]
    loc: object = None


@dataclass(frozen=True)
class _PLoop:
    loop: Loop                              # its body holds P statements
    carried: tuple[str, ...]                # names carried by this loop (its writes)
    restores: tuple[tuple[str, str], ...]   # (target, source) copies before its adjoint
    kills: tuple[tuple[str, str], ...]      # (carried name, its first _last local)


@dataclass(frozen=True)
class _PIf:
    cond: str                               # the hoisted condition local
    then: tuple
    orelse: tuple
    loc: object = None


def _at(stmt, loc):
    """``stmt`` with the source location ``loc`` (a forward statement's) where there is one."""
    return stmt if loc is None else dataclasses.replace(stmt, loc=loc)


def _vars(e: Node) -> set[str]:
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
            live = (live - {s.target.name} if isinstance(s.target, Var) else live) | _vars(s.value)
        elif isinstance(s, If):
            live = _vars(s.cond) | _live_in(s.then.stmts, live) | _live_in(s.orelse.stmts, live)
        elif isinstance(s, Loop):
            head = set(live)
            while True:
                new = live | _live_in(s.body.stmts, head)
                if new == head:
                    break
                head = new
            live = head
    return live


class _Error(Exception):
    def __init__(self, message: str, loc=None):
        super().__init__(message)
        self.loc = loc


class _SSA:
    """Normalized forward (``x op= e`` as ``x = x op e``, value as a local) -> P."""

    def __init__(self, names: NameGen, value: str, loop_vars: set[str]):
        self.names, self.value, self.loop_vars = names, value, loop_vars
        self.cur: dict[str, str] = {}
        self.carried: list[set[str]] = []      # carried names of the enclosing loops
        self.loop_stack: list[str] = []        # their variables
        self.kill_sites: dict[str, list] = {}  # carried name -> [(loop vars at the write)]
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
                   and src not in _vars(v.rhs))
            if acc:
                out.append(_at(Assign(Var(name), BinOp(v.op, Var(name), self.read(v.rhs, out))), loc))
            elif src not in _vars(v) and name in self.kill_sites:
                value = self.read(v, out)
                guard = tuple((last, var) for last, var in self.kill_sites[name][0])
                out.append(_Kill(name, value, guard, loc))
            else:
                out.append(_at(Assign(Var(name), self.read(v, out, keep=name)), loc))
            return
        value = self.read(s.value, out)
        name = self.fresh(src)
        self.cur[src] = name
        out.append(_at(Assign(Var(name), value), loc))

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
        out.append(_PIf(cond, tuple(then), tuple(orelse), getattr(s, "loc", None)))

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
            if len(sites) == 1 and sites[0] is not None:
                lasts = [(self.fresh(f"_last_{src}"), v) for v in sites[0]]
                out.extend(Assign(Var(last), Const(-1.0)) for last, _ in lasts)
                self.kill_sites[name] = [lasts]
                kills.append((name, lasts[0][0]))
        self.carried.append(set(names))
        self.all_carried |= set(names)
        body = self.block(s.body.stmts, head)
        self.carried.pop()
        out.append(_PLoop(dataclasses.replace(s, body=Block(tuple(body))), tuple(names),
                          tuple(restores), tuple(kills)))


def _kill_sites(s: Loop, src: str, loops: list[str]) -> list:
    """Per write of ``src`` below loop ``s``: the loop variables around it if it overwrites
    ``src`` (reads no ``src``), else None."""
    out = []
    def visit(stmts, loops):
        for t in stmts:
            if isinstance(t, Assign) and t.target == Var(src):
                out.append(list(loops) if src not in _vars(t.value) else None)
            elif isinstance(t, If):
                visit(t.then.stmts, loops)
                visit(t.orelse.stmts, loops)
            elif isinstance(t, Loop):
                visit(t.body.stmts, [*loops, t.var])
    visit(s.body.stmts, loops)
    return out


def _normalize(stmts, info: NeuronInfo, value: str) -> list:
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
                raise _Error("forward reads a gradient", loc)
            if n.kind == "field" and n.name in written:
                raise _Error(f"forward reads self.{n.name}, which it also writes", loc)
            return None
        return rewrite(e, fn)

    out = []
    for s in stmts:
        loc = getattr(s, "loc", None)
        if isinstance(s, Loop):
            out.append(dataclasses.replace(s, body=Block(tuple(_normalize(s.body.stmts, info,
                                                                          value)))))
        elif isinstance(s, If):
            out.append(dataclasses.replace(s, cond=expr(s.cond, loc),
                                           then=Block(tuple(_normalize(s.then.stmts, info, value))),
                                           orelse=Block(tuple(_normalize(s.orelse.stmts, info,
                                                                         value)))))
        else:
            t = s.target
            if isinstance(t, NeuronRef) and t.kind == "field":
                if t.name in info.params:
                    raise _Error(f"forward writes the parameter self.{t.name}", loc)
                continue
            if isinstance(t, NeuronRef) and t.kind != "value":
                raise _Error(f"forward writes a gradient (self.{t.kind})", loc)
            target = Var(value) if isinstance(t, NeuronRef) else t
            rhs = expr(s.value, loc)
            if isinstance(s, AugAssign):
                rhs = BinOp(s.op, target, rhs)
            out.append(_at(Assign(target, rhs), loc))
    return out


def _flat(stmts):
    for s in stmts:
        yield s
        if isinstance(s, Loop):
            yield from _flat(s.body.stmts)
        elif isinstance(s, If):
            yield from _flat(s.then.stmts)
            yield from _flat(s.orelse.stmts)


# ---------------------------------------------------------------- replay and adjoint

def _replay(stmts, suppress: frozenset) -> list:
    """P as plain IR; the ``_last`` records of loops in ``suppress`` are left out (their
    adjoint loop is running and reads the finished records)."""
    out = []
    for s in stmts:
        if isinstance(s, _Kill):
            out.append(_at(Assign(Var(s.target), s.value), s.loc))
            if s.target not in suppress:
                out.extend(Assign(Var(last), Var(v)) for last, v in s.guard)
        elif isinstance(s, _PIf):
            out.append(_at(If(Var(s.cond), Block(tuple(_replay(s.then, suppress))),
                              Block(tuple(_replay(s.orelse, suppress)))), s.loc))
        elif isinstance(s, _PLoop):
            out.append(dataclasses.replace(s.loop, body=Block(tuple(
                _replay(s.loop.body.stmts, suppress)))))
        else:
            out.append(s)
    return out


def _p_reads(stmts) -> set[str]:
    out = set()
    for s in stmts:
        if isinstance(s, (Assign, _Kill)):
            out |= _vars(s.value)
        elif isinstance(s, _PIf):
            out |= _p_reads(s.then) | _p_reads(s.orelse)
        elif isinstance(s, _PLoop):
            out |= _p_reads(s.loop.body.stmts)
    return out


def _p_defs(stmts) -> set[str]:
    out = set()
    for s in stmts:
        if isinstance(s, Assign):
            out.add(s.target.name)
        elif isinstance(s, _Kill):
            out.add(s.target)
        elif isinstance(s, _PIf):
            out |= {s.cond} | _p_defs(s.then) | _p_defs(s.orelse)
        elif isinstance(s, _PLoop):
            out |= {s.loop.var} | _p_defs(s.loop.body.stmts)
    return out


def _add(a: Expr | None, b: Expr) -> Expr:
    return b if a is None else BinOp("+", a, b)


def _mul(a: Expr, b: Expr) -> Expr:
    if a == Const(1.0) or a == Const(1):
        return b
    if b == Const(1.0) or b == Const(1):
        return a
    return BinOp("*", a, b)


def _neg(a: Expr) -> Expr:
    return a.operand if isinstance(a, UnaryOp) and a.op == "neg" else UnaryOp("neg", a)


def _is_sigmoid(e: Expr) -> Expr | None:
    """``x`` if ``e`` is ``1 / (1 + exp(-x))``."""
    if (isinstance(e, BinOp) and e.op == "/" and e.lhs in (Const(1), Const(1.0))
            and isinstance(e.rhs, BinOp) and e.rhs.op == "+" and e.rhs.lhs in (Const(1), Const(1.0))
            and isinstance(e.rhs.rhs, Call) and e.rhs.rhs.fn == "exp"
            and isinstance(e.rhs.rhs.args[0], UnaryOp) and e.rhs.rhs.args[0].op == "neg"):
        return e.rhs.rhs.args[0].operand
    return None


def _peel(e: Expr | None, base: Expr) -> Expr | None:
    """``d`` where ``e`` is ``base + d`` (a left-nested sum)."""
    if not isinstance(e, BinOp) or e.op != "+":
        return None
    if e.lhs == base:
        return e.rhs
    inner = _peel(e.lhs, base)
    return None if inner is None else BinOp("+", inner, e.rhs)


class _Rev:
    """Walks P backwards, emitting adjoint statements into ``out``."""

    def __init__(self, names: NameGen, info: NeuronInfo, ssa: _SSA):
        self.names, self.info, self.ssa = names, info, ssa
        self.adj: dict[str, Expr] = {}
        self.out: list = []
        self.suppress: frozenset = frozenset()
        self.loc = None   # the forward statement whose adjoint is being emitted

    # ------------------------------------------------------------ expressions
    def contrib(self, e: Expr, s: Expr, top: Expr | None = None) -> None:
        """Add ``s * d e / d leaf`` to the adjoint of every leaf of ``e``."""
        me = top if top is not None else e
        if isinstance(e, Var):
            if e.name not in self.ssa.loop_vars:
                self.adj[e.name] = _add(self.adj.get(e.name), s)
            return
        if isinstance(e, NeuronRef):
            if e.kind == "input":
                self.out.append(_at(AugAssign(NeuronRef("grad_input", conn=e.conn, index=e.index),
                                              "+", s), self.loc))
            elif e.kind == "field" and e.name in self.info.params:
                self.out.append(_at(AugAssign(NeuronRef("grad_field", e.name, index=e.index), "+",
                                              s), self.loc))
            return
        if isinstance(e, (Const, Compare, BoolOp)):
            return
        if not isinstance(s, (Const, Var, NeuronRef)) and isinstance(e, (BinOp, Select)):
            tmp = self.names("_s")
            self.out.append(Assign(Var(tmp), s))
            s = Var(tmp)
        x = _is_sigmoid(e)
        if x is not None:
            self.contrib(x, _mul(s, BinOp("*", me, BinOp("-", Const(1.0), me))))
        elif isinstance(e, BinOp):
            a, b = e.lhs, e.rhs
            if e.op == "+":
                self.contrib(a, s)
                self.contrib(b, s)
            elif e.op == "-":
                self.contrib(a, s)
                self.contrib(b, _neg(s))
            elif e.op == "*":
                self.contrib(a, _mul(b, s))
                self.contrib(b, _mul(a, s))
            elif e.op == "/":
                self.contrib(a, BinOp("/", s, b))
                self.contrib(b, _neg(BinOp("/", _mul(s, me), b)))
            elif e.op in ("max", "min"):
                wins = Compare(">" if e.op == "max" else "<", a, b)
                self.contrib(a, Select(wins, s, ZERO))
                self.contrib(b, Select(wins, ZERO, s))
        elif isinstance(e, UnaryOp):
            if e.op == "neg":
                self.contrib(e.operand, _neg(s))
        elif isinstance(e, Select):
            self.contrib(e.if_true, Select(e.cond, s, ZERO))
            self.contrib(e.if_false, Select(e.cond, ZERO, s))
        elif isinstance(e, Call):
            a = e.args[0]
            d = {"exp": lambda: _mul(me, s),
                 "log": lambda: BinOp("/", s, a),
                 "tanh": lambda: _mul(s, BinOp("-", Const(1.0), BinOp("*", me, me))),
                 "sqrt": lambda: BinOp("/", s, BinOp("*", Const(2.0), me)),
                 "abs": lambda: Select(Compare(">", a, ZERO), s,
                                       Select(Compare("<", a, ZERO), _neg(s), ZERO))}[e.fn]()
            self.contrib(a, d)

    # ------------------------------------------------------------ statements
    def block(self, stmts) -> None:
        for s in reversed(stmts):
            self.stmt(s)

    def stmt(self, s) -> None:
        self.loc = getattr(s, "loc", None) or self.loc
        if isinstance(s, Assign):
            seed = self.adj.pop(s.target.name, None)
            if seed is not None:
                carried = s.target.name in self.ssa.all_carried
                self.contrib(s.value, seed, None if carried else s.target)
        elif isinstance(s, _Kill):
            self.kill(s)
        elif isinstance(s, _PIf):
            self.if_(s)
        else:
            self.loop(s)

    def kill(self, s: _Kill) -> None:
        seed = self.adj.get(s.target)
        if seed is None:
            return
        conds = tuple(Compare("==", Var(v), Var(last)) for last, v in s.guard)
        guard = conds[0] if len(conds) == 1 else BoolOp("and", conds)
        (body,) = self.region([[s]], _vars(s.value), set(), run=lambda _: self.contrib(s.value, seed))
        self.out.append(_at(If(guard, Block(tuple(body))), s.loc))

    def if_(self, s: _PIf) -> None:
        inner = _p_defs(s.then) | _p_defs(s.orelse)
        hoisted = [k for k in _kills(s) if not _vars(k.value) & inner]
        for k in hoisted:
            self.kill(k)
        then, orelse = (_without(b, hoisted) for b in (s.then, s.orelse))
        branches = self.region([then, orelse], _p_reads(then) | _p_reads(orelse), inner, loc=s.loc)
        if any(branches):
            self.out.append(_at(If(Var(s.cond), Block(tuple(branches[0])),
                                   Block(tuple(branches[1]))), s.loc))

    def loop(self, s: _PLoop) -> None:
        body = s.loop.body.stmts
        restored = {t for t, _ in s.restores}
        for name, seed in sorted(self.adj.items()):
            # evaluate once for all iterations (carried locals), or before the restores
            # below rewind the locals the adjoint reads to their values before the loop
            if ((name in s.carried and not isinstance(seed, (Const, Var, NeuronRef)))
                    or _vars(seed) & restored):
                tmp = self.names("_s")
                self.out.append(Assign(Var(tmp), seed))
                self.adj[name] = Var(tmp)
        self.out.extend(Assign(Var(t), Var(src)) for t, src in s.restores)
        suppress = self.suppress
        self.suppress = suppress | {name for name, _ in s.kills}
        replay = _replay(body, self.suppress)
        (adjoint,) = self.region([body], _p_reads(body), _p_defs(body) | set(s.carried),
                                 loc=getattr(s.loop, "loc", None))
        self.suppress = suppress
        self.out.append(dataclasses.replace(s.loop, body=Block((*replay, *adjoint))))
        for name, first in s.kills:   # no write in the loop: the value from before it
            if name in self.adj:
                self.adj[name] = Select(Compare("==", Var(first), Const(-1.0)), self.adj[name], ZERO)

    def region(self, branches, reads: set[str], defs: set[str], loc=None, run=None) -> list:
        """Adjoints of ``branches`` (alternatives, or one loop body) as statement lists;
        adjoints of outside locals they read become ``_d_*`` locals updated at their end."""
        entry = dict(self.adj)
        pre = sorted(reads - defs - self.ssa.loop_vars)
        slots = {x: self.names(f"_d_{self.ssa.source.get(x, x).lstrip('_')}") for x in pre}
        outs, changed = [], set()
        for branch in branches:
            self.adj = {**entry, **{x: Var(slots[x]) for x in pre}}
            saved, self.out = self.out, []
            run(branch) if run else self.block(branch)
            for x in pre:
                new = self.adj.get(x)
                if new == Var(slots[x]):
                    continue
                changed.add(x)
                delta = _peel(new, Var(slots[x]))
                self.out.append(AugAssign(Var(slots[x]), "+", delta) if delta is not None
                                else Assign(Var(slots[x]), new or ZERO))
            for x in defs & self.ssa.all_carried:
                if self.adj.get(x) != entry.get(x):
                    raise _Error(f"local {self.ssa.source.get(x, x)!r} carries a value from one "
                                 "loop iteration to the next that the derived backward cannot "
                                 "reverse (only `x += ...` and overwriting the last value are)", loc)
            outs.append(self.out)
            self.out = saved
        self.adj = {k: v for k, v in entry.items() if k not in defs or k in self.ssa.all_carried}
        for x in sorted(changed):
            self.out.append(Assign(Var(slots[x]), entry.get(x, ZERO)))
            self.adj[x] = Var(slots[x])
        return outs


def _kills(s: _PIf) -> list[_Kill]:
    out = []
    for t in (*s.then, *s.orelse):
        if isinstance(t, _Kill):
            out.append(t)
        elif isinstance(t, _PIf):
            out += _kills(t)
    return out


def _without(stmts, drop: list[_Kill]) -> list:
    """``stmts`` less the kills of ``drop``'s targets (each carried local has one kill)."""
    targets = {k.target for k in drop}
    out = []
    for t in stmts:
        if isinstance(t, _Kill) and t.target in targets:
            continue
        if isinstance(t, _PIf):
            t = _PIf(t.cond, tuple(_without(t.then, drop)), tuple(_without(t.orelse, drop)), t.loc)
        out.append(t)
    return out


# ---------------------------------------------------------------- clean-up and driver

def _dce(stmts: list, live: frozenset = frozenset()) -> tuple[list, frozenset]:
    """Drop assignments to locals that nothing stored reads, by strong liveness (a
    loop's replay of a local that only feeds itself goes too), then empty ``if``s and loops.
    Returns the statements and the locals live before them."""
    out = []
    for s in reversed(stmts):
        if isinstance(s, (Assign, AugAssign)):
            t = s.target
            if isinstance(t, Var) and t.name not in live:
                continue
            if isinstance(t, Var) and isinstance(s, Assign):
                live = live - {t.name}
            idx = set().union(set(), *(_vars(i) for i in t.index)) if isinstance(t, NeuronRef) else set()
            live = live | _vars(s.value) | idx
            out.append(s)
        elif isinstance(s, If):
            then, lt = _dce(s.then.stmts, live)
            orelse, le = _dce(s.orelse.stmts, live)
            if then or orelse:
                out.append(dataclasses.replace(s, then=Block(tuple(then)), orelse=Block(tuple(orelse))))
                live = lt | le | _vars(s.cond)
        elif isinstance(s, Loop):
            head = live
            while True:
                body, inner = _dce(s.body.stmts, head)
                if inner | live == head:
                    break
                head = inner | live
            if body:
                out.append(dataclasses.replace(s, body=Block(tuple(body))))
                live = head
    return out[::-1], live


def _through_output(stmts: list, defs: dict[str, Expr]) -> list:
    """Where ``u = max(v, c)`` (``min``), ``v > c`` is ``u > c`` (``v < c``: ``u < c``):
    a ReLU's derivative read from its output."""
    ops = {"max": (">", "<="), "min": ("<", ">=")}
    swap = {}
    for u, d in defs.items():
        if isinstance(d, BinOp) and d.op in ops and isinstance(d.lhs, Var) and isinstance(d.rhs, Const):
            for op in ops[d.op]:
                swap[Compare(op, d.lhs, d.rhs)] = Compare(op, Var(u), d.rhs)
    block = rewrite(Block(tuple(stmts)), lambda n: swap.get(n) if isinstance(n, Compare) else None)
    return list(block.stmts)


def _defs(stmts) -> dict[str, Expr]:
    out: dict[str, Expr] = {}
    for s in stmts:
        if isinstance(s, Assign):
            out[s.target.name] = s.value
        elif isinstance(s, _PIf):
            out.update(_defs(s.then), **_defs(s.orelse))
        elif isinstance(s, _PLoop):
            out.update(_defs(s.loop.body.stmts))
    return out


def derive_backward(forward: Block, info: NeuronInfo, *, inplace: bool = False,
                    where: str = "") -> Block:
    """The backward of a neuron whose ``forward`` parses to ``forward``: ``+=`` into
    ``grad_inputs`` and parameter gradients. ``inplace``: an activation's ``value =
    f(value)``, whose derivative must be expressible through the output (the input is
    overwritten); the result rewrites ``self.grad`` in place."""
    names = NameGen()
    for n in walk(forward):
        if isinstance(n, Var):
            names.used.add(n.name)
        elif isinstance(n, Loop):
            names.used.add(n.var)
    loop_vars = {n.var for n in walk(forward) if isinstance(n, Loop)}
    value = names("_value")
    try:
        ssa = _SSA(names, value, loop_vars)
        start = []
        if inplace:
            x0 = ssa.cur[value] = names("_input")
        else:
            x0 = ssa.cur[value] = ssa.fresh(value)
            start.append(Assign(Var(x0), ZERO))
        program = start + ssa.block(_normalize(forward.stmts, info, value), {value})
        final = ssa.cur[value]
        rev = _Rev(names, info, ssa)
        rev.adj[final] = NeuronRef("grad")
        rev.block(program)
        body = _replay(program, frozenset()) + rev.out
        if inplace:
            body.append(Assign(NeuronRef("grad"), rev.adj.get(x0, ZERO)))
            body = _through_output(body, _defs(program))
            if final not in ssa.all_carried:   # read the output where forward left it
                body = [s for s in body if not (isinstance(s, Assign) and s.target == Var(final))]
                body = list(rewrite(Block(tuple(body)), lambda n: NeuronRef("value")
                                    if n == Var(final) else None).stmts)
        body, _ = _dce(body)
        if inplace and any(n == Var(x0) for s in body for n in walk(s)):
            raise _Error("the derivative of this in-place activation needs its input, which "
                         "forward overwrote (only functions whose derivative follows from "
                         "their output, like relu, tanh and sigmoid, can be derived)")
    except _Error as exc:
        loc = exc.loc
        file, line = (loc.file, loc.line) if loc is not None else (where, None)
        if line is None and ":" in where:
            file, _, line = where.rpartition(":")
        raise NeuronSyntaxError(f"{exc}; write backward() by hand", file or None,
                                int(line) if line else None) from None
    return Block(tuple(body))
