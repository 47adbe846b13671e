"""Winograd convolution F(2x2, 3x3) and F(4x4, 3x3) (Lavin and Gray, CVPR 2016): a 3x3
stride-1 sliding-window multiply-accumulate, found on the loop nest as the GEMM match finds
its pattern, computed as 16 GEMMs over transformed 4x4 tiles (2.25x fewer multiplications
than the direct sum) or 36 over 6x6 tiles (4x fewer).

The pattern, on a (tiled) neuron nest ``batch -> [row tile] -> o -> y -> x -> window loops``:
``out[.., o, y, x] += w(o, c, ky, kx) * src[.., c, y + ky + a, x + kx + b]`` (the source load
possibly behind a padding guard), where ``ky`` and ``kx`` run over 3 values, the weight's
index depends on ``o`` and the window variables alone, the source channel on ``c`` alone,
and the source row (column) advances by one with both ``y`` and ``ky`` (``x`` and ``kx``):
stride 1, no dilation. Nothing looks at layer types or names.

The rewrite, for F(r x r, 3x3) and ``e`` the positions of an (r + 2) x (r + 2) transformed
tile (16 or 36):

- ``U[e, o, c] = (G w G^T)[e]``, before the batch loop (the weights change between runs);
- per (batch item, row tile): the source rows the tile reads copied to a padded tile ``P``
  (through the original guard and padding value, bounds-guarded where a partial tile
  reaches past the source; the guards split off the interior as in data-copy), then
  ``V[e, c, p] = (B^T d B)[e]`` for the patch ``d`` of ``P`` under each r x r output tile
  ``p``;
- ``M[e] = U[e] @ V[e]``: a GEMM per ``e``, output channels x tiles, over the input
  channels (the planes of ``U``, ``V`` and ``M`` lie an odd number of cache lines apart:
  planes a power of two apart put the values a transform reads or writes in one cache set);
- ``out[.., o, r ty + i, r tx + j] += (A^T M A)[i, j]``, guarded where a tile is partial
  (zero-init folding turns the ``+=`` of a tile into stores where they cover the output).

The forward's transforms are computed a factor at a time (``d B``, then ``B^T`` times that:
the 6x6 input transform adds 288 terms, not 484), and ``P`` keeps each row's columns by phase
(column ``r t + j`` at ``[j, t]``), so that a patch's columns lie at consecutive places for
consecutive tiles and the transforms vectorize over tiles with plain vector loads.

F(4x4, 3x3) takes a convolution whose row tile holds ``WIDE_TILES`` 4x4 tiles and whose
products do ``WIDE_WORK`` multiply-adds (36 narrower products: where they are too small, as
64 channels over 28 tiles, the calls and transforms cost more than the multiplications
saved), or whose batch holds ``ITEM_TILES`` 4x4 tiles of such products (a 14x14 or 7x7
layer in training: the weight transform, larger than F(2x2, 3x3)'s, is paid once per run
over the whole batch; one image of 14x14 keeps F(2x2, 3x3)); the others F(2x2, 3x3).

An item with too few tiles for a product of its own (a deep layer's 8x8 or 7x7 image, in
one row tile) shares its products with the next items of the batch: the batch loop runs
over blocks of ``items`` items, each item's tiles transformed into its own columns of ``V``,
then the 16 products over all of them, then each item's outputs (``M[e]`` is output
channels x the block's tiles). The products are as wide as a larger image's, and the
transformed weights, read once per product, are read once per block. Where they outweigh
the batch's transformed tiles and half the last-level cache (a 7x7, 512-channel layer in
training: 38 MB in 36 planes), each block would stream them from memory again: the products
are then spread instead (:func:`_spread`): a batch loop transforms every item's tiles into
``V`` of the whole batch, each plane's product takes all of them (the threads share the
planes), and a batch loop transforms ``M`` back into each item's outputs.

A convolution's weight gradient, ``w(o, c, ky, kx) += src[.., c, y + ky + a, x + kx + b] *
g[.., o, y, x]``, is F(3x3, 2x2) the same way (:func:`match_weight_grad`): per item (and row
tile) the source tiles transformed as above, each 2x2 tile of the output gradient by ``G2``,
and ``M[e] += D[e] @ V[e]^T`` (output x input channels over the tiles, in each thread's own
``M``); after the batch loop the threads' ``M`` are summed in thread order and transformed
back by ``A3`` into the 3x3 weights: 16 products over 4 pixels' worth of tiles instead of 9
over the pixels, and ``M`` is transformed once per pass, not per item. Where the threads'
copies of ``M`` outweigh the batch's ``D`` and ``V`` and half the last-level cache, it is
spread too: one ``M[e] = D[e] @ V[e]^T`` per plane over the whole batch replaces the copies,
their zeroing, their updates block by block and their sum.

It is used where it pays (:func:`match`: enough channels and tiles), at opt level 2 and up;
``LATTE_WINOGRAD=0`` turns it off (im2col + GEMM, as for every other window),
``LATTE_WINOGRAD=2`` keeps it to F(2x2, 3x3), ``LATTE_WINOGRAD=4`` takes F(4x4, 3x3)
wherever it takes F(2x2, 3x3) (for tests).

In exact arithmetic this is the direct sum; in float32 the transforms (sums of a few terms
with weights from 1/24 to 8) add rounding of the order of the terms summed, well within
1e-4 of the output's scale for weights and inputs of like magnitude (the tests and the random
tester check both schemes against opt level 0).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

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
    Expr,
    Gemm,
    If,
    Kernel,
    Load,
    Loop,
    LoopKind,
    NameGen,
    Ref,
    Select,
    Var,
    substitute,
    walk,
)
from latte.compiler.passes.data_copy import conj, gather, nest, variables
from latte.compiler.passes.tiling import ensemble_chain, is_batch_loop


@dataclass(frozen=True)
class Scheme:
    """F(out x out, 3x3): its input (``BT``: B^T), weight (``G``) and output (``AT``: A^T)
    transforms, over tiles of ``size = out + 2``."""

    out: int
    BT: tuple
    G: tuple
    AT: tuple

    @property
    def size(self) -> int:
        return self.out + 2

    @property
    def planes(self) -> int:
        """Positions of a transformed tile: the products per pass."""
        return self.size * self.size


F2 = Scheme(2, BT=((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)),
            G=((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1)),
            AT=((1, 1, 1, 0), (0, 1, -1, -1)))
# F(4x4, 3x3) over the points 0, 1, -1, 2, -2 and infinity (Lavin and Gray's matrices)
F4 = Scheme(4, BT=((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0),
                   (0, -2, -1, 2, 1, 0), (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1)),
            G=((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6),
               (1 / 24, 1 / 12, 1 / 6), (1 / 24, -1 / 12, 1 / 6), (0, 0, 1)),
            AT=((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0),
                (0, 1, -1, 8, -8, 1)))
G2 = ((1, 0), (0.5, 0.5), (0.5, -0.5), (0, -1))      # F(3x3, 2x2), with B^T: a 2x2 gradient tile
AT3 = ((1, 1, 1, 0), (0, 1, -1, 0), (0, 1, 1, 1))    # and its output transform
TILES = F2.planes   # positions of F(3x3, 2x2)'s transformed 4x4 tile
MIN_CHANNELS = 8    # input channels from which Winograd beats im2col + GEMM (measured here:
MIN_TILES = 32      # 3 channels lose, 8 win; 7x7 outputs, 16 tiles, lose at 512 channels)
ITEM_TILES = 64     # tiles a product of several items' tiles takes
WIDE_TILES = 24     # F(4x4, 3x3): 4x4 tiles an item's row tile needs and multiply-adds
WIDE_WORK = 2**17   # per product (measured here: VGG-16 and ResNet-18's 128 channels over
                    # 28 tiles win, 64 channels over 28 tiles and 512 over 16 lose)
#: Spread the products of every block of items over the threads (the random tester sets
#: it: its nets are too small to pay for it otherwise)
SPREAD_EVERY = False


@dataclass(frozen=True)
class Conv:
    """A matched 3x3 stride-1 multiply-accumulate nest."""

    nest: Loop              # the batch loop
    tile: Loop | None       # the row-tile loop under it
    o: Loop
    y: Loop
    x: Loop
    c: Loop
    ky: str
    kx: str
    target: Ref
    weight: Ref
    source: Ref
    guard: Expr | None      # the source load's padding guard
    pad: Expr               # what the source reads where the guard fails
    items: int = 1          # batch items whose tiles one product takes
    scheme: Scheme = F2     # F(2x2, 3x3) or F(4x4, 3x3)

    @property
    def tiles(self) -> tuple[int, int]:
        """Output tiles down and across one row tile."""
        r = self.scheme.out
        return -(-self.y.extent // r), -(-self.x.extent // r)


def winograd(kernel: Kernel, bufs, llc: int) -> Kernel:
    """Every matching nest of ``kernel`` computed by Winograd (in backward: an input gradient
    computed as a gather, :mod:`~latte.compiler.passes.gather_grads`); ``llc``: the bytes of
    the last-level cache a core sees."""
    setting = os.environ.get("LATTE_WINOGRAD")
    if setting == "0":
        return kernel
    stmts = []
    for k, s in enumerate(kernel.body.stmts):
        conv = match(s, {"2": "never", "4": "always"}.get(setting, "where it pays")) \
            if is_batch_loop(s) else None
        grads = match_weight_grad(s) if is_batch_loop(s) and conv is None else None
        if conv is not None:
            stmts += _rewrite(conv, bufs, (kernel.name, k), llc)
        elif grads is not None:
            stmts += _rewrite_weight_grad(grads, bufs, (kernel.name, k), llc)
        else:
            stmts.append(s)
    return replace(kernel, body=Block(tuple(stmts)))


def takes(nest: Loop) -> bool:
    """Whether :func:`winograd` computes the (tiled or untiled) nest ``nest`` by Winograd: its
    row tiles are then best a multiple of its output tiles' height, whatever the threads."""
    return os.environ.get("LATTE_WINOGRAD") != "0" and match(nest) is not None


