"""Nest fusion within one kernel: consecutive nests over the same ``(batch, tile)`` space run
as one, tile by tile, so a tile one nest produces is still in cache when the next consumes
it (a convolution's bias add right after the GEMM that wrote the tile).

Legal when every buffer the nests share, and one of them writes, is accessed only inside
the current batch item and tile: each access is per item (the batch index leads) and its
range along the tiled dimension stays within the tile's own rows.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from latte.compiler.ir import Block, Kernel, Loop, accesses
from latte.compiler.passes.tiling import tile_loop


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
    return replace(kernel, body=Block(tuple(out)))


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
            r = _tile_rows(x, a.var, tile.var)
            if r is None:
                return False
            rows.add(r)
    return len(rows) <= 1


def _tile_rows(x, batch: str, tile: str) -> tuple[int, int] | None:
    """``(dim, rows per tile)`` if access ``x`` touches, in tile ``t`` of a batch item, only
    rows ``[t * rows, (t + 1) * rows)`` of one dimension of its buffer (and nothing of other
    items)."""
    buf, off, loops = x.buffer, x.offset, {v: (start, stop) for v, start, stop in x.loops}
    if off is None or not buf.batched or off.coef(batch) != buf.size // buf.shape[0]:
        return None
    terms = [(c, loops[v]) for v, c in off.terms if v not in (batch, tile) and v in loops]
    terms += [(c, (0, e)) for c, e in x.block]
    if (any(v not in loops for v, _ in off.terms)
            or np.prod([stop - start for _, (start, stop) in terms]) > 1 << 22):
        return None
    if loops[tile][1] - loops[tile][0] == 1:
        return 0, 0   # one tile: the batch item is the unit
    addr = np.array([off.const])
    for c, (start, stop) in terms:
        addr = (addr[:, None] + c * np.arange(start, stop)).ravel()
    if addr.min() < 0 or addr.max() + off.coef(tile) >= buf.size:
        return None
    here = np.unravel_index(addr, buf.shape)
    there = np.unravel_index(addr + off.coef(tile), buf.shape)
    moved = [d for d in range(1, len(buf.shape)) if not np.array_equal(here[d], there[d])]
    if len(moved) != 1:
        return None
    (d,) = moved
    step = np.unique(there[d] - here[d])
    if len(step) != 1 or here[d].min() != 0 or here[d].max() >= step[0]:
        return None
    return d, int(step[0])
