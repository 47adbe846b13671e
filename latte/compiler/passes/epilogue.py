"""Epilogue folding: the element-wise nest after a tiled product (a bias, a batch norm, a
residual add, a ReLU) runs on each tile as the product stores it.

A fully-connected layer's forward (and an LSTM's input and recurrent projections) is a GEMM
into ``C`` followed by the nest ``for i: for j: C[i, j] += bias[j]``: a second pass over
``C`` (13 MB for an LSTM's input projection over 50 steps of 32 items) and, in a time
loop, a second parallel region at every step. A convolution's tile is a GEMM followed by
its bias, or in the test phase by its batch norm ``scale[c] * (C[c, p] - mean[c]) *
inv_std[c] + shift[c]``, a residual add of another block's output and a ReLU, fused in one
group: a second pass over each tile, and over the whole of C where the group has no tile
loop (a ResNet's 1x1 projection at batch 1 reads C, the other branch and writes the sum:
three passes over 3 MB). Where the GEMM is a register-tiled product
(:mod:`latte.compiler.microkernel`), run alone or split over threads by a parallel loop,
and the nest right after it (at any depth of the kernel) assigns, element for element,
exactly the region the product's blocks write, the product runs the nest's statements on
each element as it stores it (:attr:`~latte.compiler.ir.Gemm.epilogue`) and the nest is
dropped: the values are rounded in the same order as before.

What the statements may read: C's element, values of the element's row alone or of its
column alone (a bias, a batch norm's statistics), and elements of other buffers laid out
as C's block (columns contiguous); what they may write: C's element and such elements of
other buffers that the product does not read. Their expressions: arithmetic, ``max`` and
``min`` (what a nest the product can vectorize as it is holds). Products BLAS computes keep
their nest. ``LATTE_FOLD_EPILOGUES=0`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import replace

from latte.compiler.ir import (
    EPI_C,
    EPI_COL,
    EPI_ROW,
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    Compare,
    Const,
    Gemm,
    If,
    Kernel,
    Load,
    Loop,
    LoopKind,
    Ref,
    UnaryOp,
    Var,
    accesses,
    rewrite,
    rewrite_statements,
    substitute,
    touched,
    walk,
)

OPS = ("+", "-", "*", "/", "max", "min")   # the operators an epilogue computes
ROW, COL = "epilogue.i", "epilogue.j"   # a nest's row and column, named as no loop variable is


def fold_epilogues(kernel: Kernel) -> Kernel:
    """``kernel`` with each element-wise nest that follows a tiled product folded into it."""
    return replace(kernel, body=_block(kernel.body)) if enabled() else kernel


def enabled() -> bool:
    """Is folding on (``LATTE_FOLD_EPILOGUES`` not ``0``)?"""
    return os.environ.get("LATTE_FOLD_EPILOGUES") != "0"


def _block(block: Block) -> Block:
    out: list = []
    for s in block.stmts:
        s = _inner(s)
        folded = fold_pair(out[-1], s) if out else None
        if folded is None:
            out.append(s)
        else:
            out[-1] = folded
    same = len(out) == len(block.stmts) and all(a is b for a, b in zip(out, block.stmts))
    return block if same else Block(tuple(out))


def _inner(s):
    """``s`` with the blocks of a loop or a branch folded."""
    if isinstance(s, Loop):
        body = _block(s.body)
        return s if body is s.body else replace(s, body=body)
    if isinstance(s, If):
        then, orelse = _block(s.then), _block(s.orelse)
        return s if then is s.then and orelse is s.orelse else replace(s, then=then, orelse=orelse)
    return s


def fold_pair(first, second):
    """``first`` (a tiled product, or a parallel loop running one per iteration) with the
    nest ``second`` folded in; or, where both are loops over the same range (a batch loop
    around a product, then one around the nest), one loop with the second's statement
    folded into the first's last (:func:`_fold_inside`); else None."""
    return _fold_here(first, second) or _fold_inside(first, second)


def _fold_inside(first, second):
    """Both loops as one, the nest folded into the first loop's last statement: the nest of
    item ``i`` runs after the product of item ``i``, which writes nothing the nest's items
    but ``i`` read (C's blocks of other items) and reads nothing the nest writes
    (:func:`_safe`); the first loop's other statements touch nothing the nest writes and
    write nothing it reads."""
    if not (isinstance(first, Loop) and isinstance(second, Loop)
            and (first.start, first.stop) == (second.start, second.stop)
            and first.body.stmts and len(second.body.stmts) == 1):
        return None
    if first.kind is LoopKind.PARALLEL and second.kind is not LoopKind.PARALLEL:
        return None   # the nest's items were not found independent: they stay in order
    nest = substitute(second.body.stmts[0], {second.var: Affine.of(first.var)})
    before = Block(first.body.stmts[:-1])
    written = {a.buffer for a in accesses(before) if a.written}
    if touched(nest) & written or touched(before) & {a.buffer for a in accesses(nest)
                                                      if a.written}:
        return None
    inner = fold_pair(first.body.stmts[-1], nest)
    return None if inner is None else replace(first, body=Block((*before.stmts, inner)))


