"""Unswitching: a neuron loop moved inside the branches that do not depend on its neuron.

A neuron whose body branches on what every neuron of a batch item sees alike (a table
lookup comparing the item's id with row numbers: ``x = ids[n]; if x == v: ...``) evaluates
the same tests once per neuron. When the neurons of a loop do not interfere, the loop can
run inside those tests instead: the tests run once per item, and under them the neurons'
work is a plain loop nest (the lookup's becomes a matrix-vector product).

For a neuron loop ``L`` (an ensemble dimension) whose body holds an ``if`` on data (a load,
or a local assigned from one) that does not depend on ``L``'s neuron, when

- its iterations are independent: every buffer the body writes is written and read at one
  index that differs between iterations (:func:`~latte.compiler.passes.distribute.injective`),
  or only accumulated into (``+=``, never loaded), as loop distribution requires;

the body's statements are rewritten in order: an assignment of a local from an expression
of neither ``L``'s variable, nor a local the body assigns otherwise, nor a buffer it writes,
runs once before the rest (hoisted); an ``if`` on such an expression, and a loop whose body
holds such a test on data, take ``L`` inside; statements that pass locals to each other get
one ``L`` around them; any other statement gets ``L`` around it alone. Running iteration
after iteration of ``L`` per statement is loop distribution, and taking ``L`` inside an
``if`` or loop that does not depend on it is interchange: both legal when iterations do not
interfere. Inner neuron loops are unswitched first. Tests on loop indices alone (a window's
padding guards) do not count: the passes that split them off expect the neuron loops where
synthesis put them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from latte.compiler.ir import Assign, AugAssign, Block, If, Kernel, Load, Loop, Var, walk
from latte.compiler.passes.data_copy import variables
from latte.compiler.passes.distribute import groups, injective, uses


def unswitch_neuron_loops(kernel: Kernel) -> Kernel:
    """``kernel`` with every neuron loop it can unswitch moved inside its invariant tests."""
    return replace(kernel, body=_block(kernel.body))


def _block(block: Block) -> Block:
    out = []
    for s in block.stmts:
        out.extend(_stmt(s))
    return Block(tuple(out))


def _stmt(s) -> list:
    if isinstance(s, If):
        return [replace(s, then=_block(s.then), orelse=_block(s.orelse))]
    if not isinstance(s, Loop):
        return [s]
    loop = replace(s, body=_block(s.body))   # inner loops first
    if loop.axis is None or loop.axis.dim < 0 or not _independent(loop):
        return [loop]
    fixed = _invariant_locals(loop)
    moving = {loop.var} | ({n.target.name for n in _local_stores(loop)} - fixed)
    if not _tests(loop.body, moving, fixed):
        return [loop]
    return _sink(loop, loop.body.stmts, fixed, moving)


def _tests(node, moving: set[str], fixed: set[str]) -> bool:
    """Does ``node`` hold an ``if`` on data (a load, or a hoisted local) that is the same
    for every iteration?"""
    return any(isinstance(n, If) and not variables(n.cond) & moving
               and (variables(n.cond) & fixed or any(isinstance(x, Load) for x in walk(n.cond)))
               for n in walk(node))


def _local_stores(loop: Loop) -> list:
    """The assignments (and updates) of locals in ``loop``'s body."""
    return [n for n in walk(loop.body)
            if isinstance(n, (Assign, AugAssign)) and isinstance(n.target, Var)]


def _written(loop: Loop) -> set:
    """The buffers ``loop``'s body stores to."""
    return {n.target.buffer for n in walk(loop.body)
            if isinstance(n, (Assign, AugAssign)) and not isinstance(n.target, Var)}


def _invariant_locals(loop: Loop) -> set[str]:
    """Locals assigned once, from an expression that is the same in every iteration of
    ``loop``: none of its variable, no load of a buffer the body writes, no local the body
    assigns other than such ones."""
    written, assigned = _written(loop), _local_stores(loop)
    counts = Counter(n.target.name for n in assigned)
    fixed: set[str] = set()
    changed = True
    while changed:
        changed = False
        for n in assigned:
            name = n.target.name
            if name in fixed or not isinstance(n, Assign) or counts[name] != 1:
                continue
            free = variables(n.value)
            loads = {x.ref.buffer for x in walk(n.value) if isinstance(x, Load)}
            if loop.var not in free and not loads & written and not (free & counts.keys()) - fixed:
                fixed.add(name)
                changed = True
    return fixed


def _independent(loop: Loop) -> bool:
    """Do different iterations of ``loop`` touch different elements of what it writes (or
    only accumulate into it)?"""
    extents = {n.var: n.extent for n in walk(loop) if isinstance(n, Loop)}
    written = _written(loop)
    for buf, use in uses(loop.body.stmts).items():
        if buf not in written:
            continue
        one_point = len(use.indices) == 1 and injective(*next(iter(use.indices)), loop, extents)
        if not (one_point or (use.accumulated_only and not use.loaded)):
            return False
    return True


def _sink(loop: Loop, stmts, fixed: set[str], moving: set[str],
          outer: frozenset[str] = frozenset()) -> list:
    """``for loop: stmts`` with the hoistable assignments (``fixed``) first and ``loop``
    taken inside the tests and loops that do not read what varies with it (``moving``);
    statements that pass a local to each other stay under one copy of ``loop`` (the
    variables of the loops ``loop`` went inside, ``outer``, link nothing)."""
    out = []
    for group in groups(stmts, frozenset(fixed) | outer):
        s = group[0]
        if len(group) > 1:
            out.append(replace(loop, body=Block(tuple(group))))
        elif isinstance(s, Assign) and isinstance(s.target, Var) and s.target.name in fixed:
            out.append(s)
        elif isinstance(s, If) and not variables(s.cond) & moving:
            inside = lambda b: Block(tuple(_sink(loop, b.stmts, fixed, moving, outer)))  # noqa: E731
            out.append(replace(s, then=inside(s.then), orelse=inside(s.orelse)))
        elif isinstance(s, Loop) and _tests(s.body, moving, fixed):
            body = _sink(loop, s.body.stmts, fixed, moving, outer | {s.var})
            out.append(replace(s, body=Block(tuple(body))))
        else:
            out.append(replace(loop, body=Block((s,))))
    return out
