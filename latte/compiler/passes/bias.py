"""Bias folding: a bias added to a tiled product's output, and a ReLU after it, are applied
as the product stores its tiles.

A fully-connected layer's forward (and an LSTM's input and recurrent projections) is a GEMM
into ``C`` followed by the nest ``for i: for j: C[i, j] += bias[j]``: a second pass over
``C`` (13 MB for an LSTM's input projection over 50 steps of 32 items) and, in a time
loop, a second parallel region at every step. A convolution's tile is a GEMM followed by
``for c: for p: C[c, p] += bias[c]`` and, with a ReLU after it (fused in the same group),
``C[c, p] = max(C[c, p], 0)``: a second pass over each tile. Where the GEMM is a register-tiled
product (:mod:`latte.compiler.microkernel`), run alone or split over threads by a parallel
loop, and the nest right after it (at any depth of the kernel) does those steps to
exactly the region the product's blocks write, the product does them to each tile as it
stores it and the nest is dropped. The values are rounded in the same order as before
(product, bias, then the ReLU's comparison). Products BLAS computes keep their nest.
``LATTE_FOLD_BIAS=0`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    Buffer,
    Compare,
    Const,
    Gemm,
    If,
    Kernel,
    Load,
    Loop,
    LoopKind,
    Ref,
    Var,
    rewrite_statements,
)

ROW, COL = "bias.i", "bias.j"   # a nest's row and column, named as no loop variable is


def fold_bias(kernel: Kernel) -> Kernel:
    """``kernel`` with each bias (and ReLU) nest that follows a tiled product folded into it."""
    if os.environ.get("LATTE_FOLD_BIAS") == "0":
        return kernel
    return replace(kernel, body=_block(kernel.body))


def _block(block: Block) -> Block:
    out: list = []
    for s in block.stmts:
        s = _inner(s)
        folded = _fold(out[-1], s) if out else None
        if folded is None:
            out.append(s)
        else:   # the bias nest, then the ReLU nest after it
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


@dataclass(frozen=True)
class _Nest:
    """``for i in range(rows): for j in range(cols):`` ``C[base + stride * i + j] +=
    bias[...]`` (``bias`` a ref over :data:`ROW` or :data:`COL` alone; None without one),
    then, with ``relu``, ``C[...] = max(C[...], 0)``."""

    c_buf: Buffer
    base: Affine
    stride: int
    rows: int
    cols: int
    bias: Ref | None
    relu: bool


def _fold(first, second):
    """``first`` (a tiled product, or a parallel loop running one per iteration) with the
    nest ``second`` folded in, or None."""
    products = _products(first)
    nest = _nest(second)
    if products is None or nest is None:
        return None
    loop, pick = products
    pieces = [pick(v) for v in _values(loop)]
    if any(not g.panel or g.relu or g.c_buf is not nest.c_buf
           or (nest.bias is not None and (g.bias_buf is not None or nest.bias.buffer is g.c_buf))
           for g in pieces):
        return None
    corner = _corners(loop, pick, nest)
    if corner is None:
        return None
    row, col = corner
    fields = {"relu": nest.relu}
    if nest.bias is not None:
        by_row = ROW in nest.bias.offset().vars
        fields.update(bias_buf=nest.bias.buffer, bias_rows=by_row,
                      bias_off=nest.bias.offset().substitute(ROW if by_row else COL,
                                                             row if by_row else col))
    return rewrite_statements(first, lambda n: replace(n, **fields) if isinstance(n, Gemm)
                              else None)


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


def _nest(s) -> _Nest | None:
    """``s`` as a :class:`_Nest`: a perfect nest whose first loop walks the rows and the
    others (one or more, contiguous in C: a tile's rows of pixels) its columns, the bias's
    and C's offsets written over :data:`ROW` and :data:`COL`."""
    chain = [s]
    while isinstance(chain[-1], Loop) and len(chain[-1].body.stmts) == 1 and isinstance(
            chain[-1].body.stmts[0], Loop):
        chain.append(chain[-1].body.stmts[0])
    if len(chain) < 2 or any(not isinstance(lp, Loop) or lp.start != 0 for lp in chain):
        return None
    stmts = list(chain[-1].body.stmts)
    add = stmts.pop(0) if stmts and isinstance(stmts[0], AugAssign) else None
    relu = stmts.pop(0) if stmts and isinstance(stmts[0], Assign) else None
    if stmts or (add or relu) is None or not isinstance((add or relu).target, Ref):
        return None
    c_ref = (add or relu).target
    c_off = c_ref.offset()
    if c_off is None:
        return None
    cols = 1
    for lp in reversed(chain[1:]):   # the column loops: contiguous, the last innermost
        if c_off.coef(lp.var) != cols:
            return None
        cols *= lp.extent
    row_var, col_terms = chain[0].var, {lp.var: c_off.coef(lp.var) for lp in chain[1:]}
    stride = c_off.coef(row_var)
    if stride < cols:
        return None
    bias = None
    if add is not None:
        if not (add.op == "+" and isinstance(add.value, Load) and isinstance(add.value.ref, Ref)):
            return None
        b_off = add.value.ref.offset()
        if b_off is None:
            return None
        if b_off.terms == ((row_var, 1),):
            b_off = Affine.build({ROW: 1}, b_off.const)
        elif dict(b_off.terms) == col_terms:
            b_off = Affine.build({COL: 1}, b_off.const)
        else:
            return None
        bias = Ref(add.value.ref.buffer, (b_off,), (add.value.ref.buffer.size,))
    if relu is not None and not _is_relu(relu, c_ref.buffer, c_off):
        return None
    base = Affine.build({v: k for v, k in c_off.terms if v != row_var and v not in col_terms},
                        c_off.const)
    return _Nest(c_ref.buffer, base, stride, chain[0].extent, cols, bias, relu is not None)


def _is_relu(stmt, buf, off: Affine) -> bool:
    """``stmt`` is ``buf[off] = max(buf[off], 0)``."""
    v = stmt.value
    return (isinstance(stmt.target, Ref) and stmt.target.buffer is buf
            and stmt.target.offset() == off and isinstance(v, BinOp) and v.op == "max"
            and isinstance(v.lhs, Load) and isinstance(v.lhs.ref, Ref)
            and v.lhs.ref.buffer is buf and v.lhs.ref.offset() == off and v.rhs == Const(0.0))


def _corners(loop: Loop | None, pick, nest: _Nest) -> tuple[Affine, Affine] | None:
    """The first row and column of the nest's region that each iteration's product
    writes, affine in ``loop``'s variable, where those blocks together cover the region
    exactly once; else None."""
    blocks = []   # (row, col, height, width)
    for v in _values(loop):
        g = pick(v)
        off = g.c_off if loop is None else g.c_off.substitute(loop.var, Affine(const=v))
        rel = off - nest.base
        if rel.vars or g.ldc != nest.stride or rel.const < 0:
            return None
        row, col = divmod(rel.const, nest.stride)
        if col + g.n > nest.cols or row + g.m > nest.rows:
            return None
        blocks.append((row, col, g.m, g.n))
    if sum(h * w for _, _, h, w in blocks) != nest.rows * nest.cols:
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
