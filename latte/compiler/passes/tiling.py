"""Tiling: split one spatial dimension of a neuron nest into row-plane tiles (paper 5.4.1).

The tiled dimension is the outermost ensemble dimension along which a connection reads a
sliding window (a sink loop variable and an input loop variable meet in one index: ``y`` of
a convolution or a pooling). The tile loop moves right under the batch loop, so that
``(batch, tile)`` is the unit of work that data-copy and parallelization see. The tile height
is a divisor of the extent whose working set (every buffer region one tile touches, gathered
windows included) fits the cache budget: the smallest with ``MIN_TILE`` elements per channel
(:func:`heights`), else the largest that fits.

The tile loop records the dependence along the tiled dimension in ``meta``, printed with the
IR (``LATTE_DUMP=ir``, ``latte explain``): ``tile_size``, ``scale`` (source rows advanced per
output row: the stride) and ``halo`` (source rows a tile shares with the next one). Fusion
derives the same strides from the access relations (paper figure 11).
"""

from __future__ import annotations

import math
from dataclasses import replace

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
    """The divisors of ``extent`` as tile heights to try, best first: those for which
    ``wide(height)`` holds from the smallest up, then the others from the tallest down."""
    sizes = [t for t in range(1, extent + 1) if extent % t == 0]
    return [t for t in sizes if wide(t)] + [t for t in reversed(sizes) if not wide(t)]


def tile_loops(kernel: Kernel, budget: int, forced: tuple[int, int] | None = None) -> Kernel:
    """Tile every neuron nest that reads a sliding window; ``budget`` is in bytes. The other
    nests of the kernel (a bias, an element-wise step) get the same tiles, so that
    :func:`~latte.compiler.passes.fuse.fuse_nests` can run them tile by tile together.
    ``forced = (dim, rows)`` tiles every nest along ensemble ``dim`` by ``rows`` (a fused
    group's tile height)."""
    stmts = [_tile(s, budget, forced) if is_batch_loop(s) else s for s in kernel.body.stmts]
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


def _tile(nest: Loop, budget: int, forced: tuple[int, int] | None) -> Loop:
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
    size = forced[1] if forced else next(
        (t for t in heights(lp.extent, lambda t: t * row >= MIN_TILE)
         if footprint(nest, extents, nest.var, lp.var, t) <= budget), 1)
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
        if isinstance(r, Ref):
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
