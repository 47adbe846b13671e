"""Data-copy: gather sliding windows into per-thread tile buffers (paper 5.3, figure 9).

A multiply-accumulate that reads a source through a sliding window (``x[c, y+i, x+j]``) is
no GEMM: its index mixes output and window loops. This pass copies the window into a tile
buffer ``col[window vars..., output vars...]`` (im2col) and reads that instead; dimensions
the window does not depend on (the output channel: *shared* dims) are not part of the
buffer, so a tile is gathered once for all output channels. A windowed *write* (the input
gradient) accumulates into such a buffer and is scatter-added afterwards.

The copy is kept only when the GEMM matcher then turns the nest into a GEMM; otherwise the
nest is left as it was. Tile buffers have a leading thread dimension indexed by ``_tid``.
"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.ir import (
    TID,
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    BoolOp,
    Compare,
    Const,
    Gemm,
    If,
    Kernel,
    Load,
    Loop,
    LoopKind,
    Ref,
    Select,
    Var,
    walk,
)
from latte.compiler.passes.gemm import match_nest
from latte.compiler.passes.tiling import is_batch_loop


def copy_windows(kernel: Kernel, bufs) -> Kernel:
    """Gather/scatter every windowed multiply-accumulate nest of ``kernel`` through tiles."""
    stmts = []
    for k, s in enumerate(kernel.body.stmts):
        out = _copy(s, bufs, (kernel.name, k)) if is_batch_loop(s) else None
        stmts.append(s if out is None else out)
    return replace(kernel, body=Block(tuple(stmts)))


def nest(loops: list[Loop], *body) -> Loop | Block:
    """``loops`` (outermost first) rebuilt around ``body``."""
    block = Block(tuple(body))
    for lp in reversed(loops):
        block = Block((replace(lp, body=block),))
    return block.stmts[0] if len(block.stmts) == 1 else block


def _copy(s: Loop, bufs, key: tuple):
    loops, leaf = [], s
    while isinstance(leaf, Loop):
        if len(leaf.body.stmts) != 1:
            return None
        loops.append(leaf)
        leaf = leaf.body.stmts[0]
    n_outer = 2 if len(loops) > 1 and loops[1].kind is LoopKind.TILE_OUTER else 1
    outer, inner = loops[:n_outer], loops[n_outer:]
    window = {lp.var for lp in inner if lp.axis is None}
    sink = {lp.var for lp in inner if lp.axis is not None}

    def windowed(ref: Ref) -> bool:
        """A window over the sink's positions (a component mixes window and sink variables),
        or a strided read of a batched input's positions (a 1x1 convolution of stride 2):
        either way no GEMM operand as it stands, a contiguous one once gathered."""
        index = [c for c in ref.index if isinstance(c, Affine)]
        if any(c.vars & window and c.vars & sink for c in index):
            return True
        return ref.buffer.batched and any(c.vars & window for c in index) and any(
            abs(c.coef(v)) != 1 for c in index for v in c.vars & sink)

    def tile_buffer(expr, tag: str):
        used = variables(expr)
        order = ([lp for lp in inner if lp.var in used and lp.var in window]
                 + [lp for lp in inner if lp.var in used and lp.var not in window])
        shape = tuple(lp.extent for lp in order)
        buf = bufs.scratch((*key, tag), f"{key[0]}.{tag}{key[1]}", shape)
        ref = Ref(buf, (Affine.of(TID), *(Affine.of(lp.var) for lp in order)), buf.shape)
        return order, buf, ref

    guard, aug = None, leaf
    if isinstance(leaf, If) and not leaf.orelse.stmts and len(leaf.then.stmts) == 1:
        guard, aug = leaf.cond, leaf.then.stmts[0]
    if not (isinstance(aug, AugAssign) and aug.op == "+" and isinstance(aug.target, Ref)):
        return None
    if windowed(aug.target):   # scatter: accumulate into a tile, then add it to the window
        order, buf, ref = tile_buffer(Block((aug.target, *((guard,) if guard else ()))), "scatter")
        compute = match_nest(nest(inner, AugAssign(ref, "+", aug.value)))
        if not _is_gemm(compute):
            return None
        if isinstance(compute, Gemm) and compute.m * compute.n * bufs.threads == buf.size:
            compute = replace(compute, beta=0.0)
        else:
            compute = Block((nest(order, Assign(ref, Const(0.0))), compute))
        scatter = AugAssign(aug.target, "+", Load(ref))
        return nest(outer, compute, _split_guard(order, guard, lambda cond: (
            scatter if cond is True else None if cond is False else If(cond, Block((scatter,)))),
            outer + inner))
    if guard is not None or not isinstance(aug.value, BinOp) or aug.value.op != "*":
        return None
    operands = [aug.value.lhs, aug.value.rhs]
    hits = [i for i, e in enumerate(operands) if _window_load(e, windowed)]
    if len(hits) != 1:
        return None
    (i,) = hits
    order, buf, ref = tile_buffer(operands[i], "gather")
    operands[i] = Load(ref)
    compute = match_nest(nest(inner, replace(aug, value=BinOp("*", *operands))))
    if not _is_gemm(compute):
        return None
    value = aug.value.lhs if i == 0 else aug.value.rhs
    return nest(outer, gather(order, ref, value, outer + inner), compute)


def gather(order: list[Loop], ref: Ref, value, loops: list[Loop]):
    """The nest ``order`` storing ``value`` (a window load, possibly behind a padding guard)
    into the tile ``ref``. The tile must hold what ``value`` reads at every point: where the
    guard fails, that is the ``Select``'s other branch (the connection's padding value,
    which need not be zero)."""
    if not isinstance(value, Select):
        return _split_guard(order, None, lambda cond: Assign(ref, value), loops)
    load, pad = value.if_true, value.if_false
    return _split_guard(order, value.cond, lambda cond: Assign(ref, (
        load if cond is True else pad if cond is False else Select(cond, load, pad))), loops)


def _split_guard(order: list[Loop], guard, make, loops: list[Loop]):
    """The nest ``order`` around ``make(cond)``, a statement that runs under a padding ``guard``
    (``make(True)``: unguarded; ``make(False)``: the guard fails, ``None`` for no statement).
    The interior runs without tests: the guard's terms that do not depend on the innermost
    loop wrap that loop, and the loop is split where its own terms hold for every value of
    the other variables (``loops``: every loop whose variable the guard may use)."""
    if guard is None:
        return nest(order, make(True))
    *mine, inner = order
    ranges = {lp.var: (lp.start, lp.stop - 1) for lp in loops}
    terms = list(guard.values) if isinstance(guard, BoolOp) and guard.op == "and" else [guard]
    hoisted = [t for t in terms if inner.var not in variables(t)]
    own = [t for t in terms if t not in hoisted]
    lo, hi, rest = inner.start, inner.stop, []
    for t in own:
        bound = interior(t, inner.var, ranges)
        if bound is None:
            rest.append(t)
        else:
            lo, hi = max(lo, bound[0]), min(hi, bound[1])
    pieces = ([(inner.start, lo, conj(own)), (lo, hi, conj(rest)), (hi, inner.stop, conj(own))]
              if lo < hi else [(inner.start, inner.stop, conj(own))])
    body = tuple(replace(inner, start=a, stop=b, body=Block((make(c),)))
                 for a, b, c in pieces if a < b)
    stmt = body[0] if len(body) == 1 else Block(body)
    if hoisted:
        off = make(False)
        stmt = If(conj(hoisted), Block((stmt,)),
                  Block((replace(inner, body=Block((off,))),) if off is not None else ()))
    return nest(mine, stmt) if mine else stmt


def variables(e) -> set[str]:
    """The loop variables and locals ``e`` reads."""
    return {v for n in walk(e) if isinstance(n, Affine) for v in n.vars} | {
        n.name for n in walk(e) if isinstance(n, Var)}


def conj(terms: list):
    """The conjunction of ``terms`` (``True`` for none)."""
    return True if not terms else terms[0] if len(terms) == 1 else BoolOp("and", tuple(terms))


def interior(term, var: str, ranges: dict) -> tuple[int, int] | None:
    """The range ``[lo, hi)`` of ``var`` on which ``term`` (``affine >= c`` or ``affine < c``)
    holds for every value of the other variables in ``ranges``; None if not of that form."""
    if not (isinstance(term, Compare) and term.op in (">=", "<") and isinstance(term.lhs, Affine)
            and isinstance(term.rhs, Const) and isinstance(term.rhs.value, int)):
        return None
    k = term.lhs.coef(var)
    rest = term.lhs.substitute(var, Affine())
    if k == 0 or not rest.vars <= ranges.keys():
        return None
    low, high = rest.bounds(ranges)
    c = term.rhs.value
    big = 1 << 40
    if term.op == ">=":   # k*var + rest >= c for every rest
        return (-((low - c) // k), big) if k > 0 else (-big, (c - low) // k + 1)
    # k*var + rest < c for every rest: k*var <= c - 1 - high
    return (-big, (c - 1 - high) // k + 1) if k > 0 else (-((high - c + 1) // k), big)


def _window_load(e, windowed) -> bool:
    """``e`` loads through a window, possibly behind a padding guard."""
    if isinstance(e, Select) and isinstance(e.if_true, Load):
        e = e.if_true
    return isinstance(e, Load) and isinstance(e.ref, Ref) and windowed(e.ref)


def _is_gemm(s) -> bool:
    found = [n for n in walk(s) if isinstance(n, Gemm)]
    return bool(found) and not any(isinstance(n, (Assign, AugAssign)) for n in walk(s))

