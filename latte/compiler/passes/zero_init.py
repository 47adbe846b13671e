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
   :func:`region` (a mixed-radix normal form) is the same. Several stores under alike
   loops (the same ones, or sibling loops of the same variables and bounds), at offsets
   that differ by constants (a Winograd 2x2 output tile, an LSTM step's four gates), may be
   ``W`` together: the constants count as more runs of the region. As they then write
   disjoint elements and read none, their order does not matter.

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
    rewrite_statements,
    touched,
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


def zeroed_region(s) -> tuple[Buffer, Region] | None:
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


def _first_write(s, buf: Buffer, zeroed: Region) -> list:
    """The statements of ``s`` that touch ``buf``, if they overwrite exactly the ``zeroed``
    region of it and nothing else does (properties 1-3 of the module docstring): one GEMM or
    store, or several stores under the same loops whose offsets differ by constants (the
    four outputs of a Winograd 2x2 tile). Empty if not."""
    mine = [a for a in accesses(s) if a.buffer is buf]
    if not mine or not all(a.written for a in mine):   # a read: not the first writer alone
        return []
    found = [(node, loops) for node, loops in _in_order(s) if buf in touched(node)]
    if len(found) != len(mine):
        return []
    loops = found[0][1]
    if loops is None or not all(ls is not None and _headers(ls) == _headers(loops)
                                for _, ls in found):   # alike loops (the same, or siblings)
        return []
    offsets, extra = [], []
    for node, _ in found:
        if isinstance(node, Gemm) and len(found) == 1:
            off, extra = node.c_off, [(1, node.n), (node.ldc, node.m)]
            ok = node.c_buf is buf and node.beta == 1.0
        elif isinstance(node, (Assign, AugAssign)) and isinstance(node.target, Ref):
            off = node.target.offset()
            ok = node.target.buffer is buf and (isinstance(node, Assign) or node.op == "+")
        else:
            return []
        if not ok or off is None:
            return []
        offsets.append(off)
    first = min(off.const for off in offsets)
    base = offsets[0] - offsets[0].const + first
    digits = _digits({off.const - first for off in offsets})
    if digits is None or len(set(offsets)) != len(offsets) or any(
            off - off.const + first != base for off in offsets):   # each element once
        return []
    return [n for n, _ in found] if _written_region(base, loops, extra + digits) == zeroed else []


def _headers(loops) -> list[tuple[str, int, int]]:
    return [(lp.var, lp.start, lp.stop) for lp in loops]


def _digits(consts: set[int]) -> list[tuple[int, int]] | None:
    """``consts`` (holding 0) as the sums of one value from each of some runs ``{0, stride,
    ..., (extent - 1) * stride}`` (``{0, 1, W, W + 1}``: ``(1, 2), (W, 2)``), or None."""
    out = []
    while len(consts) > 1:
        stride = min(c for c in consts if c)
        extent = 1
        while extent * stride in consts:
            extent += 1
        rest = {c for c in consts if c - stride not in consts}
        if len(rest) * extent != len(consts) or any(
                r + j * stride not in consts for r in rest for j in range(extent)):
            return None
        out.append((stride, extent))
        consts = rest
    return out


def _overwrite(node, writers: list):
    """``node`` with ``writers`` (statements of it) as first writers of zeros, which
    overwrite: a GEMM with ``beta = 0``, a ``+=`` as a plain store."""
    def first(n):
        if not any(n is w for w in writers):
            return None
        if isinstance(n, Gemm):
            return replace(n, beta=0.0)
        return Assign(n.target, n.value) if isinstance(n, AugAssign) else n
    return rewrite_statements(node, first)


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
        clear = zeroed_region(s)
        if clear is not None:
            pending[clear[0]] = (i, clear[1])
            continue
        used = touched(s)
        for b in [b for b in pending if b in used]:
            first = _first_write(s, b, pending[b][1])
            if first:
                folded[b] = pending[b][0]
                stmts[i] = _overwrite(stmts[i], first)
        for b in used:
            pending.pop(b, None)
    drop = {i for i in folded.values() if i is not None}
    body = Block(tuple(s for i, s in enumerate(stmts) if i not in drop))
    return replace(kernel, body=body), frozenset(b for b, i in folded.items() if i is None)


def fold_across(kernels: list[Kernel], buf: Buffer) -> list[Kernel] | None:
    """``kernels``, run in this order over a zeroed ``buf`` that nothing else touches in
    between, with the writes that overwrite it rewritten: those of their statements touching
    ``buf`` up to the first that reads it, taken as one statement (properties 1-3); what
    reads it later sees it whole. None if they do not overwrite it."""
    touching = []
    for s in (s for k in kernels for s in k.body.stmts if buf in touched(s)):
        if not all(a.written for a in accesses(s) if a.buffer is buf):
            break
        touching.append(s)
    first = _first_write(Block(tuple(touching)), buf, whole(buf))
    if not first:
        return None
    return [replace(k, body=_overwrite(k.body, first)) for k in kernels]