def match(nest: Loop, wide: str = "where it pays") -> Conv | None:
    """``nest`` as a :class:`Conv`, if it is one and Winograd pays for it: at least
    ``MIN_CHANNELS`` input channels (the GEMMs' depth) and ``MIN_TILES`` output tiles per
    product (their width; the weight transform is paid once per run, not per tile). An item
    with fewer tiles (a small image, one row tile) shares its products with the next items:
    the fewest that divide the batch and give ``ITEM_TILES`` tiles. F(4x4, 3x3) (``wide``
    "where it pays") where an item's row tile has ``WIDE_TILES`` 4x4 tiles and a product
    ``WIDE_WORK`` multiply-adds: 36 products over a quarter of the tiles, 1.78x fewer
    multiplications than F(2x2, 3x3); and, with F(2x2, 3x3)'s items, where each item is one
    row tile and the batch holds ``ITEM_TILES`` 4x4 tiles (a deep layer's small images in
    training: its weights, transformed into 36 planes instead of 16, once per run over all
    of them); "always": wherever F(2x2, 3x3) would be, its items shared alike
    (``LATTE_WINOGRAD=4``: the tests' and the random tester's); "never"."""
    conv = _match(nest)
    if conv is None or conv.c.extent < MIN_CHANNELS:
        return None
    four = replace(conv, scheme=F4)
    tiles = math.prod(four.tiles)
    worth = conv.o.extent * conv.c.extent * tiles >= WIDE_WORK
    if wide == "where it pays" and tiles >= WIDE_TILES and worth:
        return four
    conv = conv if math.prod(conv.tiles) >= MIN_TILES else _shared(conv, MIN_TILES)
    if conv is None or wide == "never":
        return conv
    whole = conv.tile is None or conv.tile.extent == 1   # an item in one row tile
    batched = worth and whole and conv.nest.extent * tiles >= ITEM_TILES
    return replace(conv, scheme=F4) if wide == "always" or batched else conv


