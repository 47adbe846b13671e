"""A GEMM whose B operand is packed in panels (:mod:`latte.compiler.passes.pack`), or small
enough to be read in place, emitted as register-tiled outer products in LLVM vector IR
instead of a BLAS call.

``C`` is computed ``rows x cols`` at a time: ``rows * cols / lanes`` vector accumulators stay
in registers over the whole ``k`` loop, and each step loads ``cols / lanes`` vectors of the
panel (contiguous: the packing put them there) and broadcasts ``rows`` elements of A. With
B packed once and reused by many products (a recurrent weight at every time step), no call
repacks it, which is what BLAS does each time: on an AMD EPYC (znver4) core OpenBLAS runs
an LSTM step's 32-row products at about 77 GFLOP/s, this kernel at about 110.

The tile is chosen for the host's vector registers (:func:`tile`); a last partial panel of
``n`` is computed whole over the zero padding and stored lane by lane, a last partial group
of rows by a smaller tile. A B read in place has no padding: the last partial panel loads
only the lanes that lie in B. One whose rows start off a vector's boundary (a 14x14 image's
196 pixels) or lie a multiple of 2 KiB apart (an MLP's weights) is copied a block of ``k``
at a time to aligned rows on the stack, zero-padded to whole vectors (:func:`realigned`).

A product whose operands both run along ``k`` (B read transposed: a convolution's weight
gradient, output gradient times gathered windows, pixels innermost in both) is computed as
``rows x cols`` dot products instead (:func:`emit_dot`), each a vector of partial sums summed
across its lanes once at the end: BLAS packs (transposes) both operands at every call.
"""

from __future__ import annotations

from dataclasses import replace

from llvmlite import ir

from latte.compiler.ir import EPI_C, Assign, Const, Load, Ref, UnaryOp, Var, operand

F32, I64 = ir.FloatType(), ir.IntType(64)

MAX_ROWS = 8   # more rows of A broadcast per step outrun the first-level cache's streams
DOT_COPY = 1 << 14   # floats of B's last columns a product copies (transposed) onto the stack
#: floats of B a product copies onto the stack, rows realigned to whole vectors, where B's
#: rows in place split cache lines or alias in the first-level cache (:func:`realigned`)
REALIGN_COPY = 1 << 15
#: row blocks of A that must read a realigned copy of B for the copy to pay
REALIGN_ROW_BLOCKS = 4
#: bytes: rows a multiple of this apart fall in the same two sets of the first-level cache
#: (x86's hold 4 KiB a way), so a panel of many of them does not stay there
ALIASED = 2048


