"""Weights packed once per pass for the GEMMs a time loop repeats.

A GEMM in a time loop's kernel runs at every step; where its B operand is a parameter
(nothing writes it during a pass), every step multiplies by the same block. A BLAS call
repacks that block each time (an LSTM's 4 MiB recurrent weight, 50 times a pass); here each
such GEMM gets a derived buffer holding ``op(B)`` packed in panels, ``[ceil(n / cols)][k]
[cols]`` with the last panel zero-padded, filled by a kernel that runs once before the loop,
and is marked ``panel`` so that codegen computes it with the register-tiled micro-kernel
(:mod:`latte.compiler.microkernel`).

The packing kernel repeats the loops around the GEMM that move its B block (a product split
across threads packs one block per thread, in parallel as the product runs) and the guards
on them; a GEMM under a guard on anything else is left to BLAS. Nothing looks at layer
types or names.
"""

from __future__ import annotations

import math
from dataclasses import replace

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
)
from latte.compiler.microkernel import tile
from latte.compiler.passes.data_copy import variables


def pack_weights(kernel: Kernel, bufs, params: frozenset[Buffer], vector: tuple[int, int]
                 ) -> tuple[Kernel, Kernel]:
    """``kernel`` with each GEMM whose B operand is in ``params`` reading a packed copy,
    and the kernel that packs them (empty if there is none); ``vector``: the host's vector
    registers, ``(bits, count)``."""
    lanes, registers = vector[0] // 32, vector[1]
    packs: list = []

    def visit(s, around: tuple):
        if isinstance(s, Gemm) and s.b_buf in params and not s.panel:
            packed = _packed(s, around, kernel.name, len(packs), bufs, lanes, registers)
            if packed is None:
                return s
            s, pack = packed
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

    body = visit(kernel.body, ())
    return (replace(kernel, body=body),
            Kernel(f"{kernel.name}_pack", Block(tuple(packs)), kernel.ensemble, kernel.phase))


def _packed(g: Gemm, around: tuple, name: str, index: int, bufs, lanes: int, registers: int):
    """``g`` reading its packed copy, and the nest filling that copy; None if a guard around
    ``g`` tests a variable that does not move its B block."""
    moving = g.b_off.vars
    loops = [s for s in around if isinstance(s, Loop) and s.var in moving]
    kept = {lp.var for lp in loops}
    guards = [s for s in around if not isinstance(s, Loop)]
    if any(not variables(cond.cond) <= kept for cond, _ in guards):
        return None
    rows, cols = tile(g.m, g.n, lanes, registers)
    panels = -(-g.n // cols)
    copies = math.prod(lp.extent for lp in loops)
    packed = bufs.derived((name, index, "packed"), f"{name}.packed{index}",
                          (copies, panels, g.k, cols))
    copy = Affine()
    for lp in loops:   # which copy: the moving loops' iteration, row-major
        copy = copy * lp.extent + Affine.of(lp.var) - lp.start
    gemm = replace(g, b_buf=packed, b_off=copy * (panels * g.k * cols), ldb=cols,
                   trans_b=False, panel=(rows, cols, lanes))

    p, k, j = "_pack_p", "_pack_k", "_pack_j"

    def fill(first: int, count: int, width: int) -> Loop:
        """Panels ``first .. first + count - 1``, their first ``width`` columns from B."""
        col = Affine.build({p: cols, j: 1})
        at = g.b_off + (col * g.ldb + Affine.of(k) if g.trans_b else Affine.of(k, g.ldb) + col)
        source = Load(Ref(g.b_buf, (at,), (g.b_buf.size,)))

        def columns(lo: int, hi: int, value) -> Loop:   # reading B along its rows
            store = Block((Assign(Ref(packed, (copy, Affine.of(p), Affine.of(k), Affine.of(j)),
                                      packed.shape), value),))
            if g.trans_b:
                return Loop(j, lo, hi, Block((Loop(k, 0, g.k, store),)))
            return Loop(k, 0, g.k, Block((Loop(j, lo, hi, store),)))

        inner = [columns(0, width, source)]
        if width < cols:
            inner.append(columns(width, cols, Const(0.0)))
        return Loop(p, first, first + count, Block(tuple(inner)))

    whole, tail = divmod(g.n, cols)
    nest = [fill(0, whole, cols)] if whole else []
    if tail:
        nest.append(fill(whole, 1, tail))
    stmt = Block(tuple(nest))
    for s in reversed(around):   # the moving loops and the guards, innermost first
        if isinstance(s, Loop):
            if s.var in kept:
                stmt = Block((replace(s, body=stmt),))
        else:
            guard, then = s
            stmt = Block((If(guard.cond, stmt) if then else If(guard.cond, Block(()), stmt),))
    return gemm, (stmt.stmts[0] if len(stmt.stmts) == 1 else stmt)