def match_weight_grad(nest: Loop) -> Conv | None:
    """``nest`` as the weight gradient of a 3x3 stride-1 window, ``w(o, c, ky, kx) +=
    src[.., c, y + ky + a, x + kx + b] * g[.., o, y, x]`` (``target``: the weight gradient,
    ``weight``: the output gradient's load), where F(3x3, 2x2) pays: ``MIN_CHANNELS`` input
    channels and ``ITEM_TILES`` tiles a product (the sums' depth) in a row tile, or in the
    one row tile of enough items."""
    conv = _match(nest, weight_grad=True)
    if conv is None or conv.c.extent < MIN_CHANNELS:
        return None
    return _shared(conv, ITEM_TILES)


def _shared(conv: Conv, least: int) -> Conv | None:
    """``conv`` with ``items``: one if a row tile has ``ITEM_TILES`` tiles, else the fewest
    items that divide the batch and have as many together, else the whole batch if it has
    ``least``; None where a nest of several row tiles, or the batch, has too few tiles."""
    tiles, batch = math.prod(conv.tiles), conv.nest.extent
    if tiles >= ITEM_TILES:
        return conv
    if (conv.tile is not None and conv.tile.extent > 1) or conv.nest.start:
        return None
    items = next((d for d in range(2, batch + 1) if batch % d == 0 and d * tiles >= ITEM_TILES),
                 batch if batch * tiles >= least else None)
    return None if items is None else replace(conv, items=items)


