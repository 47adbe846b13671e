"""Tiling: split one spatial dimension of a neuron nest into row-plane tiles (paper 5.4.1).

The tiled dimension is the outermost ensemble dimension along which a connection reads a
sliding window (a sink loop variable and an input loop variable meet in one index: ``y`` of
a convolution or a pooling). The tile loop moves right under the batch loop, so that
``(batch, tile)`` is the unit of work that data-copy and parallelization see. The tile height
is a divisor of the extent with at least ``MIN_TILE`` elements per channel (:func:`heights`;
the whole extent where none has): the smallest whose working set (every buffer region one
tile touches, gathered windows included, but not what every tile reads alike, the weights)
fits the cache budget, else the smallest; unless another shares the batch's tiles out more
evenly among the threads (:func:`busiest`: a VGG-16 layer of 56 rows at batch 1, in 7 tiles
of 8 rows, kept one of two threads idle for a quarter of the loop; 8 tiles of 7 do not).

The tile loop records the dependence along the tiled dimension in ``meta``, printed with the
IR (``LATTE_DUMP=ir``, ``latte explain``): ``tile_size``, ``scale`` (source rows advanced per
output row: the stride) and ``halo`` (source rows a tile shares with the next one). Fusion
derives the same strides from the access relations (paper figure 11).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np

from latte.compiler.ir import (
    Affine,
    BinOp,
    Block,
    Kernel,
    Load,
    Loop,
    LoopKind,
    Ref,
    Select,
    substitute,
    walk,
)

FLOAT_BYTES = 4
# elements per channel from which a tile is wide enough: OpenBLAS's sgemm over a tile of a
# 224-wide VGG layer runs best at two rows (timing numpy's float32 (64x27) @ (27xN) on one
# OpenBLAS thread here: 164 GFLOP/s at N = 448, 125 at N = 1792), and taller tiles only
# grow the working set
MIN_TILE = 256


def heights(extent: int, wide) -> list[int]:
    """The tile heights to try, best first: the divisors of ``extent`` for which
    ``wide(height)`` holds, even ones first (Winograd's 2x2 output tiles then never straddle
    two row tiles), each from the smallest up; none wide, the whole extent alone (a GEMM
    over a narrower tile runs below speed, and its weights are streamed once per tile)."""
    fits = [t for t in range(1, extent + 1) if extent % t == 0 and wide(t)]
    return sorted(fits, key=lambda t: t % 2) or [extent]


def tile_loops(kernel: Kernel, budget: int, forced: tuple[int, int] | None = None,
               threads: int = 1) -> Kernel:
    """Tile every neuron nest that reads a sliding window; ``budget`` is in bytes, and the
    tiles are shared among ``threads`` threads (:func:`balanced`). The other
    nests of the kernel (a bias, an element-wise step) get the same tiles, so that
    :func:`~latte.compiler.passes.fuse.fuse_nests` can run them tile by tile together.
    ``forced = (dim, rows)`` tiles every nest along ensemble ``dim`` by ``rows`` (a fused
    group's tile height)."""
    stmts = [_tile(s, budget, forced, threads) if is_batch_loop(s) else s
             for s in kernel.body.stmts]
    tiles = [t for s in stmts if (t := tile_loop(s)) is not None]
    if tiles or forced:
        dim, size = forced or (tiles[0].axis.dim, dict(tiles[0].meta)["tile_size"])
        for i, s in enumerate(stmts):
            if is_batch_loop(s) and tile_loop(s) is None:
                lp = next((c for c in ensemble_chain(s)[1:] if c.axis.dim == dim), None)
                if lp is not None and lp.start == 0 and lp.extent % size == 0 and not strip_mined(lp):
                    stmts[i] = _split(s, lp, size, (("tile_size", size), ("scale", 1), ("halo", 0)))
    return replace(kernel, body=Block(tuple(stmts)))


def tile_loop(s) -> Loop | None:
    """The tile loop right under batch loop ``s``, if ``s`` is a tiled neuron nest."""
    if not is_batch_loop(s) or len(s.body.stmts) != 1:
        return None
    inner = s.body.stmts[0]
    return inner if isinstance(inner, Loop) and inner.kind is LoopKind.TILE_OUTER else None


def is_batch_loop(s) -> bool:
    return isinstance(s, Loop) and s.axis is not None and s.axis.dim < 0


def strip_mined(lp: Loop) -> bool:
    """``lp`` is half of an ensemble dimension synthesis strip-mined (``d = q*d_g + d_i``): its
    iterations are not the dimension's rows, so tiles of it are not row tiles."""
    return any(key == "strip" for key, _ in lp.meta)


def ensemble_chain(nest: Loop) -> list[Loop]:
    """The batch loop and the ensemble-dimension loops nested in it (a perfect chain)."""
    chain = [nest]
    while (len(chain[-1].body.stmts) == 1 and isinstance(chain[-1].body.stmts[0], Loop)
           and chain[-1].body.stmts[0].axis is not None):
        chain.append(chain[-1].body.stmts[0])
    return chain


def window_vars(nest) -> set[str]:
    """Loop variables of the neuron body (they walk an input window), not of the ensemble."""
    return {n.var for n in walk(nest) if isinstance(n, Loop) and n.axis is None}


def windowed_components(nest, sink: str) -> list[Affine]:
    """Index components in which ``sink`` meets a window variable."""
    window = window_vars(nest)
    return [c for r in walk(nest) if isinstance(r, Ref) for c in r.index
            if isinstance(c, Affine) and c.coef(sink) and c.vars & window]


def busiest(batch: int, extent: int, rows: int, threads: int) -> int:
    """Rows the busiest of ``threads`` threads computes when every item of ``batch`` is cut
    into tiles of ``rows`` of its ``extent`` rows and the (item, tile) pairs are shared out
    whole (a tile loop collapsed with the batch loop)."""
    return -(-batch * (extent // rows) // threads) * rows


def balanced(first: int | None, order: list[int], fits, busy, usable=lambda t: True) -> int | None:
    """The tile height to take: ``first`` (what the cache alone picks), unless a ``usable``
    one of ``order`` (best first) leaves the busiest thread fewer rows (``busy(height)``); of
    those, the fewest such rows, then one that ``fits`` the cache, then the smallest."""
    if first is None:
        return None
    better = [t for t in order if busy(t) < busy(first) and usable(t)]
    return min(better, default=first, key=lambda t: (busy(t), not fits(t), 0 if fits(t) else t,
                                                     order.index(t)))


def _tile(nest: Loop, budget: int, forced: tuple[int, int] | None, threads: int) -> Loop:
    chain = ensemble_chain(nest)
    for lp in chain[1:]:
        comps = windowed_components(nest, lp.var)
        if (comps and lp.extent > 1 and lp.start == 0 and not strip_mined(lp)
                and (forced is None or lp.axis.dim == forced[0])):
            break
    else:
        return nest
    extents = {n.var: n.extent for n in walk(nest) if isinstance(n, Loop)}
    row = math.prod(c.extent for c in chain[chain.index(lp) + 1:])
    order = heights(lp.extent, lambda t: t * row >= MIN_TILE)
    if forced:
        size = forced[1]
    else:
        fits = functools.cache(lambda t: footprint(nest, extents, nest.var, lp.var, t) <= budget)
        size = balanced(next((t for t in order if fits(t)), order[0]), order, fits,
                        lambda t: busiest(nest.extent, lp.extent, t, threads))
    scale = abs(comps[0].coef(lp.var))
    reach = sum(abs(c) * (extents[v] - 1) for v, c in comps[0].terms if v != lp.var)
    return _split(nest, lp, size, (("tile_size", size), ("scale", scale), ("halo", reach + 1 - scale)))


def _split(nest: Loop, lp: Loop, size: int, meta: tuple) -> Loop:
    """``lp`` (an ensemble loop of ``nest``) split into tiles of ``size``; the tile loop goes
    right under the batch loop."""
    chain = ensemble_chain(nest)
    tvar = f"{lp.var}_t"
    inner = replace(lp, stop=size, kind=LoopKind.TILE_INNER)
    # rebuild: batch, tile, then the ensemble loops with ``lp`` shrunk to one tile
    body = substitute(chain[-1].body, {lp.var: Affine.build({tvar: size, lp.var: 1})})
    for c in reversed(chain[1:]):
        body = Block((replace(inner if c is lp else c, body=body),))
    tile = Loop(tvar, 0, lp.extent // size, body, LoopKind.TILE_OUTER, lp.axis, meta)
    return replace(nest, body=Block((tile,)))


def footprint(nest: Loop, extents: dict[str, int], batch: str, tiled: str, size: int) -> int:
    """Bytes one ``(batch item, tile of `size` rows)`` of ``nest`` touches."""
    return sum(tile_boxes(nest, extents, batch, tiled, size).values()) * FLOAT_BYTES


def tile_boxes(nest: Loop, extents: dict[str, int], batch: str, tiled: str, size: int) -> dict:
    """Elements one tile touches per buffer (the largest box its refs span), and per window
    a multiply-accumulate will gather, its tile buffer (keyed by the load)."""
    ext = dict(extents, **{batch: 1, tiled: size})
    window = window_vars(nest)
    boxes: dict = {}
    for r in walk(nest):
        if isinstance(r, Ref) and any(isinstance(c, Affine) and c.coef(tiled) for c in r.index):
            vol = 1
            for c, extent in zip(r.index, r.view):
                if isinstance(c, Affine):
                    vol *= min(extent, 1 + sum(abs(k) * (ext[v] - 1) for v, k in c.terms if v in ext))
                else:
                    vol *= extent
            boxes[r.buffer] = max(boxes.get(r.buffer, 0), vol)
    for op in walk(nest):
        if isinstance(op, BinOp) and op.op == "*":
            for e in (op.lhs, op.rhs):
                e = e.if_true if isinstance(e, Select) else e
                if isinstance(e, Load) and isinstance(e.ref, Ref) and any(
                        isinstance(c, Affine) and c.vars & window and c.vars - window - {batch}
                        for c in e.ref.index):
                    used = {v for c in e.ref.index if isinstance(c, Affine) for v in c.vars} - {batch}
                    boxes[e] = math.prod(ext.get(v, 1) for v in used)
    return boxes


@functools.lru_cache(maxsize=4096)
def tile_rows(x, batch: str, tile: str) -> tuple[int, int] | None:
    """``(dim, rows per tile)`` if access ``x`` touches, in tile ``t`` of a batch item, only
    rows of ``[t * rows, (t + 1) * rows)`` of one dimension of its buffer (and nothing of
    other items)."""
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
    step = there[d] - here[d]
    lo, hi = int(step.min()), int(step.max())
    if lo != hi or here[d].min() < 0 or here[d].max() >= lo:
        return None
    return d, lo