def _fold_here(first, second):
    products = _products(first)
    if products is None:
        return None
    loop, pick = products
    pieces = [pick(v) for v in _values(loop)]
    if any(not g.panel for g in pieces):
        return None
    nest = _nest(second, pieces[0])
    if nest is None:
        return None
    base, stride, rows, cols, stmts = nest
    corner = _corners(loop, pick, base, stride, rows, cols)
    if corner is None:
        return None
    row, col = corner
    shift = {ROW: Affine.of(EPI_ROW) + row, COL: Affine.of(EPI_COL) + col}
    body = (*pieces[0].epilogue_body(),   # a second nest runs after the first one's
            *(rewrite(s, lambda n: _placed(n, shift)) for s in stmts))
    if not _safe(body, pieces[0], cols if rows > 1 else 0):
        return None
    return rewrite_statements(first, lambda g: replace(g, epilogue=epilogue(g.m, g.n, body))
                              if isinstance(g, Gemm) else None)


def epilogue(m: int, n: int, body) -> Block:
    """The epilogue of an ``m x n`` product that runs ``body`` on each element."""
    return Block((Loop(EPI_ROW, 0, m, Block((Loop(EPI_COL, 0, n, Block(tuple(body))),))),))


def _safe(body: tuple, g: Gemm, apart: int) -> bool:
    """Can ``g`` run ``body`` on each element as it stores it: every buffer it writes (but
    C) is written at an element of its own for each element of the region (columns
    contiguous, rows at least ``apart`` elements apart: the tiles may go in any order, on
    any thread), read nowhere else by it, and read by no product?"""
    written = {}
    for t in body:
        if isinstance(t.target, Ref):
            off = t.target.offset()
            if (off.coef(EPI_COL) != 1 or abs(off.coef(EPI_ROW)) < apart
                    or t.target.buffer in (g.a_buf, g.b_buf, g.c_buf)
                    or written.setdefault(t.target.buffer, off) != off):
                return False
    return all(n.offset() == written[n.buffer] for t in body for n in walk(t)
               if isinstance(n, Ref) and n.buffer in written)


def _placed(n, shift: dict):
    """A ref of the nest as an epilogue's (see :func:`_nest`): flat, over the block's row
    and column."""
    if isinstance(n, Ref):
        off = n.offset().substitute(ROW, shift[ROW]).substitute(COL, shift[COL])
        return Ref(n.buffer, (off,), (n.buffer.size,))
    return None


def _products(s):
    """``(loop, pick)``: ``s`` is a product (``loop`` None) or a parallel loop that runs
    ``pick(v)`` in iteration ``v`` (one product, or a thread's slice and a smaller last
    one, as :func:`~latte.compiler.passes.parallel.split_gemm` writes it); else None."""
    if isinstance(s, Gemm):
        return None, lambda v: s
    if not (isinstance(s, Loop) and s.kind is LoopKind.PARALLEL and len(s.body.stmts) == 1):
        return None
    body = s.body.stmts[0]
    if isinstance(body, Gemm):
        return s, lambda v: body
    if not (isinstance(body, If) and isinstance(body.cond, Compare) and body.cond.op == "<"
            and body.cond.lhs == Var(s.var) and isinstance(body.cond.rhs, Const)
            and len(body.then.stmts) == len(body.orelse.stmts) == 1
            and all(isinstance(b.stmts[0], Gemm) for b in (body.then, body.orelse))):
        return None
    last = body.cond.rhs.value
    return s, lambda v: body.then.stmts[0] if v < last else body.orelse.stmts[0]


def _values(loop: Loop | None) -> range:
    return range(1) if loop is None else range(loop.start, loop.stop)