def dot_columns(n: int, k: int, lanes: int, trans_a: bool = False) -> int:
    """How many of the last columns of a product reading B in place are computed as dot
    products along ``k`` (:func:`emit`): the columns past B's last whole vector where they
    fill at most half a vector whose empty lanes are a tenth or more of all the vectors' (a
    7x7 image's 49 pixels: three vectors and one column, not four vectors of which 15 lanes
    are empty; 196 pixels, 4 lanes past 12 vectors, stay a vector: as fast, less code), A
    is read along its rows, and their copy fits :data:`DOT_COPY`; else 0."""
    rest = n % lanes
    wasted = 10 * (lanes - rest) >= -(-n // lanes) * lanes
    return rest if (0 < rest <= lanes // 2 < n and wasted and not trans_a
                    and rest * k <= DOT_COPY) else 0


def in_place_tile(m: int, n: int, k: int, lanes: int, registers: int, panel_bytes: int,
                  trans_a: bool = False, ldb: int = 0) -> tuple[int, int, int] | None:
    """``(rows, cols, k_block)`` of a product reading B in place (:func:`tile`), B's rows
    ``ldb`` floats apart (``n`` if 0). Where its tiles go row block by row block (more rows
    than columns, A along its rows: see :func:`emit`), every row block reads all of B,
    which stays in cache between them only if it fits ``panel_bytes``; and a B copied to
    realigned rows (:func:`realigned`) is copied :data:`REALIGN_COPY` floats at a time (its
    tile then sized for those blocks). A larger B is run ``k_block`` of its rows at a time
    (0: all of ``k``), C accumulating the blocks' products."""
    block = 0
    if not trans_a and m > n and 4 * k * n > panel_bytes:
        block = _block(k, panel_bytes // (4 * n), lanes)
    shape = tile(m, n, block or k, lanes, registers, panel_bytes, in_place=True, trans_a=trans_a)
    if shape is None:
        return None
    width = realigned(m, ldb or n, n, shape, lanes)
    if width and (block or k) * width > REALIGN_COPY:
        block = _block(k, REALIGN_COPY // width, lanes)
        wider = tile(m, n, block, lanes, registers, panel_bytes, in_place=True, trans_a=trans_a)
        if realigned(m, ldb or n, n, wider, lanes):   # panels sized for the copy's blocks
            shape = wider
    return (*shape, block)


def _block(k: int, most: int, lanes: int) -> int:
    """Rows of ``k`` in a block of at most ``most`` (at least ``lanes``): a multiple of
    ``lanes``, dividing ``k`` where one at least half as long does."""
    most = max(lanes, most // lanes * lanes)
    even = max(d for d in range(lanes, most + 1, lanes) if k % d == 0 or d == lanes)
    return even if 2 * even >= most else most   # equal blocks, unless much shorter


def realigned(m: int, ldb: int, n: int, tile: tuple[int, int], lanes: int) -> int:
    """The row length (``n`` rounded up to whole vectors, and a vector more where that would
    be a multiple of :data:`ALIASED` bytes) of the stack copy a product reading B in place
    makes of it, a block of ``k`` at a time, where B's rows, ``ldb`` floats apart, start
    off a vector's boundary or lie a multiple of :data:`ALIASED` bytes apart, its whole
    vectors span more than one panel of the ``(rows, cols)`` tile, and at least
    :data:`REALIGN_ROW_BLOCKS` blocks of rows of A read it; else 0. In place, most vector
    loads of such a B split cache lines, or a panel's rows evict each other from the
    first-level cache, and each panel is a strided slice of its rows; on an Intel Xeon
    (rocketlake) the copy ran a 1x1 convolution of a 14x14 image (64 x 196 over 1024)
    1.04-1.06x faster, a 3x3 one (128 x 196 over 2304, gathered windows) 1.18x, an MLP's
    input gradient (128 x 128 over 1024, B's rows 4 KiB apart) 2.5x
    (``benchmarks/products.py``); one panel wide (a 7x7 image's 49 pixels) it gained
    nothing and cost the copy, so such rows stay in place, as do rows too long for
    :data:`REALIGN_COPY` to hold a vector's worth of them."""
    rows, cols = tile
    width = -(-n // lanes) * lanes
    width += lanes * (4 * width % ALIASED == 0)
    scattered = ldb % lanes or 4 * ldb % ALIASED == 0
    if (not scattered or n // lanes * lanes <= cols or -(-m // rows) < REALIGN_ROW_BLOCKS
            or width * lanes > REALIGN_COPY):
        return 0
    return width


def copied_rows(g) -> int:
    """The row length of the copy :func:`emit` makes of the tiled product ``g``'s B, a block
    of ``k`` at a time (:func:`realigned`), or 0 where it reads B as it is."""
    if g.packed or g.trans_b:
        return 0
    width = realigned(g.m, g.ldb, g.n, g.panel[:2], g.panel[2])
    return width if width * (g.k_block or g.k) <= REALIGN_COPY else 0


def tile(m: int, n: int, k: int, lanes: int, registers: int, panel_bytes: int,
         in_place: bool = False, trans_a: bool = False) -> tuple[int, int] | None:
    """``(rows, cols)`` of the register tile for an ``m x n`` product over ``k``:
    ``rows * cols / lanes`` accumulators, plus the panel's vectors and a broadcast, fit in
    ``registers``, and a panel (``k x cols`` floats) in ``panel_bytes``; among those, the
    most useful work (the share not spent on padding) times the share of the FMA pipes the
    tile keeps busy (:func:`busy`), then the most rows for a packed panel (computed whole
    over its zero padding and read again from L2 for every block of rows: an LSTM step's
    32-row products ran 2% faster in 8-row tiles than in 4-row ones, a GRU's 11%, on an
    Intel Xeon), then the most accumulators, the fewest loads per FMA, the widest panel.
    None if no panel fits. One read ``in_place`` is computed only to the vector that holds
    its last column (or the last whole one, the rest as :func:`dot_columns`), its panels
    no wider than that, and rows left over by whole tiles by a smaller tile (no padding)."""
    best = None
    widest = -(-(n - dot_columns(n, k, lanes, trans_a)) // lanes) if in_place else 6
    for rows in range(1, min(m, MAX_ROWS) + 1):
        for vecs in range(1, min(6, widest) + 1):
            cols = vecs * lanes
            if rows * vecs + vecs + 1 > registers or 4 * k * cols > panel_bytes:
                continue
            if in_place:
                padded = m * -(-n // lanes) * lanes
            else:
                padded = -(-m // rows) * rows * -(-n // cols) * cols
            key = (round(m * n / padded * busy(rows, vecs, lanes), 2), 0 if in_place else rows,
                   rows * vecs, -(rows + vecs), vecs)
            if best is None or key > best[0]:
                best = (key, (rows, cols))
    return None if best is None else best[1]


def busy(rows: int, vecs: int, lanes: int) -> float:
    """The share of two FMA pipes a ``rows x vecs``-vector tile keeps busy, by the cycles a
    step of ``k`` takes: its ``rows * vecs`` FMAs on two pipes, its loads (a broadcast per
    row, a vector per column of vectors) on two ports, the panel's vectors from L2 at 32
    bytes a cycle, and at least 6 cycles, as each accumulator waits for its last FMA (4
    cycles on these cores: AVX2 code's LSTM step ran 1.12x faster in tiles of 12
    accumulators than of 8, ``benchmarks/lstm.py``: README, session 27)."""
    fma = rows * vecs / 2
    return fma / max(fma, (rows + vecs) / 2, vecs * lanes / 8, 6)


def dot_tile(m: int, n: int, lanes: int, registers: int) -> tuple[int, int]:
    """``(rows, cols)`` of the register tile of a product whose operands both run along
    ``k`` (:func:`emit_dot`): ``rows * cols`` accumulators, the ``rows`` vectors of A and one
    of B fit in ``registers``; the most FMAs per vector loaded over the work in whole
    tiles, then the most accumulators."""
    best = None
    for rows in range(1, min(m, MAX_ROWS) + 1):
        for cols in range(1, min(n, registers) + 1):
            if rows * cols + rows + 1 > registers:
                continue
            whole = (m // rows * rows) * (n // cols * cols) / (m * n)
            key = (round(rows * cols / (rows + cols) * whole, 2), rows * cols)
            if best is None or key > best[0]:
                best = (key, (rows, cols))
    return best[1]


def emit(b: ir.IRBuilder, g, a: ir.Value, bp: ir.Value, c: ir.Value, fma: ir.Function,
         counted, ops: list) -> None:
    """The product ``g`` (a :class:`~latte.compiler.ir.Gemm` with a ``panel``), with ``a``,
    ``bp`` and ``c`` pointing at its A, B and C blocks (and ``ops`` at its epilogue's
    operands, ``g.operands()``, run as a tile is stored: :func:`_finish`); ``fma``:
    ``llvm.fma`` on vectors of ``g.panel[2]`` floats; ``counted(name, lo, hi, body)``:
    codegen's loop. B is packed
    (panels ``k * cols`` apart, rows ``cols``) or read in place (panels ``cols`` apart,
    rows ``ldb``); B read transposed in place: :func:`emit_dot`. Where A has more rows than
    B has columns and is read along its rows, the tiles go row block by row block, so that
    the larger operand is read once, each block staying in L1 over every panel (A read
    transposed spreads a block over ``k`` lines: those products ran slower so); else panel
    by panel, each staying in cache over every row block. The :func:`dot_columns` of a B read
    in place are copied transposed to the stack, and each row block's dot products with
    them follow its panels. A ``k_block``: C scaled by ``beta`` first, then all of that per
    block of ``k``, each adding to C (the last one running the epilogue). B's rows starting
    off a vector's boundary, or aliasing in the first-level cache, are copied, a block at a
    time, to rows of whole vectors on the stack (:func:`realigned`) that the tiles read
    whole."""
    if g.trans_b:
        emit_dot(b, g, a, bp, c, fma, counted, ops)
        return
    step = g.k_block or g.k
    dots = 0 if g.packed else dot_columns(g.n, step, g.panel[2], g.trans_a)
    copy = None
    if dots:
        copy = b.alloca(F32, size=_i64(dots * step))
        copy.align = 64
    width = copied_rows(g)
    aligned = None
    if width:
        aligned = b.alloca(F32, size=_i64(step * width))
        aligned.align = 64

    def sweep(part, a_at, b_at) -> None:   # ``part``: g over one block of k
        if aligned is not None:
            _realign(b, part, b_at, aligned, width, counted)
            part, b_at = replace(part, ldb=width), aligned
        _sweep(b, part, a_at, b_at, c, fma, counted, ops, dots, copy, aligned is not None)

    if step == g.k:
        sweep(g, a, bp)
        return
    _scale(b, g, c, counted)   # C = beta * C, then every block adds to it
    blocks, rest = divmod(g.k, step)
    later = replace(g, k=step, beta=1.0, epilogue=None, c_stored=True)

    def block(kk, part) -> None:   # the block of k from step ``kk``
        sweep(part, b.gep(a, [kk]), b.gep(bp, [b.mul(kk, _i64(g.ldb))]))

    last = g.epilogue is not None and not rest   # the last block, with the epilogue, after the loop
    looped = blocks - last
    counted("mk.kblock", _i64(0), _i64(looped), lambda t: block(b.mul(t, _i64(step)), later))
    if last:
        block(_i64(looped * step), replace(later, epilogue=g.epilogue, c_stored=g.c_stored))
    if rest:
        block(_i64(blocks * step), replace(later, k=rest, epilogue=g.epilogue,
                                           c_stored=g.c_stored))


def _realign(b, g, bp, aligned, width: int, counted) -> None:
    """``g.k`` rows of B (``g.n`` floats, ``g.ldb`` apart from ``bp``) copied to ``aligned``,
    ``width`` floats apart (whole vectors, aligned), zeros after each row's last float."""
    lanes = g.panel[2]
    vec = ir.VectorType(F32, lanes)

    def row(kk) -> None:
        src = b.gep(bp, [b.mul(kk, _i64(g.ldb))])
        dst = b.gep(aligned, [b.mul(kk, _i64(width))])
        for j in range(0, width, lanes):
            x = _load(b, b.gep(src, [_i64(j)]), vec, min(lanes, g.n - j))
            b.store(x, b.bitcast(b.gep(dst, [_i64(j)]), vec.as_pointer()), align=4 * lanes)

    counted("mk.realign", _i64(0), _i64(g.k), row)


def _scale(b, g, c, counted) -> None:
    """``C = beta * C`` over ``g``'s block of C (0 for a ``beta`` of 0, whatever C held)."""
    def element(i, j) -> None:
        ptr = b.gep(c, [b.add(b.mul(i, _i64(g.ldc)), j)])
        x = ir.Constant(F32, 0.0)
        if g.beta != 0.0:
            x = b.fmul(ir.Constant(F32, g.beta), b.load(ptr))
        b.store(x, ptr)

    counted("mk.scale", _i64(0), _i64(g.m),
            lambda i: counted("mk.scale.col", _i64(0), _i64(g.n), lambda j: element(i, j)))


def _sweep(b, g, a, bp, c, fma, counted, ops, dots: int, copy, padded: bool = False) -> None:
    """:func:`emit`'s tiles over all of ``g`` (one block of ``k``), ``dots`` columns of them
    through ``copy``; ``padded``: B's rows are whole vectors (zeros past ``n``)."""
    rows, cols, lanes = g.panel
    full, tail = divmod(g.n - dots, cols)
    whole, rest = divmod(g.m, rows)
    panel_size = g.k * cols if g.packed else cols
    last = _dot_columns(b, g, a, bp, c, ops, dots, copy, fma, counted) if dots else None

    def tiles(p, first: int, width: int, row, height: int) -> None:
        """The ``height`` rows from ``row`` times panel ``p + first`` (``width`` columns)."""
        at = b.add(b.mul(p, _i64(panel_size)), _i64(first * panel_size))
        col = b.add(b.mul(p, _i64(cols)), _i64(first * cols))
        _tile(b, g, a, b.gep(bp, [at]), c, row, col, height, width, fma, ops, padded)

    def panels(row, height: int) -> None:   # every panel, one row block
        if full:
            counted("mk.panel", _i64(0), _i64(full), lambda p: tiles(p, 0, cols, row, height))
        if tail:
            tiles(_i64(0), full, tail, row, height)
        if last:
            last(row, height)

    def row_blocks(p, first: int, width: int) -> None:   # every row block, one panel
        if whole:
            counted("mk.rows", _i64(0), _i64(whole),
                    lambda t: tiles(p, first, width, b.mul(t, _i64(rows)), rows))
        if rest:
            tiles(p, first, width, _i64(whole * rows), rest)

    if g.m > g.n and not g.trans_a:
        if whole:
            counted("mk.rows", _i64(0), _i64(whole), lambda t: panels(b.mul(t, _i64(rows)), rows))
        if rest:
            panels(_i64(whole * rows), rest)
        return
    if full:
        counted("mk.panel", _i64(0), _i64(full), lambda p: row_blocks(p, 0, cols))
    if tail:
        row_blocks(_i64(0), full, tail)
    if last:
        if whole:
            counted("mk.rows", _i64(0), _i64(whole), lambda t: last(b.mul(t, _i64(rows)), rows))
        if rest:
            last(_i64(whole * rows), rest)


def _dot_columns(b, g, a, bp, c, ops, dots: int, copy, fma, counted):
    """The last ``dots`` columns of ``g``'s B (read in place) copied transposed to ``copy``,
    and a function emitting, for a block of rows, their dot products with those rows of A
    (tiles of as many rows as keep the accumulators, the rows' vectors and one of B in 32
    registers)."""
    first = g.n - dots

    def column(kk) -> None:
        for j in range(dots):
            x = b.load(b.gep(bp, [b.add(b.mul(kk, _i64(g.ldb)), _i64(first + j))]))
            b.store(x, b.gep(copy, [b.add(kk, _i64(j * g.k))]))

    counted("mk.copy", _i64(0), _i64(g.k), column)
    shifted = replace(g, n=dots, ldb=g.k, trans_b=True)
    c_at = b.gep(c, [_i64(first)])
    height = max(1, 31 // (dots + 1))

    def rows_of(row, count: int) -> None:
        for top in range(0, count, height):
            _dot_tile(b, shifted, a, copy, c_at, b.add(row, _i64(top)), _i64(0),
                      min(height, count - top), dots, fma, ops, first)

    return rows_of


def _tile(b, g, a, panel, c, row, col, rows: int, width: int, fma, ops,
          padded: bool = False) -> None:
    """``C[row:row + rows, col:col + width] (=|+=) A[row:row + rows, :] @ panel`` (whole
    vectors of it loaded where B is packed or ``padded``)."""
    _, cols, lanes = g.panel
    vec = ir.VectorType(F32, lanes)
    vecs = -(-width // lanes)
    if g.trans_a:   # A stored (k, m): element (i, k) at k * lda + i
        bases, step = [b.gep(a, [b.add(row, _i64(i))]) for i in range(rows)], g.lda
    else:
        bases, step = [b.gep(a, [b.mul(b.add(row, _i64(i)), _i64(g.lda))]) for i in range(rows)], 1
    pre, loop, done = b.block, b.append_basic_block("mk.k"), b.append_basic_block("mk.store")
    b.branch(loop)
    b.position_at_end(loop)
    k = b.phi(I64, name="mk.kv")
    k.add_incoming(_i64(0), pre)
    accs = [[b.phi(vec) for _ in range(vecs)] for _ in range(rows)]
    zero = ir.Constant(vec, None)
    for r in accs:
        for acc in r:
            acc.add_incoming(zero, pre)
    at = b.mul(k, _i64(cols if g.packed else g.ldb))
    panel_vecs = [_load(b, b.gep(panel, [b.add(at, _i64(j * lanes))]), vec,
                        lanes if g.packed or padded else min(lanes, width - j * lanes))
                  for j in range(vecs)]
    offset = k if step == 1 else b.mul(k, _i64(step))
    for i, base in enumerate(bases):
        x = _splat(b, b.load(b.gep(base, [offset])), vec)
        for j in range(vecs):
            nxt = b.call(fma, [x, panel_vecs[j], accs[i][j]])
            accs[i][j].add_incoming(nxt, loop)
            accs[i][j] = nxt
    k_next = b.add(k, _i64(1))
    k.add_incoming(k_next, loop)
    b.cbranch(b.icmp_signed("<", k_next, _i64(g.k)), loop, done)
    b.position_at_end(done)
    for i in range(rows):
        line = b.gep(c, [b.add(b.mul(b.add(row, _i64(i)), _i64(g.ldc)), col)])
        for j in range(vecs):
            count = min(lanes, width - j * lanes)
            _store(b, g, b.gep(line, [_i64(j * lanes)]), accs[i][j], count, fma, ops,
                   b.add(row, _i64(i)), b.add(col, _i64(j * lanes)))


def _load(b, at, vec: ir.VectorType, count: int) -> ir.Value:
    """The vector at ``at``; only its first ``count`` lanes (the rest zero) where fewer are
    there (the last partial panel of a B read in place: no read past its rows)."""
    if count == vec.count:
        return b.load(b.bitcast(at, vec.as_pointer()), align=4)
    out = ir.Constant(vec, None)
    for lane in range(count):
        out = b.insert_element(out, b.load(b.gep(at, [_i64(lane)])), _i64(lane))
    return out


def _finish(b, g, x: ir.Value, ops: list, row, col, count: int) -> ir.Value:
    """What C's ``count`` elements from ``(row, col)`` of ``g``'s block hold after its
    epilogue, ``x`` their values before it (a vector, or one float); the other buffers'
    elements it assigns are stored. Each operation as the nest it replaces wrote it, in its
    order (:mod:`latte.compiler.passes.epilogue`); ``max`` and ``min`` compare as codegen's."""
    if g.epilogue is None:
        return x
    vec = x.type if isinstance(x.type, ir.VectorType) else None
    where = {op: i for i, op in enumerate(g.operands())}
    values, written = {EPI_C: x}, {}

    def at(ref) -> tuple[int, ir.Value]:
        i = where[operand(ref)]
        _, _, rows, cols = g.operands()[i]
        return i, b.gep(ops[i], [b.add(b.mul(row, _i64(rows)), b.mul(col, _i64(cols)))])

    def load(ref) -> ir.Value:
        i, ptr = at(ref)
        if i in written:
            return written[i]
        if vec is None:
            return b.load(ptr)
        if g.operands()[i][3] == 0:
            return _splat(b, b.load(ptr), vec)
        return _load(b, ptr, vec, count)

    def value(e) -> ir.Value:
        if isinstance(e, Const):
            c = ir.Constant(F32, float(e.value))
            return c if vec is None else ir.Constant(vec, [c.constant] * vec.count)
        if isinstance(e, Var):
            return values[e.name]
        if isinstance(e, Load):
            return load(e.ref)
        if isinstance(e, UnaryOp):
            return b.fneg(value(e.operand))
        lhs, rhs = value(e.lhs), value(e.rhs)
        if e.op in ("max", "min"):
            return b.select(b.fcmp_ordered(">" if e.op == "max" else "<", lhs, rhs), lhs, rhs)
        return {"+": b.fadd, "-": b.fsub, "*": b.fmul, "/": b.fdiv}[e.op](lhs, rhs)

    ptrs = {}
    for s in _assignments(g.epilogue_body()):
        v = value(s.value)
        if isinstance(s.target, Var):
            values[s.target.name] = v
        else:
            i, ptrs[i] = at(s.target)
            written[i] = v
    for i, v in written.items():
        _put(b, v, ptrs[i], count)
    return values[EPI_C]


def epilogue_key(g) -> tuple:
    """What ``g``'s epilogue computes, its buffers left out: its statements with each ref as
    its operand's place and steps (:func:`~latte.compiler.codegen.tiled_key`)."""
    where = {op: i for i, op in enumerate(g.operands())}

    def key(n):
        if isinstance(n, Ref):
            op = operand(n)
            return ("ref", where[op], *op[2:])
        if isinstance(n, Const):
            return ("const", float(n.value))
        if isinstance(n, Var):
            return ("var", n.name)
        if isinstance(n, Load):
            return ("load", key(n.ref))
        if isinstance(n, UnaryOp):
            return (n.op, key(n.operand))
        if isinstance(n, Assign):
            return ("=", key(n.target), key(n.value))
        return (n.op, key(n.lhs), key(n.rhs))
    return tuple(key(s) for s in _assignments(g.epilogue_body()))


def _assignments(stmts) -> list:
    """The assignments of ``stmts`` in order (an assignment a pass dropped is an empty
    block)."""
    return [t for s in stmts for t in ((s,) if isinstance(s, Assign) else _assignments(s.stmts))]


def _put(b, x: ir.Value, at, count: int) -> None:
    """Store ``x`` (a vector or one float) at ``at``: only its first ``count`` lanes."""
    if not isinstance(x.type, ir.VectorType):
        b.store(x, at)
    elif count == x.type.count:
        b.store(x, b.bitcast(at, x.type.as_pointer()), align=4)
    else:
        for lane in range(count):
            b.store(b.extract_element(x, _i64(lane)), b.gep(at, [_i64(lane)]))


def _store(b, g, at, acc, count: int, fma, ops, row, col) -> None:
    """``C = alpha * acc + beta * C``, then :func:`_finish`, for the first ``count`` lanes
    at ``at``, element ``(row, col)`` of the block (C left as it was without
    ``c_stored``)."""
    vec = acc.type
    if g.alpha != 1.0:
        acc = b.fmul(acc, _splat(b, ir.Constant(F32, g.alpha), vec))
    if count == vec.count:
        ptr = b.bitcast(at, vec.as_pointer())
        if g.beta != 0.0:
            acc = b.call(fma, [_splat(b, ir.Constant(F32, g.beta), vec), b.load(ptr, align=4), acc])
        x = _finish(b, g, acc, ops, row, col, count)
        if not g.c_stored:
            return
        if g.stream:   # :mod:`latte.compiler.passes.stream`
            store = b.store(x, ptr, align=g.stream)
            store.set_metadata("nontemporal", b.module.add_metadata([ir.IntType(32)(1)]))
        else:
            b.store(x, ptr, align=4)
        return
    if g.beta != 0.0:   # a last partial panel: the lanes that lie in C
        acc = b.fadd(acc, b.fmul(_splat(b, ir.Constant(F32, g.beta), vec), _load(b, at, vec, count)))
    x = _finish(b, g, acc, ops, row, col, count)
    if g.c_stored:
        _put(b, x, at, count)


def emit_dot(b: ir.IRBuilder, g, a: ir.Value, bp: ir.Value, c: ir.Value, fma: ir.Function,
             counted, ops: list) -> None:
    """``C (=|+=) A @ B^T`` where A (``m x k``) and B (``n x k``) both run along ``k``, as
    a convolution's weight gradient reads the output gradient and the gathered windows
    (pixels innermost in both): ``rows x cols`` dot products at a time, each accumulated in
    a vector of ``lanes`` partial sums over ``k`` and summed across lanes at the end. The
    operand with more rows is walked in the outer loop, so that its block stays in the
    first-level cache while the other operand's blocks stream past."""
    rows, cols, lanes = g.panel

    def runs(total: int, size: int) -> list:
        """``(first, count, size)``: the whole tiles of ``size``, then the partial one."""
        whole, rest = divmod(total, size)
        return [(0, whole, size)] * bool(whole) + [(whole * size, 1, rest)] * bool(rest)

    def at(first: int, i, size: int):
        return b.add(b.mul(i, _i64(size)), _i64(first))

    def sweep(outer: list, inner: list, tile) -> None:
        for o_first, o_count, o_size in outer:
            for i_first, i_count, i_size in inner:
                def row(p, o_first=o_first, o_size=o_size, i_first=i_first, i_size=i_size,
                        i_count=i_count):
                    _loop(b, counted, "mk.inner", i_count, lambda q: tile(
                        at(o_first, p, o_size), at(i_first, q, i_size), o_size, i_size))
                _loop(b, counted, "mk.outer", o_count, row)

    def dot(i, j, r: int, s: int) -> None:
        _dot_tile(b, g, a, bp, c, i, j, r, s, fma, ops)

    if g.n >= g.m:   # columns outside: B's rows stay in L1 while A's blocks stream
        sweep(runs(g.n, cols), runs(g.m, rows), lambda j, i, s, r: dot(i, j, r, s))
    else:
        sweep(runs(g.m, rows), runs(g.n, cols), dot)


def _loop(b, counted, name: str, count: int, body) -> None:
    """``body(i)`` for ``i`` in ``range(count)``: a loop, or straight code for one."""
    if count == 1:
        body(_i64(0))
    else:
        counted(name, _i64(0), _i64(count), body)


def _dot_tile(b, g, a, bp, c, row, col, rows: int, cols: int, fma, ops, first: int = 0) -> None:
    """``C[row:row + rows, col:col + cols] (=|+=) A[row:row + rows, :] @ B[col:col + cols, :]^T``
    (C and the epilogue's operands from column ``first`` of the block)."""
    lanes = g.panel[2]
    vec = ir.VectorType(F32, lanes)
    a_rows = [b.gep(a, [b.mul(b.add(row, _i64(i)), _i64(g.lda))]) for i in range(rows)]
    b_rows = [b.gep(bp, [b.mul(b.add(col, _i64(j)), _i64(g.ldb))]) for j in range(cols)]
    whole, rest = divmod(g.k, lanes)
    accs = [[ir.Constant(vec, None)] * cols for _ in range(rows)]

    def step(at, count: int, accs):
        """One vector of ``k`` from ``at``: ``count`` lanes of it lie in the operands."""
        xs = [_load(b, b.gep(p, [at]), vec, count) for p in a_rows]
        out = [list(r) for r in accs]
        for j, p in enumerate(b_rows):
            y = _load(b, b.gep(p, [at]), vec, count)
            for i in range(rows):
                out[i][j] = b.call(fma, [xs[i], y, accs[i][j]])
        return out

    if whole:
        pre, loop, done = b.block, b.append_basic_block("mk.k"), b.append_basic_block("mk.sum")
        b.branch(loop)
        b.position_at_end(loop)
        k = b.phi(I64, name="mk.kv")
        k.add_incoming(_i64(0), pre)
        phis = [[b.phi(vec) for _ in range(cols)] for _ in range(rows)]
        for i in range(rows):
            for j in range(cols):
                phis[i][j].add_incoming(accs[i][j], pre)
        nxt = step(b.mul(k, _i64(lanes)), lanes, phis)
        for i in range(rows):
            for j in range(cols):
                phis[i][j].add_incoming(nxt[i][j], loop)
        k_next = b.add(k, _i64(1))
        k.add_incoming(k_next, loop)
        b.cbranch(b.icmp_signed("<", k_next, _i64(whole)), loop, done)
        b.position_at_end(done)
        accs = nxt
    if rest:
        accs = step(_i64(whole * lanes), rest, accs)
    sums = _lane_sums(b, [x for r in accs for x in r], lanes)
    for i in range(rows):
        line = b.gep(c, [b.add(b.mul(b.add(row, _i64(i)), _i64(g.ldc)), col)])
        for j in range(cols):
            ptr = b.gep(line, [_i64(j)])
            x = sums[i * cols + j]
            if g.alpha != 1.0:
                x = b.fmul(ir.Constant(F32, g.alpha), x)
            if g.beta != 0.0:
                x = b.fadd(x, b.fmul(ir.Constant(F32, g.beta), b.load(ptr)))
            x = _finish(b, g, x, ops, b.add(row, _i64(i)), b.add(col, _i64(first + j)), 1)
            if g.c_stored:
                b.store(x, ptr)


def _lane_sums(b, vectors: list, lanes: int) -> list:
    """The sum across the lanes of each vector, ``lanes`` vectors at a time by a transposing
    tree: pairs of vectors trade halves of their lane groups and add (``lanes - 1`` adds
    for ``lanes`` sums instead of ``lanes**2``)."""
    zero = ir.Constant(vectors[0].type, None)
    out = []
    for first in range(0, len(vectors), lanes):
        group = vectors[first:first + lanes]
        # (vector, the vectors whose partial sums its lane groups hold, in order)
        level = [(v, [i]) for i, v in enumerate(group)] + [(zero, [None])] * (lanes - len(group))
        size = lanes
        while size > 1:
            half = size // 2
            lo = [s * size + t for s in range(lanes // size) for t in range(half)]
            hi = [i + half for i in lo]
            level = [(b.fadd(_pick(b, x, y, lo), _pick(b, x, y, hi)), ox + oy)
                     for (x, ox), (y, oy) in zip(level[0::2], level[1::2])]
            size = half
        ((total, owners),) = level
        sums = {o: b.extract_element(total, _i64(lane)) for lane, o in enumerate(owners)
                if o is not None}
        out += [sums[i] for i in range(len(group))]
    return out


def _pick(b, x, y, lanes: list) -> ir.Value:
    """``x``'s ``lanes`` followed by ``y``'s."""
    n = len(lanes) * 2
    return b.shuffle_vector(x, y, ir.Constant(ir.VectorType(ir.IntType(32), n),
                                              lanes + [n + i for i in lanes]))


def _splat(b, x: ir.Value, vec: ir.VectorType) -> ir.Value:
    one = b.insert_element(ir.Constant(vec, ir.Undefined), x, _i64(0))
    return b.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                            ir.Constant(ir.VectorType(ir.IntType(32), vec.count), None))


def _i64(x: int) -> ir.Constant:
    return ir.Constant(I64, x)
