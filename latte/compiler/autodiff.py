"""Derived backward: reverse mode over a neuron's ``forward`` (neuron-level IR -> same IR).

The result is what a hand-written ``backward`` parses to (``+=`` into ``grad_inputs`` and
parameter gradients), so synthesis and every pass treat it alike (an FC's derived backward
still becomes GEMMs). How: the forward becomes an SSA program ``P``
(:mod:`latte.compiler.autodiff_ssa`); the derived body replays ``P`` (recomputation, never a
stored tape) and then walks it backwards, keeping adjoints as expressions and materializing
them as ``_d_*`` locals around loops and branches.

Assumes: adjoint loops run their iterations in forward order, so each carried local's adjoint
must be the same at the start and end of an iteration (``c += e``); a carried local that a
loop overwrites (``if x > best: best = x``) passes its adjoint to the *last* write only: the
replay records that iteration in ``_last_*`` locals (the first arg-max on ties, as max-pool's).
Anything else is a :class:`NeuronSyntaxError` naming the line and asking for a backward.
"""

from __future__ import annotations

import dataclasses
import inspect

from latte.compiler.autodiff_ssa import (
    SSA,
    DerivationError,
    Kill,
    PIf,
    PLoop,
    at,
    kills,
    local_vars,
    normalize,
    p_assignments,
    p_defs,
    p_reads,
    replay,
    without,
)
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


def derived_backward(ens, info: NeuronInfo) -> Block:
    """The backward of ``ens``'s neuron type, derived from its ``forward``."""
    return derive_backward(parse_method(ens.neuron_type, "forward", info), info,
                           inplace=isinstance(ens, ActivationEnsemble),
                           where=_where(ens.neuron_type), name=ens.name)


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

# ---------------------------------------------------------------- replay and adjoint
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


def is_sigmoid(e: Expr) -> Expr | None:
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

    def __init__(self, names: NameGen, info: NeuronInfo, ssa: SSA):
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
                self.out.append(at(AugAssign(NeuronRef("grad_input", conn=e.conn, index=e.index),
                                              "+", s), self.loc))
            elif e.kind == "field" and e.name in self.info.params:
                self.out.append(at(AugAssign(NeuronRef("grad_field", e.name, index=e.index), "+",
                                              s), self.loc))
            return
        if isinstance(e, (Const, Compare, BoolOp)):
            return
        if not isinstance(s, (Const, Var, NeuronRef)) and isinstance(e, (BinOp, Select)):
            tmp = self.names("_s")
            self.out.append(Assign(Var(tmp), s))
            s = Var(tmp)
        x = is_sigmoid(e)
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
        elif isinstance(s, Kill):
            self.kill(s)
        elif isinstance(s, PIf):
            self.if_(s)
        else:
            self.loop(s)

    def kill(self, s: Kill) -> None:
        seed = self.adj.get(s.target)
        if seed is None:
            return
        conds = tuple(Compare("==", what, Var(last)) for last, what in s.guard)
        guard = conds[0] if len(conds) == 1 else BoolOp("and", conds)
        (body,) = self.region([[s]], local_vars(s.value), set(), run=lambda _: self.contrib(s.value, seed))
        self.out.append(at(If(guard, Block(tuple(body))), s.loc))

    def if_(self, s: PIf) -> None:
        inner = p_defs(s.then) | p_defs(s.orelse)
        hoisted = [k for k in kills(s) if not local_vars(k.value) & inner]
        for k in hoisted:
            self.kill(k)
        then, orelse = (without(b, hoisted) for b in (s.then, s.orelse))
        branches = self.region([then, orelse], p_reads(then) | p_reads(orelse), inner, loc=s.loc)
        if any(branches):
            self.out.append(at(If(Var(s.cond), Block(tuple(branches[0])),
                                   Block(tuple(branches[1]))), s.loc))

    def loop(self, s: PLoop) -> None:
        body = s.loop.body.stmts
        restored = {t for t, _ in s.restores}
        for name, seed in sorted(self.adj.items()):
            # evaluate once for all iterations (carried locals), or before the restores
            # below rewind the locals the adjoint reads to their values before the loop
            if ((name in s.carried and not isinstance(seed, (Const, Var, NeuronRef)))
                    or local_vars(seed) & restored):
                tmp = self.names("_s")
                self.out.append(Assign(Var(tmp), seed))
                self.adj[name] = Var(tmp)
        self.out.extend(Assign(Var(t), Var(src)) for t, src in s.restores)
        suppress = self.suppress
        self.suppress = suppress | {name for name, _ in s.kills}
        again = replay(body, self.suppress)
        (adjoint,) = self.region([body], p_reads(body), p_defs(body) | set(s.carried),
                                 loc=getattr(s.loop, "loc", None))
        self.suppress = suppress
        self.out.append(dataclasses.replace(s.loop, body=Block((*again, *adjoint))))
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
                    raise DerivationError(f"local {self.ssa.source.get(x, x)!r} carries a value from one "
                                 "loop iteration to the next that the derived backward cannot "
                                 "reverse (only `x += ...` and overwriting the last value are)", loc)
            outs.append(self.out)
            self.out = saved
        self.adj = {k: v for k, v in entry.items() if k not in defs or k in self.ssa.all_carried}
        for x in sorted(changed):
            self.out.append(Assign(Var(slots[x]), entry.get(x, ZERO)))
            self.adj[x] = Var(slots[x])
        return outs

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
            idx = set().union(set(), *(local_vars(i) for i in t.index)) if isinstance(t, NeuronRef) else set()
            live = live | local_vars(s.value) | idx
            out.append(s)
        elif isinstance(s, If):
            then, lt = _dce(s.then.stmts, live)
            orelse, le = _dce(s.orelse.stmts, live)
            if then or orelse:
                out.append(dataclasses.replace(s, then=Block(tuple(then)), orelse=Block(tuple(orelse))))
                live = lt | le | local_vars(s.cond)
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
    """Comparisons moved from ``v`` to ``u = max(v, c)`` (or ``min``) where they agree on
    every ``v`` (``v > d`` is ``u > d`` for ``d >= c``), so that a clamp's derivative reads
    its output (ReLU: ``v > 0`` is ``u > 0``); repeated through chains of clamps."""
    exact = {"max": {">": "ge", "<=": "ge", "<": "gt", ">=": "gt"},
             "min": {"<": "le", ">=": "le", ">": "lt", "<=": "lt"}}
    clamps = {d.lhs.name: (u, d.op, d.rhs.value) for u, d in sorted(defs.items())
              if isinstance(d, BinOp) and d.op in exact and isinstance(d.lhs, Var)
              and isinstance(d.rhs, Const)}

    def fn(n):
        while (isinstance(n, Compare) and isinstance(n.lhs, Var) and n.lhs.name in clamps
               and isinstance(n.rhs, Const)):
            u, op, c = clamps[n.lhs.name]
            d = n.rhs.value
            ok = {"ge": d >= c, "gt": d > c, "le": d <= c, "lt": d < c}[exact[op][n.op]]
            if not ok:
                break
            n = Compare(n.op, Var(u), n.rhs)
        return n if isinstance(n, Compare) else None
    return list(rewrite(Block(tuple(stmts)), fn).stmts)