def _nest(s, g: Gemm):
    """``(base, stride, rows, cols, stmts)``: ``s`` is a perfect nest of element-wise
    statements over a region of ``g``'s C, ``C[base + stride * row + col]``: its loops walk
    the columns, contiguous in C and no wider than its rows (a tile's rows of pixels), and
    one loop the rows, if the region has more than one (in any order: the statements touch
    other elements nowhere; loops of one item are no loops); ``stmts`` are its statements over
    :data:`ROW` and :data:`COL`, C's element as ``Var(EPI_C)``, where an epilogue can run
    them; else None."""
    chain = [s]
    while isinstance(chain[-1], Loop) and len(chain[-1].body.stmts) == 1 and isinstance(
            chain[-1].body.stmts[0], Loop):
        chain.append(chain[-1].body.stmts[0])
    if len(chain) < 2 or any(not isinstance(lp, Loop) or lp.start != 0 for lp in chain):
        return None
    ones = {lp.var: Affine() for lp in chain if lp.extent == 1}   # a loop of one item: 0
    stmts = [substitute(Assign(t.target, BinOp(t.op, Load(t.target), t.value), t.loc)
                        if isinstance(t, AugAssign) else t, ones) for t in chain[-1].body.stmts]
    chain = [lp for lp in chain if lp.extent > 1]
    if not chain or not stmts or not all(isinstance(t, Assign) and isinstance(t.target, Ref)
                                         for t in stmts):
        return None
    c_offs = [r.offset() for t in stmts for r in walk(t) if isinstance(r, Ref)
              and r.buffer is g.c_buf]
    if not c_offs or c_offs[0] is None or any(o != c_offs[0] for o in c_offs):
        return None
    c_off = c_offs[0]
    cols, col_terms, rows = 1, {}, []
    for lp in sorted(chain, key=lambda lp: c_off.coef(lp.var)):
        if not rows and c_off.coef(lp.var) == cols and cols * lp.extent <= g.ldc:
            col_terms[lp.var] = cols   # the columns: 1 apart, then as wide as those before
            cols *= lp.extent
        else:
            rows.append(lp)
    if len(rows) > 1 or (rows and c_off.coef(rows[0].var) < cols):
        return None
    row_var, stride = (rows[0].var, c_off.coef(rows[0].var)) if rows else (None, g.ldc)
    nest_vars = {lp.var for lp in chain}

    def flat(off: Affine | None) -> Affine | None:   # over ROW and COL, or None
        if off is None:
            return None
        col = 1 if any(off.coef(v) for v in col_terms) else 0
        if any(off.coef(v) != col * k for v, k in col_terms.items()):
            return None
        rest = {v: k for v, k in off.terms if v not in nest_vars}
        return Affine.build({**rest, ROW: off.coef(row_var) if row_var else 0, COL: col},
                            off.const)

    if any(flat(r.offset()) is None for t in stmts for r in walk(t)
           if isinstance(r, Ref) and r.buffer is not g.c_buf):
        return None
    if not all(_computable(t.value) for t in stmts):
        return None
    element = Var(EPI_C)

    def placed(n):
        if isinstance(n, Load) and isinstance(n.ref, Ref) and n.ref.buffer is g.c_buf:
            return element
        if isinstance(n, Ref):
            return Ref(n.buffer, (flat(n.offset()),), (n.buffer.size,))
        return None
    out = []
    for t in stmts:
        value = rewrite(t.value, placed)
        target = element if t.target.buffer is g.c_buf else placed(t.target)
        out.append(Assign(target, value, t.loc))
    base = Affine.build({v: k for v, k in c_off.terms if v not in nest_vars}, c_off.const)
    return base, stride, rows[0].extent if rows else 1, cols, out


def _computable(e) -> bool:
    """Is ``e`` an expression an epilogue computes (loads, float constants, :data:`OPS`,
    negation)?"""
    if isinstance(e, Load):
        return isinstance(e.ref, Ref)
    if isinstance(e, Const):
        return isinstance(e.value, float)
    if isinstance(e, BinOp):
        return e.op in OPS and _computable(e.lhs) and _computable(e.rhs)
    if isinstance(e, UnaryOp):
        return e.op == "neg" and _computable(e.operand)
    return False


def _corners(loop: Loop | None, pick, base: Affine, stride: int, rows: int, cols: int):
    """The first row and column of the nest's region that each iteration's product
    writes, affine in ``loop``'s variable, where those blocks together cover the region
    exactly once; else None."""
    blocks = []   # (row, col, height, width)
    for v in _values(loop):
        g = pick(v)
        off = g.c_off if loop is None else g.c_off.substitute(loop.var, Affine(const=v))
        rel = off - base
        if rel.vars or g.ldc != stride or rel.const < 0:
            return None
        row, col = divmod(rel.const, stride)
        if col + g.n > cols or row + g.m > rows:
            return None
        blocks.append((row, col, g.m, g.n))
    if sum(h * w for _, _, h, w in blocks) != rows * cols:
        return None
    for i, (r0, c0, h0, w0) in enumerate(blocks):   # no two overlap: with the area, a cover
        for r1, c1, h1, w1 in blocks[i + 1:]:
            if r0 < r1 + h1 and r1 < r0 + h0 and c0 < c1 + w1 and c1 < c0 + w0:
                return None
    out = []
    for k in (0, 1):
        first = blocks[0][k]
        step = blocks[1][k] - first if len(blocks) > 1 else 0
        if any(b[k] != first + step * i for i, b in enumerate(blocks)):
            return None
        out.append(Affine(const=first) if loop is None
                   else Affine.build({loop.var: step}, first - step * loop.start))
    return out[0], out[1]


def unstored(kernel: Kernel, dead: set) -> Kernel:
    """``kernel`` whose products with an epilogue into a C of ``dead`` (buffers nothing
    reads afterwards) that nothing else in it touches do not store C."""
    gemms = [g for g in walk(kernel.body) if isinstance(g, Gemm)]
    others = {a.buffer for a in accesses(kernel.body) if a.index is not None}
    for g in gemms:
        others |= {g.a_buf, g.b_buf} | ({g.c_buf} if g.epilogue is None else set())
    skipped = {g.c_buf for g in gemms if g.epilogue is not None and g.c_buf in dead} - others
    if not skipped:
        return kernel
    return replace(kernel, body=rewrite_statements(
        kernel.body, lambda g: replace(g, c_stored=False)
        if isinstance(g, Gemm) and g.c_buf in skipped else None))
