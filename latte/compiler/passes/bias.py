"""Bias folding: a bias added to every row of a tiled product's output is added as the
product stores it.

A fully-connected layer's forward (and an LSTM's input and recurrent projections) is a GEMM
into ``C`` followed by the nest ``for i: for j: C[i, j] += bias[j]``: a second pass over
``C`` (13 MB for an LSTM's input projection over 50 steps of 32 items) and, in a time
loop, a second parallel region at every step. Where the GEMM is a register-tiled product
(:mod:`latte.compiler.microkernel`), run alone or split over threads by a parallel loop,
and the nest that follows it adds ``bias[j]`` to each element of exactly the region the
product's blocks write, the product adds the bias to each tile as it stores it and the
nest is dropped. The sum is rounded in the same order as before (product, then bias).
Products BLAS computes keep their nest. ``LATTE_FOLD_BIAS=0`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import replace

from latte.compiler.ir import (
    Affine,
    AugAssign,
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
    Var,
    rewrite,
)

ROW, COL = "bias.i", "bias.j"   # a bias nest's row and column, named as no loop variable is


def fold_bias(kernel: Kernel) -> Kernel:
    """``kernel`` with each bias nest that follows a tiled product folded into it."""
    if os.environ.get("LATTE_FOLD_BIAS") == "0":
        return kernel
    stmts, out = list(kernel.body.stmts), []
    i = 0
    while i < len(stmts):
        folded = _fold(stmts[i], stmts[i + 1]) if i + 1 < len(stmts) else None
        out.append(folded or stmts[i])
        i += 2 if folded else 1
    return kernel if len(out) == len(stmts) else replace(kernel, body=Block(tuple(out)))


def _fold(first, second):
    """``first`` (a tiled product, or a parallel loop running one per iteration) with the
    bias ``second`` adds folded in, or None."""
    products = _products(first)
    nest = _bias_nest(second)
    if products is None or nest is None:
        return None
    loop, pick = products
    c_ref, bias_ref, rows, cols = nest
    if bias_ref.buffer is c_ref.buffer or any(
            not g.panel or g.bias_buf is not None or g.c_buf is not c_ref.buffer
            for g in map(pick, _values(loop))):
        return None
    start = _columns(loop, pick, rows, cols)
    if start is None:
        return None
    # element j of the bias is at bias_off(j); a block's column 0 is column ``start`` of C
    bias_off = bias_ref.offset().substitute(COL, start)
    return rewrite(first, lambda n: replace(n, bias_buf=bias_ref.buffer, bias_off=bias_off)
                   if isinstance(n, Gemm) else None)


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


def _bias_nest(s):
    """``(C ref, bias ref, rows, cols)`` of ``for i in range(rows): for j in range(cols):
    C[cols * i + j] += bias[j + b]`` (``C`` rows ``cols`` long, so that ``ldc`` equals
    ``cols``), its offsets written over :data:`ROW` and :data:`COL`; else None."""
    if not (isinstance(s, Loop) and s.start == 0 and len(s.body.stmts) == 1):
        return None
    inner = s.body.stmts[0]
    if not (isinstance(inner, Loop) and inner.start == 0 and len(inner.body.stmts) == 1
            and inner.var != s.var):
        return None
    add = inner.body.stmts[0]
    if not (isinstance(add, AugAssign) and add.op == "+" and isinstance(add.target, Ref)
            and isinstance(add.value, Load)):
        return None
    rows, cols = s.stop, inner.stop
    names = {s.var: Affine.of(ROW), inner.var: Affine.of(COL)}
    c_off, b_off = add.target.offset(), add.value.ref.offset()
    if c_off is None or b_off is None:
        return None
    c_off, b_off = (_rename(o, names) for o in (c_off, b_off))
    if c_off != Affine.build({ROW: cols, COL: 1}) or b_off.vars != {COL} or b_off.coef(COL) != 1:
        return None
    c_ref = Ref(add.target.buffer, (c_off,), (add.target.buffer.size,))
    b_ref = Ref(add.value.ref.buffer, (b_off,), (add.value.ref.buffer.size,))
    return c_ref, b_ref, rows, cols


def _rename(a: Affine, names: dict[str, Affine]) -> Affine:
    """``a`` over the loop variables in ``names``; other variables stay."""
    for var, repl in names.items():   # the new names are no loop variable's: no capture
        a = a.substitute(var, repl)
    return a


def _columns(loop: Loop | None, pick, rows: int, cols: int) -> Affine | None:
    """The first column of the block each iteration's product writes, affine in ``loop``'s
    variable, where those blocks together cover the ``rows x cols`` region of ``C`` (rows
    ``cols`` long) exactly once; else None."""
    blocks = []   # (row, col, height, width)
    for v in _values(loop):
        g = pick(v)
        off = g.c_off if loop is None else g.c_off.substitute(loop.var, Affine(const=v))
        if off.vars or g.ldc != cols:
            return None
        row, col = divmod(off.const, cols)
        if off.const < 0 or col + g.n > cols or row + g.m > rows:
            return None
        blocks.append((row, col, g.m, g.n))
    if sum(h * w for _, _, h, w in blocks) != rows * cols:
        return None
    for i, (r0, c0, h0, w0) in enumerate(blocks):   # no two overlap: with the area, a cover
        for r1, c1, h1, w1 in blocks[i + 1:]:
            if r0 < r1 + h1 and r1 < r0 + h0 and c0 < c1 + w1 and c1 < c0 + w0:
                return None
    first = blocks[0][1]
    step = blocks[1][1] - first if len(blocks) > 1 else 0
    if any(b[1] != first + step * i for i, b in enumerate(blocks)):
        return None
    if loop is None:
        return Affine(const=first)
    return Affine.build({loop.var: step}, first - step * loop.start)
