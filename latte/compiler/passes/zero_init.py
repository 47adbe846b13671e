"""Zero-init folding: the first writer of a zeroed buffer overwrites it instead.

``value`` is zero when forward starts and gradients are zeroed when backward starts. A
write ``W`` (a GEMM, an assignment or a ``+=``) may overwrite instead of accumulate when

1. no access to the buffer, in any iteration, runs before ``W`` writes the element it
   touches: checked here as "``W`` is the only access to the buffer in its top-level
   statement, and no earlier top-level statement of the kernel touches the buffer" (an
   access in an earlier iteration of the same nest, e.g. a window's ``+=`` from the
   neighbouring neuron, would be wiped out otherwise);
2. ``W`` runs unconditionally (not under an ``if``) and does not read the buffer;
3. over its enclosing loops, ``W`` writes every element exactly once (a mixed-radix check
   on the affine offset, loops starting at 0).

Then the zeroing is dropped and a GEMM runs with ``beta = 0``: one pass over the buffer
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


def _zeroed_buffer(s) -> Buffer | None:
    """The buffer a flat ``buf[i] = 0`` loop over all of ``buf`` clears, if ``s`` is one."""
    if (isinstance(s, Loop) and s.start == 0 and len(s.body.stmts) == 1
            and isinstance(s.body.stmts[0], Assign)):
        a = s.body.stmts[0]
        if (isinstance(a.target, Ref) and a.value == Const(0.0) and s.stop == a.target.buffer.size
                and len(a.target.index) == 1):
            return a.target.buffer
    return None


def _exact_cover(terms: list[tuple[int, int]], size: int) -> bool:
    """``sum(stride * i)`` over ``0 <= i < extent`` hits each of ``0..size-1`` exactly once."""
    expected = 1
    for stride, extent in sorted(t for t in terms if t[1] > 1):   # a stride of 0 repeats
        if stride != expected:
            return False
        expected *= extent
    return expected == size


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


def _first_write(s, buf: Buffer):
    """The statement of ``s`` that touches ``buf``, if it is the only one and overwrites all
    of it (properties 1-3 of the module docstring)."""
    if sum(a.buffer is buf for a in accesses(s)) != 1:
        return None
    for node, loops in _in_order(s):
        if buf not in _touched(node):
            continue
        if loops is None or any(lp.start != 0 for lp in loops):
            return None
        if isinstance(node, Gemm):
            off, extra = node.c_off, [(1, node.n), (node.ldc, node.m)]
            ok = node.c_buf is buf and node.beta == 1.0
        elif isinstance(node, (Assign, AugAssign)) and isinstance(node.target, Ref):
            off, extra = node.target.offset(), []
            ok = node.target.buffer is buf and (isinstance(node, Assign) or node.op == "+")
        else:
            return None
        loop_vars = {lp.var for lp in loops}
        if not ok or off is None or off.const or any(v not in loop_vars or c <= 0 for v, c in off.terms):
            return None
        terms = [(off.coef(lp.var), lp.extent) for lp in loops] + extra
        return node if _exact_cover(terms, buf.size) else None
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
    pending = {b: None for b in zeroed}       # buffer -> index of its zero loop (None: outside)
    folded: dict[Buffer, int | None] = {}
    for i, s in enumerate(stmts):
        buf = _zeroed_buffer(s)
        if buf is not None:
            pending[buf] = i
            continue
        touched = _touched(s)
        for b in [b for b in pending if b in touched]:
            first = _first_write(s, b)
            if first is not None:
                folded[b] = pending[b]
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