def _window_nest(nest: Loop):
    """``(row tile, o, y, x, window loops, leaf)`` of a nest ``batch -> [row tile] -> o -> y ->
    x -> 3 window loops -> leaf += a * b``, or None."""
    chain = ensemble_chain(nest)
    tiles = [lp for lp in chain[1:] if lp.kind is LoopKind.TILE_OUTER]
    dims = [lp for lp in chain[1:] if lp.kind is not LoopKind.TILE_OUTER]
    if len(dims) != 3 or [lp.axis.dim for lp in dims] != [0, 1, 2] or len(tiles) > 1 or (
            tiles and tiles[0].axis.dim != 1):
        return None
    window, leaf = [], chain[-1].body
    while len(leaf.stmts) == 1 and isinstance(leaf.stmts[0], Loop) and leaf.stmts[0].axis is None:
        window.append(leaf.stmts[0])
        leaf = leaf.stmts[0].body
    if len(leaf.stmts) != 1 or len(window) != 3 or any(lp.start for lp in [*dims, *window]):
        return None
    aug = leaf.stmts[0]
    if not (isinstance(aug, AugAssign) and aug.op == "+" and isinstance(aug.target, Ref)
            and isinstance(aug.value, BinOp) and aug.value.op == "*"):
        return None
    return (tiles[0] if tiles else None, *dims, window, aug)


def _source_load(s_expr: Expr, o: Loop, y: Loop, x: Loop, tile: Loop | None, window: list):
    """``(guard, pad, load, (c loop, ky, kx))`` if ``s_expr`` reads the source's window."""
    guard, pad, load = None, Const(0.0), s_expr
    if isinstance(s_expr, Select):
        guard, pad, load = s_expr.cond, s_expr.if_false, s_expr.if_true
    if not isinstance(load, Load) or variables(pad) or (
            guard is not None and not variables(guard) <= variables(load.ref)):
        return None
    roles = _roles(load.ref, o.var, y.var, x.var, tile, window)
    return None if roles is None else (guard, pad, load, roles)


def _match(nest: Loop, weight_grad: bool = False) -> Conv | None:
    """``nest`` as a :class:`Conv`: ``out[.., o, y, x] += w(o, window) * src(window)`` or,
    with ``weight_grad``, ``w(o, c, ky, kx) += src(window) * g[.., o, y, x]``."""
    found = _window_nest(nest)
    if found is None:
        return None
    tile, o, y, x, window, aug = found
    windows = {lp.var for lp in window}
    for other, s_expr in ((aug.value.lhs, aug.value.rhs), (aug.value.rhs, aug.value.lhs)):
        src = _source_load(s_expr, o, y, x, tile, window)
        if src is None or not isinstance(other, Load):
            continue
        guard, pad, load, (c, ky, kx) = src
        if weight_grad:   # other: the output gradient; the target: the weights
            shaped = (_index_vars(aug.target) <= {o.var, c.var, ky, kx}
                      and _is_output(other.ref, nest, o, y, x, tile, windows))
        else:             # other: the weights; the target: the output
            shaped = (_index_vars(other.ref) <= windows | {o.var}
                      and _is_output(aug.target, nest, o, y, x, tile, windows))
        if shaped and aug.target.buffer not in (load.ref.buffer, other.ref.buffer):
            return Conv(nest, tile, o, y, x, c, ky, kx, aug.target, other.ref, load.ref, guard, pad)
    return None


def _roles(src: Ref, o: str, y: str, x: str, tile: Loop | None, window: list[Loop]):
    """The window loops as (channel loop, row variable, column variable) if ``src`` reads
    ``[.., c, y + ky + a, x + kx + b]`` with ``ky``, ``kx`` over 3 values."""
    if len(src.index) != 4 or not all(isinstance(e, Affine) for e in src.index):
        return None
    _, chan, row, col = src.index
    by_var = {lp.var: lp for lp in window}
    ky = [v for v in row.vars if v in by_var]
    kx = [v for v in col.vars if v in by_var]
    cs = [v for v in chan.vars if v in by_var]
    tile_vars = {tile.var} if tile else set()
    if not (len(ky) == len(kx) == len(cs) == 1 and len({*ky, *kx, *cs}) == 3):
        return None
    (ky,), (kx,), (c,) = ky, kx, cs
    if (by_var[ky].extent, by_var[kx].extent) != (3, 3) or row.coef(y) != 1 or row.coef(ky) != 1 \
            or col.coef(x) != 1 or col.coef(kx) != 1 or chan.vars != {c} or chan.coef(c) != 1 \
            or row.vars - {y, ky} - tile_vars or col.vars != {x, kx} or o in src.index[0].vars:
        return None
    return by_var[c], ky, kx