def derive_backward(forward: Block, info: NeuronInfo, *, inplace: bool = False,
                    where: str = "", name: str = "") -> Block:
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
        ssa = SSA(names, value, loop_vars)
        start = []
        if inplace:
            x0 = ssa.cur[value] = names("_input")
        else:
            x0 = ssa.cur[value] = ssa.fresh(value)
            start.append(Assign(Var(x0), ZERO))
        program = start + ssa.block(normalize(forward.stmts, info, value), {value})
        final = ssa.cur[value]
        rev = _Rev(names, info, ssa)
        rev.adj[final] = NeuronRef("grad")
        rev.block(program)
        body = replay(program, frozenset()) + rev.out
        if inplace:
            body.append(Assign(NeuronRef("grad"), rev.adj.get(x0, ZERO)))
            body = _through_output(body, p_assignments(program))
            if final not in ssa.all_carried:   # read the output where forward left it
                body = [s for s in body if not (isinstance(s, Assign) and s.target == Var(final))]
                body = list(rewrite(Block(tuple(body)), lambda n: NeuronRef("value")
                                    if n == Var(final) else None).stmts)
        body, _ = _dce(body)
        readers = [s for s in walk(Block(tuple(body))) if isinstance(s, (Assign, AugAssign))
                   and Var(x0) in walk(s.value)]
        if inplace and readers:
            raise DerivationError("the derivative of this in-place activation needs its input, "
                                  "which forward overwrote (only functions whose derivative "
                                  "follows from their output, like relu, tanh and sigmoid, can "
                                  "be derived)", getattr(readers[0], "loc", None) or next(
                                      (getattr(s, "loc", None) for s in program
                                       if isinstance(s, Assign) and s.target == Var(final)), None))
    except DerivationError as exc:
        loc = exc.loc
        file, line = (loc.file, loc.line) if loc is not None else (where, None)
        if line is None and ":" in where:
            file, _, line = where.rpartition(":")
        about = f"ensemble {name!r}: " if name else ""
        raise NeuronSyntaxError(f"{about}{exc}; write backward() by hand", file or None,
                                int(line) if line else None) from None
    return Block(tuple(body))
