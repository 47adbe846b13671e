"""Nest fusion within one kernel: consecutive nests over the same ``(batch, tile)`` space run
as one, tile by tile, so a tile one nest produces is still in cache when the next consumes
it (a convolution's bias add right after the GEMM that wrote the tile).

Legal when every buffer the nests share, and one of them writes, is accessed only inside
the current batch item and tile: each access is per item (the batch index leads) and its
range along the tiled dimension stays within the tile's own rows.
"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.ir import Block, Kernel, Loop, accesses
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
            r = tile_rows(x, a.var, tile.var)
            if r is None:
                return False
            rows.add(r)
    return len(rows) <= 1