def _is_output(target: Ref, nest: Loop, o: Loop, y: Loop, x: Loop, tile: Loop | None,
               windows: set) -> bool:
    """``target`` is ``out[n, o, y (+ tile rows), x]`` of the batch item."""
    if len(target.index) != 4 or not all(isinstance(e, Affine) for e in target.index):
        return False
    n, oc, row, col = target.index
    tile_vars = {tile.var} if tile else set()
    return (n.vars == {nest.var} and oc.vars == {o.var} and oc.coef(o.var) == 1
            and row.coef(y.var) == 1 and not row.vars - {y.var} - tile_vars
            and col.vars == {x.var} and col.coef(x.var) == 1 and not _index_vars(target) & windows)


def _index_vars(ref: Ref) -> set[str]:
    return {v for e in ref.index for v in variables(e)}


def _rewrite(conv: Conv, bufs, key: tuple, llc: int) -> list:
    """The weight transform, then the batch nest computing ``conv`` through the transforms
    (spread, :func:`_spread`: a batch loop transforming every item's tiles, the products
    over all of them, a batch loop transforming them back)."""
    o, c, f = conv.o, conv.c, conv.scheme
    th, tw = conv.tiles
    spread = _spread(conv, f.planes * o.extent * c.extent,
                     f.planes * (o.extent + c.extent) * conv.nest.extent * th * tw, llc)
    names = _names(conv)
    ty, tx, e, wi = names("_wy"), names("_wx"), names("_we"), names("_wi")
    width, slot, tile_at = _columns(conv, spread, ty, tx, wi)   # width: the products'
    label = f"{key[0]}.winograd{key[1]}"
    per = tuple(_plane(n) for n in (o.extent * c.extent, c.extent * width, o.extent * width))
    u = bufs.derived((*key, "U"), f"{label}.U", (f.planes, per[0]), transient=True)
    v, m = (_tiles_buffer(bufs, key, label, name, (f.planes, size), spread)
            for name, size in (("V", per[1]), ("M", per[2])))

    # U[e, o, c] = (G w G^T)[e]
    w = [[Var(names(f"_ww{a}{b}")) for b in range(3)] for a in range(3)]
    body = [Assign(w[a][b], Load(substitute(conv.weight, {conv.ky: Affine((), a),
                                                          conv.kx: Affine((), b)})))
            for a in range(3) for b in range(3)]
    at = Affine.build({o.var: c.extent, c.var: 1})
    rows, u_tile = _separable(names, "_wg", f.G, f.G, w)
    body += rows + [Assign(Ref(u, (Affine((), f.size * i + j), at), u.shape), u_tile[i][j])
                    for i in range(f.size) for j in range(f.size)]
    weights = _loops([o, c], body)
    copy, inputs = _source_tiles(conv, bufs, key, label, names, v, slot, width, tile_at, ty, tx)

    # M[e] = U[e] @ V[e]
    gemm = Gemm(o.extent, width, c.extent,
                u, Affine.of(e, per[0]), c.extent, False,
                v, _plane_at(e, per[1], f.planes, spread), width, False,
                m, _plane_at(e, per[2], f.planes, spread), width, beta=0.0)
    products = Loop(e, 0, f.planes, Block((gemm,)))

    # out[.., o, r ty + i, r tx + j] += (A^T M A)[i, j]
    mm = [[Var(names(f"_wm{a}{b}")) for b in range(f.size)] for a in range(f.size)]
    body = [Assign(mm[a][b], Load(Ref(m, (*slot, Affine((), f.size * a + b),
                                          tile_at + Affine.of(o.var, width)), m.shape)))
            for a in range(f.size) for b in range(f.size)]
    rows, out_tile = _separable(names, "_wa", f.AT, f.AT, mm)
    body += rows
    for i in range(f.out):
        for j in range(f.out):
            out = substitute(conv.target, {conv.y.var: Affine.of(ty, f.out) + i,
                                           conv.x.var: Affine.of(tx, f.out) + j})
            store = AugAssign(out, "+", out_tile[i][j])
            partial = _partial(f.out, [(ty, i, conv.y.extent), (tx, j, conv.x.extent)])
            body.append(store if partial is None else If(partial, Block((store,))))
    outputs = _loops([o, _loop(ty, th), _loop(tx, tw)], body)

    if spread:
        return [weights, _per_item(conv, (copy, inputs)), products, _per_item(conv, (outputs,))]
    if conv.items == 1:
        inner = Block((copy, inputs, products, outputs))
        if conv.tile is not None:
            inner = Block((replace(conv.tile, body=inner),))
        return [weights, replace(conv.nest, body=inner)]
    return [weights, _blocks(conv, names, wi, (copy, inputs), products, (outputs,))]


