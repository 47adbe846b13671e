"""Nest fusion within one kernel: consecutive nests over the same ``(batch, tile)`` space run
as one, tile by tile, so a tile one nest produces is still in cache when the next consumes
it (a convolution's bias add right after the GEMM that wrote the tile).

Legal when every buffer the nests share, and one of them writes, is accessed only inside
the current batch item and tile: each access is per item (the batch index leads) and its
range along the tiled dimension stays within the tile's own rows.

Inside a tile, consecutive point-wise nests (a batch norm, a residual add, a ReLU) over the
same loops then merge into one nest, one pass over the tile instead of one per nest. Legal
when every buffer both nests access, and one writes, is accessed at one element per
iteration, the same in both: an index that is one-to-one on the loops' points, so an
iteration of the merged nest touches no element another iteration touches.
"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.ir import Block, Gemm, If, Kernel, Loop, LoopKind, accesses, walk
from latte.compiler.passes.tiling import tile_loop, tile_rows


def fuse_nests(kernel: Kernel) -> Kernel:
    """Merge consecutive tiled nests with the same batch and tile loops."""
    out: list = []
    for s in kernel.body.stmts:
        prev = out[-1] if out else None
        if prev is not None and _same_space(prev, s) and _legal(prev, s):
            tile = prev.body.stmts[0]
            merged = replace(tile, body=Block(tile.body.stmts + s.body.stmts[0].body.stmts))
            out[-1] = replace(prev, body=Block((merged,)))
        else:
            out.append(s)
    for i, s in enumerate(out):
        if (tile := tile_loop(s)) is not None:
            tile = replace(tile, body=Block(merge_pointwise(tile.body.stmts)))
            out[i] = replace(s, body=Block((tile,)))
    return replace(kernel, body=Block(tuple(out)))


def merge_pointwise(stmts: tuple) -> tuple:
    """``stmts`` with each run of consecutive point-wise nests over the same loops merged
    into one nest (see the module's docstring), in the arms of an ``if`` too (a skewed
    group's members run under tests on the tile)."""
    out: list = []   # (statement, its loops)
    for s in stmts:
        if isinstance(s, If):
            s = replace(s, then=Block(merge_pointwise(s.then.stmts)),
                        orelse=Block(merge_pointwise(s.orelse.stmts)))
        loops = _perfect(s)
        if out and loops is not None and out[-1][1] == loops and _pointwise(out[-1][0], s, loops):
            out[-1] = (_join(out[-1][0], s), loops)
        else:
            out.append((s, loops))
    return tuple(s for s, _ in out)


def _perfect(s) -> tuple | None:
    """The ``(var, start, stop, kind)`` of each loop of perfect serial nest ``s`` whose
    innermost body holds no loop and no GEMM, else None."""
    heads = []
    while isinstance(s, Loop) and s.kind in (LoopKind.SERIAL, LoopKind.TILE_INNER):
        heads.append((s.var, s.start, s.stop, s.kind))
        inner = s.body.stmts
        if len(inner) == 1 and isinstance(inner[0], Loop):
            s = inner[0]
            continue
        if any(isinstance(n, (Loop, Gemm)) for st in inner for n in walk(st)):
            return None
        return tuple(heads)
    return None


def _pointwise(a: Loop, b: Loop, loops: tuple) -> bool:
    """May nests ``a`` and ``b``, both over ``loops``, run as one (the module's docstring)?"""
    in_a, in_b = accesses(a), accesses(b)
    written = {x.buffer for x in in_a + in_b if x.written}
    shared = written & {x.buffer for x in in_a} & {x.buffer for x in in_b}
    offsets = {x.offset for x in in_a + in_b if x.buffer in shared}
    if not offsets:
        return True
    if len(offsets) != 1 or None in offsets:
        return False
    (offset,) = offsets
    return _one_to_one(offset, loops)


def _one_to_one(offset, loops: tuple) -> bool:
    """Whether distinct points of ``loops`` give ``offset`` distinct values: each variable's
    coefficient, smallest first, exceeds the span of those below it."""
    coeffs = offset.coeffs
    terms = []
    for var, start, stop, _ in loops:
        if stop - start > 1:
            if not coeffs.get(var):
                return False
            terms.append((abs(coeffs[var]), stop - start))
    span = 0
    for coef, extent in sorted(terms):
        if coef <= span:
            return False
        span += coef * (extent - 1)
    return True


def _join(a: Loop, b: Loop) -> Loop:
    """Nest ``a`` with ``b``'s innermost statements after its own (the loops are the same)."""
    if len(a.body.stmts) == 1 and isinstance(a.body.stmts[0], Loop):
        return replace(a, body=Block((_join(a.body.stmts[0], b.body.stmts[0]),)))
    return replace(a, body=Block(a.body.stmts + b.body.stmts))


def _same_space(a, b) -> bool:
    ta, tb = tile_loop(a), tile_loop(b)
    return (ta is not None and tb is not None and (a.var, a.extent) == (b.var, b.extent)
            and (ta.var, ta.extent) == (tb.var, tb.extent))


def _legal(a: Loop, b: Loop) -> bool:
    tile = tile_loop(a)
    in_a, in_b = accesses(a), accesses(b)
    written = {x.buffer for x in in_a + in_b if x.written}
    shared = written & {x.buffer for x in in_a} & {x.buffer for x in in_b}
    rows = set()
    for x in in_a + in_b:
        if x.buffer in shared:
            r = tile_rows(x, a.var, tile.var)
            if r is None:
                return False
            rows.add(r)
    return len(rows) <= 1
