"""Zero-init folding: the first writer of a zeroed buffer overwrites it instead.

A kernel zeroes a region of a buffer before writing it (a nest storing 0: the whole buffer,
or a zero-copy join's producer its run of each item of the join's buffer), and gradients are
zeroed whole when backward starts. A write ``W`` (a GEMM, an assignment or a ``+=``) may
overwrite instead of accumulate when

1. no access to the buffer, in any iteration, runs before ``W`` writes the element it
   touches: checked here as "``W`` is the only access to the buffer in its top-level
   statement, and no earlier top-level statement of the kernel touches the buffer" (an
   access in an earlier iteration of the same nest, e.g. a window's ``+=`` from the
   neighbouring neuron, would be wiped out otherwise);
2. ``W`` runs unconditionally (not under an ``if``) and does not read the buffer;
3. over its enclosing loops, ``W`` writes every element of the zeroed region exactly once
   and nothing else: both are affine offsets over loops starting at 0, and their
   :func:`region` (a mixed-radix normal form) is the same.

Then the zeroing is dropped and a GEMM runs with ``beta = 0``: one pass over the region
saved, and the write-allocate traffic of the memset.
"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.ir import (
    Assign,
    AugAssign,
    Block,
    Buffer,
    Const,
    Gemm,
    If,
    Kernel,
    Loop,
    Ref,
    accesses,
    rewrite,
)

Region = tuple[int, tuple[tuple[int, int], ...]]   # first element, (stride, extent) runs


def region(const: int, terms: list[tuple[int, int]]) -> Region | None:
    """The elements ``const + sum(stride * i)`` (``0 <= i < extent`` per term) in a normal
    form: terms of extent 1 dropped, sorted by stride, a term merged into the one before
    where it continues it. None unless every stride is positive and exceeds the span of the
    smaller ones (then each element is hit once, and equal forms mean equal sets)."""
    runs: list[tuple[int, int]] = []
    span = 0
    for stride, extent in sorted(t for t in terms if t[1] > 1):
        if stride <= span:
            return None
        if runs and runs[-1][0] * runs[-1][1] == stride:
            runs[-1] = (runs[-1][0], runs[-1][1] * extent)
        else:
            runs.append((stride, extent))
        span += stride * (extent - 1)
    return const, tuple(runs)


def whole(buf: Buffer) -> Region:
    return 0, ((1, buf.size),)


def _zeroed(s) -> tuple[Buffer, Region] | None:
    """The buffer and region a nest of loops from 0 storing 0 clears, if ``s`` is one."""
    loops = []
    while isinstance(s, Loop) and s.start == 0 and len(s.body.stmts) == 1:
        loops.append(s)
        s = s.body.stmts[0]
    if not (loops and isinstance(s, Assign) and isinstance(s.target, Ref) and s.value == Const(0.0)):
        return None
    found = _written_region(s.target.offset(), loops, [])
    return None if found is None else (s.target.buffer, found)


def _written_region(off, loops, extra: list[tuple[int, int]]) -> Region | None:
    """What a write at affine offset ``off`` (plus GEMM block terms ``extra``) reaches over
    ``loops``, if every variable of ``off`` is theirs."""
    loop_vars = {lp.var for lp in loops}
    if off is None or any(v not in loop_vars for v in off.vars) or any(lp.start for lp in loops):
        return None
    return region(off.const, [(off.coef(lp.var), lp.extent) for lp in loops] + extra)


def _in_order(s, loops=()):
    """Statements and GEMMs below ``s`` in execution order, with their enclosing loops;
    a conditional region comes whole, with ``None`` for loops (its writes may not happen)."""
    if isinstance(s, Loop):
        for c in s.body.stmts:
            yield from _in_order(c, (*loops, s))
    elif isinstance(s, Block):
        for c in s.stmts:
            yield from _in_order(c, loops)
    elif isinstance(s, If):
        yield s, None
    else:
        yield s, loops


def _first_write(s, buf: Buffer, zeroed: Region):
    """The statement of ``s`` that touches ``buf``, if it is the only one and overwrites
    exactly the ``zeroed`` region of it (properties 1-3 of the module docstring)."""
    if sum(a.buffer is buf for a in accesses(s)) != 1:
        return None
    for node, loops in _in_order(s):
        if buf not in _touched(node):
            continue
        if loops is None:
            return None
        if isinstance(node, Gemm):
            off, extra = node.c_off, [(1, node.n), (node.ldc, node.m)]
            ok = node.c_buf is buf and node.beta == 1.0
        elif isinstance(node, (Assign, AugAssign)) and isinstance(node.target, Ref):
            off, extra = node.target.offset(), []
            ok = node.target.buffer is buf and (isinstance(node, Assign) or node.op == "+")
        else:
            return None
        return node if ok and _written_region(off, loops, extra) == zeroed else None
    return None


def _touched(s) -> set[Buffer]:
    return {a.buffer for a in accesses(s)}


def fold_zero_init(kernel: Kernel, zeroed: frozenset[Buffer] = frozenset()
                   ) -> tuple[Kernel, frozenset[Buffer]]:
    """Fold zeroing into first writers: GEMMs (``beta = 0``), stores, and ``+=`` (to ``=``).

    ``zeroed``: buffers cleared before the kernel runs (by the runtime's zero step).
    Returns the new kernel and the subset of ``zeroed`` that no longer needs clearing.
    """
    stmts = list(kernel.body.stmts)
    # buffer -> (index of its zero nest (None: zeroed before the kernel), the region zeroed)
    pending: dict[Buffer, tuple[int | None, Region]] = {b: (None, whole(b)) for b in zeroed}
    folded: dict[Buffer, int | None] = {}
    for i, s in enumerate(stmts):
        clear = _zeroed(s)
        if clear is not None:
            pending[clear[0]] = (i, clear[1])
            continue
        touched = _touched(s)
        for b in [b for b in pending if b in touched]:
            first = _first_write(s, b, pending[b][1])
            if first is not None:
                folded[b] = pending[b][0]
                if isinstance(first, Gemm):
                    stmts[i] = rewrite(stmts[i], lambda n, g=first: replace(n, beta=0.0)
                                       if n is g else None)
                elif isinstance(first, AugAssign):   # ``+=`` on zeros: a plain store
                    stmts[i] = rewrite(stmts[i], lambda n, a=first: Assign(a.target, a.value)
                                       if n is a else None)
        for b in touched:
            pending.pop(b, None)
    drop = {i for i in folded.values() if i is not None}
    body = Block(tuple(s for i, s in enumerate(stmts) if i not in drop))
    return replace(kernel, body=body), frozenset(b for b, i in folded.items() if i is None)