def _rewrite_weight_grad(conv: Conv, bufs, key: tuple, llc: int) -> list:
    """F(3x3, 2x2): each thread's ``M`` zeroed; the batch nest over blocks of items, each
    item's source tiles transformed as the forward's (``V[e, c, p]``) and its 2x2 output
    gradient tiles by ``G2`` (``D[e, o, p]``), then ``M[e] += D[e] @ V[e]^T`` (output x
    input channels, summed over the block's tiles); after it, the weight gradient ``+= (A3^T
    (M of every thread, summed in thread order) A3)[ky, kx]``. Spread (:func:`_spread`):
    every item's tiles transformed into ``D`` and ``V`` of the whole batch, then one ``M[e] =
    D[e] @ V[e]^T`` per plane over all of them, shared by the threads, transformed back."""
    o, c = conv.o, conv.c
    th, tw = conv.tiles
    spread = _spread(conv, bufs.threads * TILES * o.extent * c.extent,
                     TILES * (o.extent + c.extent) * conv.nest.extent * th * tw, llc)
    names = _names(conv)
    ty, tx, e, wi, t, z = (names(n) for n in ("_wy", "_wx", "_we", "_wi", "_wt", "_wz"))
    width, slot, tile_at = _columns(conv, spread, ty, tx, wi)   # width: the products' depth
    label = f"{key[0]}.wgrad{key[1]}"
    per = tuple(_plane(n) for n in (o.extent * width, c.extent * width, o.extent * c.extent))
    grads, v, m = (_tiles_buffer(bufs, key, label, name, (TILES, size), spread)
                   for name, size in (("D", per[0]), ("V", per[1]), ("M", per[2])))

    copy, inputs = _source_tiles(conv, bufs, key, label, names, v, slot, width, tile_at, ty, tx)

    # D[e, o, p] = (G2 g G2^T)[e] for the output gradient's 2x2 tile g at p (0 past its edge)
    g = [[_tile_value(conv, ty, tx, a, b) for b in range(2)] for a in range(2)]
    at = tile_at + Affine.of(o.var, width)
    body = [Assign(Ref(grads, (*slot, Affine((), 4 * i + j), at), grads.shape),
                   _combine(G2[i], G2[j], g)) for i in range(4) for j in range(4)]
    transformed = _loops([o, _loop(ty, th), _loop(tx, tw)], body)

    # M[e] += D[e] @ V[e]^T (spread: M[e] = over the whole batch's tiles)
    gemm = Gemm(o.extent, c.extent, width,
                grads, _plane_at(e, per[0], TILES, spread), width, False,
                v, _plane_at(e, per[1], TILES, spread), width, True,
                m, _plane_at(e, per[2], TILES, spread), c.extent, beta=0.0 if spread else 1.0)
    products = Loop(e, 0, TILES, Block((gemm,)))

    # w[o, c, ky, kx] += (A3^T M A3)[ky, kx], M summed over the threads
    mm = [[Var(names(f"_wm{a}{b}")) for b in range(4)] for a in range(4)]
    at = Affine.build({o.var: c.extent, c.var: 1})
    copies = [(Affine((), k),) for k in range(bufs.threads)] if not spread else [()]
    body = [Assign(mm[a][b], _sum([Load(Ref(m, (*k, Affine((), 4 * a + b), at), m.shape))
                                   for k in copies]))
            for a in range(4) for b in range(4)]
    body += [AugAssign(substitute(conv.target, {conv.ky: Affine((), i), conv.kx: Affine((), j)}),
                       "+", _combine(AT3[i], AT3[j], mm)) for i in range(3) for j in range(3)]
    back = _loops([o, c], body)
    if spread:
        return [_per_item(conv, (copy, inputs, transformed)), products, back]
    zero = nest([_loop(t, bufs.threads), _loop(e, TILES), _loop(z, per[2])],
                Assign(Ref(m, (Affine.of(t), Affine.of(e), Affine.of(z)), m.shape), Const(0.0)))
    if conv.items > 1:
        return [zero, _blocks(conv, names, wi, (copy, inputs, transformed), products, ()), back]
    inner = Block((copy, inputs, transformed, products))
    if conv.tile is not None:   # M sums the row tiles' products too
        inner = Block((replace(conv.tile, body=inner),))
    return [zero, replace(conv.nest, body=inner), back]


def _names(conv: Conv) -> NameGen:
    """Fresh names: none the nest uses."""
    names = NameGen()
    names.used |= variables(conv.nest) | {n.var for n in walk(conv.nest) if isinstance(n, Loop)}
    return names


