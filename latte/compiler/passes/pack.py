"""Weights packed once per pass for the GEMMs that reuse them.

A GEMM whose B operand is a parameter (nothing writes it during a pass) multiplies by the
same block every time it runs: at every step of a time loop, and by every row of a large
product. A BLAS call repacks that block at each call (an LSTM's 4 MiB recurrent weight,
50 times a pass); here such a GEMM gets a derived buffer holding ``op(B)`` packed in panels,
``[ceil(n / cols)][k][cols]`` with the last panel zero-padded, filled once per pass (before
the time loop, or at the start of the kernel), and is marked ``panel`` so that codegen
computes it with the register-tiled micro-kernel (:mod:`latte.compiler.microkernel`).

Packing pays (:func:`pays`) where each packed element serves many rows of A: every GEMM in
a time loop, else at least :data:`MIN_ROWS` rows in all (a product split across threads by
rows counts every slice; more rows when B is read transposed, whose packing costs more);
and where the tile's panel stays in the L2 cache and A is read along its rows (a transposed
A only in short products).

The packing nest repeats the loops around the GEMM that move its B block (a product split
across threads packs one block per thread, in parallel as the product runs) and the guards
on them; GEMMs that read the same block (a product split into a whole and a last slice)
share one packed copy. Nothing looks at layer types or names.

GEMMs left to BLAS whose A block stays in the last-level cache and whose B is read along
its rows run the micro-kernel on B in place (:func:`tile_in_place`), no packing at all,
where it beats BLAS on this machine (large products are timed both ways once per shape:
:func:`in_place_pays`); those whose A and B both run along ``k`` (a convolution's weight
gradient) run as dot products.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

from latte.compiler import trials
from latte.compiler.ir import (
    Affine,
    Assign,
    Block,
    Buffer,
    Const,
    Gemm,
    If,
    Kernel,
    Load,
    Loop,
    Ref,
    rewrite_statements,
    statements,
)
from latte.compiler.microkernel import dot_tile, in_place_tile, tile
from latte.compiler.passes.data_copy import nest, variables
from latte.compiler.passes.parallel import parallel

# rows of A a packed element must serve outside a time loop, and when packing reads B across
# its rows: an MLP's 1024x1024 weights packed for 128 rows cost more than the tiles gain
MIN_ROWS, MIN_ROWS_TRANSPOSED = 512, 1024
TRANSPOSE = 16   # rows of B a transposing pack reads at a time
# dot products along k beat BLAS from 8 vectors of k, over at most 128 rows of the operand
# streamed past the other (a 3x3 convolution's weight gradient, 2 threads, AMD EPYC znver4:
# 1.15x at 64 output channels, 1.05x at 128, 0.93x at 256, 0.78x at 512), and from 64
# floats where both operands have at most 64 rows (AMD EPYC znver5: ResNet-18's 64-channel
# Winograd weight gradients over 112 floats gain, its 128-channel ones over 98 lose)
MIN_DOT_VECTORS, MAX_DOT_ROWS = 8, 128
SHORT_DOT_K, SHORT_DOT_ROWS = 64, 64
#: Products (per thread) of at least this many multiply-adds, A read along its rows, are
#: timed both ways before the micro-kernel reads their B in place: at this size BLAS's
#: packing no longer dominates, and the two trade places by shape and CPU
MEASURED_FMAS = 1 << 21


def pack_weights(kernel: Kernel, bufs, params: frozenset[Buffer], vector: tuple[int, int],
                 l2: int, stepped: bool) -> tuple[Kernel, list]:
    """``kernel`` with each GEMM whose B operand is in ``params`` reading a packed copy where
    that pays, and the nests that pack them; ``vector``: the host's vector registers,
    ``(bits, count)``; ``l2``: bytes of its L2 cache; ``stepped``: ``kernel`` runs at every
    step of a time loop."""
    packs: list = []
    known: dict = {}   # what a packed copy holds -> the copy (one per B block, not per GEMM)

    def visit(s, around: tuple):
        if isinstance(s, Gemm) and s.b_buf in params and not s.panel:
            packed = _packed(s, around, f"{kernel.name}.packed{len(packs)}", bufs, vector, l2,
                             stepped, known)
            if packed is None:
                return s
            s, pack = packed
            if pack is not None:
                packs.append(pack)
            return s
        if isinstance(s, Block):
            return Block(tuple(visit(c, around) for c in s.stmts))
        if isinstance(s, Loop):
            return replace(s, body=visit(s.body, (*around, s)))
        if isinstance(s, If):
            return replace(s, then=visit(s.then, (*around, (s, True))),
                           orelse=visit(s.orelse, (*around, (s, False))))
        return s

    return replace(kernel, body=visit(kernel.body, ())), packs


def tile_in_place(kernel: Kernel, vector: tuple[int, int], l2: int, shared: int) -> Kernel:
    """``kernel`` with each GEMM still left to BLAS that reads B along its rows computed by
    the tiled micro-kernel straight from B, unpacked: BLAS packs both operands at every
    call, which costs the most next to small products (a convolution's window tile: ``k``
    27 for an RGB 3x3 window, or a few pixels of a fused tile against a deep layer's
    weights). A is read again for every panel of B, so its block must fit half of the
    ``shared`` (last-level) cache, and along its rows, or transposed in a short product; a
    panel must fit half the ``l2``; and the micro-kernel must beat BLAS on this machine
    (:func:`in_place_pays`). B read transposed, along ``k`` as A is (a
    convolution's weight gradient): dot products (:func:`_dot`). Matrix-vector products stay
    with BLAS."""
    def tiled(g: Gemm):
        if g.trans_b and not g.panel and min(g.m, g.n) > 1:
            return _dot(g, vector, l2)
        shape = _in_place_tile(g, vector, l2, shared)
        if shape is None or not in_place_pays(g, vector, l2):
            return None
        rows, cols, block = shape
        return replace(g, panel=(rows, cols, vector[0] // 32), packed=False, k_block=block)

    return replace(kernel, body=rewrite_statements(kernel.body, lambda n: tiled(n) if isinstance(n, Gemm)
                                        else None))


def _in_place_tile(g: Gemm, vector: tuple[int, int], l2: int, shared: int):
    """The micro-kernel's tile for ``g`` with B read in place along its rows, if its operands
    suit it (see :func:`tile_in_place`); None otherwise."""
    if (g.panel or g.trans_b or g.m == 1 or g.n == 1 or 4 * g.m * g.k > shared // 2
            or not _short_columns(g)):
        return None
    return in_place_tile(g.m, g.n, g.k, vector[0] // 32, vector[1], l2 // 2, g.trans_a, g.ldb)


def measure_in_place(kernels: list[Kernel], vector: tuple[int, int], l2: int, shared: int) -> None:
    """Time together every product of ``kernels`` that :func:`in_place_pays` will ask about
    and this machine has not answered yet (:func:`~latte.compiler.trials.measure`)."""
    trials.measure([trials.key(g) for kernel in kernels for g in statements(kernel.body)
                    if isinstance(g, Gemm) and timed(g)
                    and _in_place_tile(g, vector, l2, shared) is not None], vector, l2)


def in_place_pays(g: Gemm, vector: tuple[int, int], l2: int) -> bool:
    """Does the micro-kernel, reading ``g``'s B in place, beat BLAS on this machine? From
    :data:`MEASURED_FMAS` multiply-adds, each shape (sizes, leading dimensions, A along its
    rows or transposed) is timed once per machine on one thread, both ways, on operands
    aligned as a program's buffers are (:func:`~latte.compiler.trials.beats_blas`,
    ``in-place-speedup-<key>.json``): on an Intel Xeon (rocketlake) the micro-kernel ran a
    1x1 convolution of ResNet-50 at batch 1 (64 x 784 over 256, B's rows 12 KiB apart) at
    1.14x of BLAS's speed and a 3x3 convolution's im2col product (128 x 196 over 2304) at
    0.95x, an MLP's weight gradient (1024 x 128 over 128, A transposed) at 1.12x, a 3x3
    convolution's input gradient (:data:`~latte.compiler.trials.TRANSPOSED_A_TRIAL`) at
    0.92-0.96x (``transposed-a-speedup-*.json``)
    (``latte explain`` prints each ratio). A smaller product: yes (BLAS packs both operands
    at every call), or with A transposed, :func:`transposed_a_in_place`. ``LATTE_IN_PLACE``
    and ``LATTE_TRANSPOSED_A`` ``=0``/``1`` decide those with A along its rows and
    transposed without measuring."""
    if timed(g):
        return trials.beats_blas(trials.key(g), vector, l2)
    if g.trans_a:
        return transposed_a_in_place(vector, l2)
    return os.environ.get("LATTE_IN_PLACE") != "0"


def timed(g: Gemm) -> bool:
    """Is ``g``'s product one :func:`in_place_pays` times on the machine?"""
    forced = os.environ.get("LATTE_TRANSPOSED_A" if g.trans_a else "LATTE_IN_PLACE")
    return g.m * g.n * g.k >= MEASURED_FMAS and forced not in ("0", "1")


def transposed_a_in_place(vector: tuple[int, int], l2: int) -> bool:
    """Does the micro-kernel beat BLAS on A read transposed (each step of ``k`` moves ``lda``
    floats on, a page apart in a convolution's input gradient) on this machine? It did on
    an AMD EPYC (znver4), and ran ResNet-18's and ResNet-50's training steps 5% and 6%
    slower than BLAS on an Intel Xeon (emeraldrapids), so it is measured once per machine
    (:func:`~latte.compiler.trials.transposed_a_beats_blas`) for the products too small to be
    timed by their shape (:func:`in_place_pays`). ``LATTE_TRANSPOSED_A=0``/``1`` decides
    without measuring."""
    forced = os.environ.get("LATTE_TRANSPOSED_A")
    if forced in ("0", "1"):
        return forced == "1"
    return trials.transposed_a_beats_blas(vector, l2)


def _dot(g: Gemm, vector: tuple[int, int], l2: int) -> Gemm | None:
    """``g`` (``A @ B^T``) as dot products along ``k`` (:func:`~latte.compiler.microkernel.emit_dot`)
    where both operands run along ``k``, ``k`` spans :data:`MIN_DOT_VECTORS` vectors (the sums
    across lanes at the end cost about one step of ``k``; :data:`SHORT_DOT_K` floats, if
    fewer, where both operands have at most :data:`SHORT_DOT_ROWS` rows) and the operand
    with fewer rows, streamed past the other's, has at most :data:`MAX_DOT_ROWS` of them and
    fits half the ``l2``. ``LATTE_DOT=0``: BLAS."""
    lanes = vector[0] // 32
    least = MIN_DOT_VECTORS * lanes
    if max(g.m, g.n) <= SHORT_DOT_ROWS:
        least = min(least, SHORT_DOT_K)
    if (g.trans_a or g.k < least or min(g.m, g.n) > MAX_DOT_ROWS
            or 4 * min(g.m, g.n) * g.k > l2 // 2 or os.environ.get("LATTE_DOT") == "0"):
        return None
    return replace(g, panel=(*dot_tile(g.m, g.n, lanes, vector[1]), lanes), packed=False)


def pays(g: Gemm, rows: int, stepped: bool) -> bool:
    """Does packing ``g``'s B once per pass pay, for ``rows`` rows of A in all (``g``'s, times
    the iterations of the loops around it that do not move B)? See the module's docstring."""
    if not _short_columns(g):
        return False
    return stepped or rows >= (MIN_ROWS_TRANSPOSED if g.trans_b else MIN_ROWS)


def _short_columns(g: Gemm) -> bool:
    """Does the micro-kernel read A well: along its rows, or transposed with few rows or
    few steps of ``k`` (each step moves ``lda`` floats on: a tile of rows walking 1568
    steps of 2048 floats ran at half BLAS's speed, a convolution's input gradient over a few
    hundred output channels is faster than BLAS)?"""
    return not g.trans_a or min(g.m, g.k) <= MIN_ROWS


def _packed(g: Gemm, around: tuple, name: str, bufs, vector: tuple[int, int], l2: int,
            stepped: bool, known: dict):
    """``g`` reading its packed copy, and the nest filling that copy (None if ``known``
    holds one alike); None where packing does not pay or no tile keeps its panel in half
    the L2 cache. Guards around ``g`` on what does not move its B block are left out of the
    nest: the block is the same whichever way they go."""
    moving = g.b_off.vars
    shape = tile(g.m, g.n, g.k, vector[0] // 32, vector[1], l2 // 2)
    served = g.m * math.prod(s.extent for s in around if isinstance(s, Loop) and s.var not in moving)
    if shape is None or not pays(g, served, stepped):
        return None
    loops = [s for s in around if isinstance(s, Loop) and s.var in moving]
    kept = {lp.var for lp in loops}
    around = [s for s in around if (s.var in kept if isinstance(s, Loop)
                                    else variables(s[0].cond) <= kept)]
    rows, cols = shape
    lanes = vector[0] // 32
    panels = -(-g.n // cols)
    copy = Affine()
    for lp in loops:   # which copy: the moving loops' iteration, row-major
        copy = copy * lp.extent + Affine.of(lp.var) - lp.start
    key = (g.b_buf, g.b_off, g.ldb, g.trans_b, g.n, g.k, cols,
           tuple(s if isinstance(s, Loop) else (s[0].cond, s[1]) for s in around))
    packed = known.get(key)
    fresh = packed is None
    if fresh:
        packed = known[key] = bufs.derived((name, "packed"), name,
                                           (math.prod(lp.extent for lp in loops), panels, g.k, cols),
                                           transient=True)
    gemm = replace(g, b_buf=packed, b_off=copy * (panels * g.k * cols), ldb=cols,
                   trans_b=False, panel=(rows, cols, lanes))
    if not fresh:
        return gemm, None

    p, k, kb, j = "_pack_p", "_pack_k", "_pack_kb", "_pack_j"
    col = Affine.build({p: cols, j: 1})

    def store(row: Affine, zero: bool) -> Assign:
        """``packed[copy, p, row, j]`` = ``op(B)[row, col]``, or 0 (the padding)."""
        at = g.b_off + (col * g.ldb + row if g.trans_b else row * g.ldb + col)
        value = Const(0.0) if zero else Load(Ref(g.b_buf, (at,), (g.b_buf.size,)))
        return Assign(Ref(packed, (copy, Affine.of(p), row, Affine.of(j)), packed.shape), value)

    def columns(lo: int, hi: int, zero: bool) -> list:
        """Columns ``lo .. hi - 1`` of the panels. B read transposed goes in blocks of
        TRANSPOSE rows, which its reads and the packed rows' writes both keep in L1."""
        if not g.trans_b:
            return [nest([_loop(k, 0, g.k), _loop(j, lo, hi)], store(Affine.of(k), zero))]
        blocks, rest = divmod(g.k, TRANSPOSE)
        out = [nest([_loop(kb, 0, blocks), _loop(j, lo, hi), _loop(k, 0, TRANSPOSE)],
                    store(Affine.build({kb: TRANSPOSE, k: 1}), zero))] if blocks else []
        if rest:
            out.append(nest([_loop(j, lo, hi), _loop(k, blocks * TRANSPOSE, g.k)],
                            store(Affine.of(k), zero)))
        return out

    def fill(first: int, count: int, width: int) -> Loop:
        """Panels ``first .. first + count - 1``: their first ``width`` columns from B;
        spread over the threads where no loop around the nest is (each thread packing its
        own slice of B) and there are two panels or more."""
        inner = columns(0, width, False) + (columns(width, cols, True) if width < cols else [])
        filled = Loop(p, first, first + count, Block(tuple(inner)))
        return parallel(filled, 1) if bufs.threads > 1 and not loops and count > 1 else filled

    whole, tail = divmod(g.n, cols)
    stmt = Block(tuple(([fill(0, whole, cols)] if whole else []) + ([fill(whole, 1, tail)] if tail else [])))
    for s in reversed(around):   # the moving loops and the guards on them, innermost first
        if isinstance(s, Loop):
            stmt = Block((replace(s, body=stmt),))
        else:
            guard, then = s
            stmt = Block((If(guard.cond, stmt) if then else If(guard.cond, Block(()), stmt),))
    return gemm, (stmt.stmts[0] if len(stmt.stmts) == 1 else stmt)


def _loop(var: str, lo: int, hi: int) -> Loop:
    return Loop(var, lo, hi, Block(()))
