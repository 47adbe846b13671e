"""Zero-init folding: a GEMM that is the first writer of a zeroed buffer overwrites it.

``value`` is zero when forward starts and gradients are zeroed when backward starts; when
the first statement touching such a buffer is a top-level GEMM covering all of it, the
zeroing is dropped and the GEMM runs with ``beta = 0`` (one pass over C saved, and the
write-allocate traffic of the memset).
"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.ir import Assign, Block, Buffer, Const, Gemm, Kernel, Loop, Ref, walk


def _zeroed_buffer(s) -> Buffer | None:
    """The buffer a flat ``buf[i] = 0`` loop over all of ``buf`` clears, if ``s`` is one."""
    if (isinstance(s, Loop) and s.start == 0 and len(s.body.stmts) == 1
            and isinstance(s.body.stmts[0], Assign)):
        a = s.body.stmts[0]
        if (isinstance(a.target, Ref) and a.value == Const(0.0) and s.stop == a.target.buffer.size
                and len(a.target.index) == 1):
            return a.target.buffer
    return None


def _covers(g: Gemm) -> bool:
    return (not g.c_off.terms and g.c_off.const == 0 and g.ldc == g.n
            and g.m * g.n == g.c_buf.size)


def _touched(s) -> set[Buffer]:
    out = {n.buffer for n in walk(s) if isinstance(n, Ref)}
    out |= {b for n in walk(s) if isinstance(n, Gemm) for b in (n.a_buf, n.b_buf, n.c_buf)}
    return out


def fold_zero_init(kernel: Kernel, zeroed: frozenset[Buffer] = frozenset()
                   ) -> tuple[Kernel, frozenset[Buffer]]:
    """Fold zeroing into first-writer GEMMs.

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
        if isinstance(s, Gemm) and s.c_buf in pending and s.beta == 1.0 and _covers(s) \
                and s.c_buf not in (s.a_buf, s.b_buf):
            folded[s.c_buf] = pending.pop(s.c_buf)
            stmts[i] = replace(s, beta=0.0)
        for b in _touched(stmts[i]):
            pending.pop(b, None)
    drop = {i for i in folded.values() if i is not None}
    body = Block(tuple(s for i, s in enumerate(stmts) if i not in drop))
    return replace(kernel, body=body), frozenset(b for b, i in folded.items() if i is None)