def _source_tiles(conv: Conv, bufs, key: tuple, label: str, names: NameGen, v, slot: tuple,
                  width: int, tile_at: Affine, ty: str, tx: str) -> tuple:
    """The source rows the tile reads, padded, each row's columns by their phase:
    ``P[c, r, j, t]`` holds column ``out * t + j`` (guards only here, split off the
    interior), so that the transform reads each of a patch's columns at consecutive ``t``
    for consecutive tiles; then ``V[e, c, p] = (B^T d B)[e]`` over each patch ``d``."""
    c, f = conv.c, conv.scheme
    th, tw = conv.tiles
    rows = f.out * th + 2
    padded = bufs.scratch((*key, "P"), f"{label}.P", (c.extent, rows, f.out, tw + 1),
                          transient=True)
    r, j, t = names("_wr"), names("_wj"), names("_wq")
    order = [replace(c, kind=LoopKind.SERIAL), _loop(r, rows), _loop(j, f.out), _loop(t, tw + 1)]
    at = Ref(padded, (Affine.of(TID), Affine.of(c.var), Affine.of(r), Affine.of(j),
                      Affine.of(t)), padded.shape)
    loops = [conv.nest, *([conv.tile] if conv.tile else []), *order]
    copy = gather(order, at, _source(conv, r, Affine.build({t: f.out, j: 1})), loops)
    d = [[Load(Ref(padded, (Affine.of(TID), Affine.of(c.var), Affine.of(ty, f.out) + a,
                            Affine((), b % f.out), Affine.of(tx) + b // f.out), padded.shape))
          for b in range(f.size)] for a in range(f.size)]
    at = tile_at + Affine.of(c.var, width)
    body, v_tile = _separable(names, "_wb", f.BT, f.BT, d)
    body += [Assign(Ref(v, (*slot, Affine((), f.size * i + j), at), v.shape), v_tile[i][j])
             for i in range(f.size) for j in range(f.size)]
    return copy, _loops([c, _loop(ty, th), _loop(tx, tw)], body)


def _spread(conv: Conv, kept: int, tiles: int, llc: int) -> bool:
    """Whether ``conv``'s blocks of items take their products once over the whole batch,
    the threads sharing the planes, rather than block by block, each thread its blocks.
    Block by block, every block goes over ``kept`` floats again (the transformed weights; in
    a weight gradient, each thread's sums): from memory where they take more than half the
    last-level cache (``llc`` bytes: the rest holds the layer's other operands), and for
    few tiles where the threads left the blocks narrower than ``ITEM_TILES`` (a product
    then reads each weight for too few tiles to keep up with the memory that serves them,
    however large the cache: an Intel Xeon's 480 MiB L3 shared by a socket's cores). Over
    the whole batch, ``tiles`` floats (the batch's transformed tiles) are written and read
    back once: that pays where they are fewer."""
    narrow = conv.items * math.prod(conv.tiles) < ITEM_TILES
    return conv.items > 1 and (SPREAD_EVERY or ((narrow or 4 * kept > llc // 2) and tiles < kept))


def _columns(conv: Conv, spread: bool, ty: str, tx: str, wi: str) -> tuple[int, tuple, Affine]:
    """Where the transformed tiles go: the products' width (the tiles of ``conv.items``
    items, or spread, of the batch), the index of this thread's buffer (none where spread:
    one buffer) and tile ``(ty, tx)``'s column (of item ``wi`` of a block, or spread, of the
    batch loop's item)."""
    th, tw = conv.tiles
    item = conv.nest.var if spread else wi
    width = (conv.nest.extent if spread else conv.items) * th * tw
    slot = () if spread else (Affine.of(TID),)
    return width, slot, Affine.build({ty: tw, tx: 1, **({item: th * tw} if conv.items > 1 else {})})


def _tiles_buffer(bufs, key: tuple, label: str, name: str, shape: tuple, spread: bool):
    """A buffer of transformed tiles or products: shared by the threads where the products
    are spread over them, else one per thread."""
    make = bufs.derived if spread else bufs.scratch
    return make((*key, name), f"{label}.{name}", shape, transient=True)


def _plane_at(e: str, per: int, planes: int, spread: bool) -> Affine:
    """The offset of plane ``e`` of a :func:`_tiles_buffer` (this thread's, if per thread)."""
    return Affine.of(e, per) if spread else Affine.build({TID: planes * per, e: per})


def _one_tile(conv: Conv) -> dict:
    """The row tile loop's variable at its one tile (items shared by products are whole)."""
    return {conv.tile.var: Affine()} if conv.tile is not None else {}


def _per_item(conv: Conv, stmts: tuple) -> Loop:
    """The batch loop over ``conv``'s items running ``stmts``."""
    return replace(conv.nest, body=substitute(Block(stmts), _one_tile(conv)))


def _blocks(conv: Conv, names: NameGen, wi: str, before: tuple, products, after: tuple) -> Loop:
    """The batch loop over blocks of ``conv.items`` items (item ``items * block + wi``): each
    item's ``before``, the block's ``products``, each item's ``after``."""
    block = names("_wb")
    item = {conv.nest.var: Affine.build({block: conv.items, wi: 1}), **_one_tile(conv)}

    def per_item(stmts: tuple) -> Loop:
        return Loop(wi, 0, conv.items, substitute(Block(stmts), item))

    inner = (per_item(before), products, *((per_item(after),) if after else ()))
    return replace(conv.nest, var=block, stop=conv.nest.extent // conv.items, body=Block(inner))


def _tile_value(conv: Conv, ty: str, tx: str, a: int, b: int) -> Expr:
    """The output gradient at row ``2ty + a``, column ``2tx + b``: 0 past a partial tile's
    edge."""
    ref = substitute(conv.weight, {conv.y.var: Affine.of(ty, 2) + a, conv.x.var: Affine.of(tx, 2) + b})
    partial = _partial(2, [(ty, a, conv.y.extent), (tx, b, conv.x.extent)])
    return Load(ref) if partial is None else Select(partial, Load(ref), Const(0.0))


def _sum(terms: list) -> Expr:
    out = terms[0]
    for term in terms[1:]:
        out = BinOp("+", out, term)
    return out


def _plane(size: int) -> int:
    """The stride of one of the 16 planes of ``size`` floats: whole cache lines, an odd
    number of them, so that the 16 planes a transform writes (or reads) at one index fall in
    16 different cache sets (planes a power of two apart would all share one set)."""
    lines = -(-size // 16)
    return 16 * (lines + 1 - lines % 2)


def _loop(var: str, extent: int) -> Loop:
    return Loop(var, 0, extent, Block(()))


def _loops(loops: list[Loop], body: list) -> Loop:
    """``loops`` (outermost first, their bodies replaced) around ``body``, serial."""
    return nest([replace(lp, kind=LoopKind.SERIAL) for lp in loops], *body)


def _separable(names: NameGen, prefix: str, left, right, terms) -> tuple[list, list]:
    """``left @ terms @ right^T`` a factor at a time: the assignments of ``terms @ right^T``
    to fresh locals, and each entry of the product as an expression of those (F(4x4, 3x3)'s
    6x6 input transform so adds 288 terms, not 484)."""
    half = [[Var(names(f"{prefix}{a}{j}")) for j in range(len(right))] for a in range(len(terms))]
    rows = [Assign(half[a][j], _combine((1,), right[j], [terms[a]]))
            for a in range(len(terms)) for j in range(len(right))]
    return rows, [[_combine(left[i], (1,), [[half[a][j]] for a in range(len(terms))])
                   for j in range(len(right))] for i in range(len(left))]


def _combine(left, right, terms) -> Expr:
    """``sum(left[a] * right[b] * terms[a][b])`` with the zero coefficients left out."""
    out = None
    for a, la in enumerate(left):
        for b, rb in enumerate(right):
            k = la * rb
            if k == 0:
                continue
            term = terms[a][b] if abs(k) == 1 else BinOp("*", Const(float(abs(k))), terms[a][b])
            out = term if out is None and k > 0 else (
                BinOp("-", Const(0.0), term) if out is None else BinOp("+" if k > 0 else "-", out, term))
    return out if out is not None else Const(0.0)


def _source(conv: Conv, r: str, q: Affine) -> Expr:
    """Row ``r`` and column ``q`` of the source rows a row tile reads (from the row and
    column of its first output, less the padding): the source through the original guard,
    and the padding value where a partial tile reaches past the source."""
    at = {conv.y.var: Affine.of(r), conv.ky: Affine(), conv.x.var: q, conv.kx: Affine()}
    ref = substitute(conv.source, at)
    view = ref.view
    checks = [Compare(">=", ref.index[2], Const(0)), Compare("<", ref.index[2], Const(view[2])),
              Compare(">=", ref.index[3], Const(0)), Compare("<", ref.index[3], Const(view[3]))]
    if conv.guard is not None:
        guard = substitute(conv.guard, at)
        checks = [*(guard.values if isinstance(guard, BoolOp) and guard.op == "and" else [guard]),
                  *checks]
    return Select(BoolOp("and", tuple(checks)), Load(ref), conv.pad)


def _partial(out: int, dims: list[tuple[str, int, int]]) -> Expr | None:
    """The condition that output ``out * var + i`` lies below ``extent``, for every dimension
    whose last tile is partial (``extent`` no multiple of ``out``) where ``i`` may pass its
    edge; None if every tile is whole."""
    terms = [Compare("<", Affine.of(var, out) + i, Const(extent))
             for var, i, extent in dims if extent % out and i >= extent % out]
    return conj(terms) if terms else None

