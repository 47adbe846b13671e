"""Index-set splitting: a loop whose body tests its own index against a padding border runs
the tests only where they can fail.

A window read through padding synthesizes as ``x[2*y + i - 1] if 2*y + i - 1 >= 0 else pad``
(or an ``if`` around a windowed write): every iteration tests, though only the first few
and last few can fail, and the branch keeps LLVM from vectorizing the loop. For each loop, innermost
first, the guard terms ``affine >= c`` / ``affine < c`` that use its variable
give the range of it on which they hold whatever the other variables (those of the loops
around and inside, over their whole ranges): the loop becomes up to three loops, the
middle one with those terms taken as true and the tests they decide removed. Terms that
hold on the whole loop are removed without a split. Only loops over an ensemble's
dimensions split (a neuron's own loops, a window's, are short: LLVM unrolls them), not
those over tiles (the rows inside a tile split instead), not those a parallel loop
collapses with, nor a body too large to copy.

A test on the tile index as well (a fused group's pool or convolution reading its
producer's rows ``2*y + 4*t - 5``: the rows inside a tile cannot split, as the first tiles
fail it) is decided per tile instead: each nest in the tile loop's body that holds such
tests runs as ``if <the tile is inside>: <the nest without them> else: <the nest>``, where
inside is the range of tiles on which they hold for every value of the nest's variables.
Inside an ``if``, its tests on one variable narrow that variable's range (a skewed group's
consumer runs from the second tile on). ``LATTE_SPLIT_GUARDS=0`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import replace

from latte.compiler.ir import (
    Affine,
    Block,
    BoolOp,
    Compare,
    Const,
    If,
    Kernel,
    Loop,
    LoopKind,
    Select,
    rewrite,
    walk,
)
from latte.compiler.passes.data_copy import conj, interior

MAX_BODY = 3000   # IR nodes; a larger body is not copied


def split_guards(kernel: Kernel) -> Kernel:
    """``kernel`` with every loop split around the padding tests on its index."""
    if os.environ.get("LATTE_SPLIT_GUARDS") == "0":
        return kernel
    return replace(kernel, body=_block(kernel.body, {}, 0))


def _block(block: Block, ranges: dict, collapsed: int) -> Block:
    only = collapsed if len(block.stmts) == 1 else 0
    return _flat(_stmt(s, ranges, only) for s in block.stmts)


def _flat(stmts) -> Block:
    """A block of ``stmts``, the statements of those that are blocks in their place."""
    return Block(tuple(t for s in stmts for t in (s.stmts if isinstance(s, Block) else (s,))))


def _stmt(s, ranges: dict, collapsed: int):
    if isinstance(s, If):
        return replace(s, then=_block(s.then, _narrowed(ranges, s.cond), 0),
                       orelse=_block(s.orelse, ranges, 0))
    if not isinstance(s, Loop):
        return s
    inner = {**ranges, s.var: (s.start, s.stop - 1)}
    if s.kind is LoopKind.PARALLEL:   # its collapsed loops keep their shape
        nested = dict(s.meta).get("collapse", 1) - 1
        return replace(s, body=_block(s.body, inner, nested))
    s = replace(s, body=_block(s.body, inner, max(collapsed - 1, 0)))
    if s.kind is LoopKind.TILE_OUTER:
        return replace(s, body=_per_tile(s.body, s.var, inner))
    return s if collapsed or s.axis is None else _split(s, ranges)


def _per_tile(block: Block, var: str, ranges: dict) -> Block:
    """``block`` (in a loop over tiles ``var``) with each nest that tests ``var`` against a
    border run without those tests on the tiles where they hold throughout it."""
    out = []
    for s in block.stmts:
        if isinstance(s, If):
            s = replace(s, then=_per_tile(s.then, var, _narrowed(ranges, s.cond)),
                        orelse=_per_tile(s.orelse, var, ranges))
        elif isinstance(s, Loop):
            s = _version(s, var, ranges)
        out.append(s)
    return Block(tuple(out))


def _version(nest: Loop, var: str, ranges: dict):
    """``if <tile var inside>: nest without its tests on var else: nest``, or ``nest``. Only
    tests made per element count (a select, an ``if`` around no loop): a gather's test per
    row (an ``if`` around the row's loop) costs too little to copy the nest for."""
    nodes = list(walk(nest))
    terms = {t for n in nodes for t in _guard_terms(n) if var in t.lhs.vars
             and not (isinstance(n, If) and any(isinstance(m, Loop) for m in walk(n)))}
    if not terms or len(nodes) > MAX_BODY:
        return nest
    inside = _loop_ranges(nodes)
    if var in inside:
        return nest
    known = {**ranges, **inside}
    whole = (ranges[var][0], ranges[var][1] + 1)
    lo, hi = whole
    held = set()
    for t in terms:
        bound = interior(t, var, known)
        if bound is not None and max(bound[0], lo) < min(bound[1], hi):
            held.add(t)
            lo, hi = max(bound[0], lo), min(bound[1], hi)
    if not held:
        return nest
    fast = _assume(Block((nest,)), held)
    if (lo, hi) == whole:
        return fast.stmts[0]
    tile = Affine.of(var)
    cond = conj([c for c, needed in ((Compare(">=", tile, Const(lo)), lo > whole[0]),
                                     (Compare("<", tile, Const(hi)), hi < whole[1]))
                 if needed])
    return If(cond, fast, Block((nest,)))


def _split(loop: Loop, ranges: dict):
    """``loop`` as up to three loops around its guard-free interior."""
    body_nodes = list(walk(loop.body))
    terms = {t for n in body_nodes for t in _guard_terms(n) if loop.var in t.lhs.vars}
    if not terms or len(body_nodes) > MAX_BODY:
        return loop
    inside = _loop_ranges(body_nodes)
    if loop.var in inside:   # a loop inside rebinds the variable
        return loop
    known = {**ranges, **inside}
    held = {}
    for t in terms:
        bound = interior(t, loop.var, known)
        if bound is not None:
            held[t] = (max(bound[0], loop.start), min(bound[1], loop.stop))
    always = {t for t, (a, b) in held.items() if a <= loop.start and b >= loop.stop}
    split = {t: r for t, r in held.items() if t not in always}
    lo = max([loop.start, *(a for a, _ in split.values())])
    hi = min([loop.stop, *(b for _, b in split.values())])
    if lo >= hi:
        split = {}
    if not always and not split:
        return loop
    edge = _assume(loop.body, always) if always else loop.body
    middle = _assume(loop.body, always | split.keys())
    pieces = [(loop.start, lo, edge), (lo, hi, middle), (hi, loop.stop, edge)] if split else [
        (loop.start, loop.stop, edge)]
    return Block(tuple(replace(loop, start=a, stop=b, body=body)
                       for a, b, body in pieces if a < b))


def _guard_terms(node):
    """The ``affine >= c`` / ``affine < c`` conjuncts of ``node``'s test (a select or an if)."""
    return _terms(node.cond) if isinstance(node, (Select, If)) else ()


def _narrowed(ranges: dict, cond) -> dict:
    """``ranges`` where ``cond`` holds: each of its terms on one variable narrows that
    variable's range (where that leaves it empty, ``ranges`` as they were)."""
    out = dict(ranges)
    for t in _terms(cond):
        if len(t.lhs.vars) != 1:
            continue
        (var,) = t.lhs.vars
        bound = interior(t, var, {}) if var in out else None
        if bound is not None:
            lo, hi = max(out[var][0], bound[0]), min(out[var][1], bound[1] - 1)
            if lo > hi:
                return ranges
            out[var] = (lo, hi)
    return out


def _terms(cond) -> list:
    stack, out = [cond], []
    while stack:
        c = stack.pop()
        if isinstance(c, BoolOp) and c.op == "and":
            stack.extend(c.values)
        elif isinstance(c, Compare) and c.op in (">=", "<") and isinstance(c.lhs, Affine):
            out.append(c)
    return out


def _loop_ranges(nodes) -> dict:
    """Each loop variable among ``nodes``: the hull of its loops' ranges."""
    out: dict[str, tuple[int, int]] = {}
    for n in nodes:
        if isinstance(n, Loop):
            a, b = out.get(n.var, (n.start, n.stop - 1))
            out[n.var] = (min(a, n.start), max(b, n.stop - 1))
    return out


def _assume(body: Block, true: set) -> Block:
    """``body`` with the guard terms ``true`` taken as holding."""
    def cond(c):
        if c in true:
            return True
        if isinstance(c, BoolOp) and c.op == "and":
            new = [cond(v) for v in c.values]
            if all(a is b for a, b in zip(new, c.values)):
                return c
            return conj([v for v in new if v is not True])
        return c

    def fn(node):
        if isinstance(node, Block) and any(isinstance(s, Block) for s in node.stmts):
            return _flat(node.stmts)
        if isinstance(node, Select):
            c = cond(node.cond)
            return node.if_true if c is True else replace(node, cond=c) if c is not node.cond else None
        if isinstance(node, If):
            c = cond(node.cond)
            return node.then if c is True else replace(node, cond=c) if c is not node.cond else None
        return None

    out = rewrite(body, fn)
    return out if isinstance(out, Block) else Block((out,))
