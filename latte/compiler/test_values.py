"""The values the ``Phase.TEST`` forward keeps in the shared arena instead of their buffers.

Training keeps every ensemble's values for backward; a test forward needs an intermediate
value only from the kernel that writes it to the last kernel that reads it. Such a value
lives in the arena (:attr:`~latte.compiler.program.Program.transient_layout`) for that
stretch of the test program alone, so a deep net's test forward walks a few megabytes that
stay in cache, not every layer's output (ResNet-50's at batch 1: 82 MiB). The test
forward runs the same native code on a table of its own that points these values into the
arena (:mod:`latte.runtime.memory`); their buffers keep the last training forward's values.

A value qualifies when the test program's kernels alone touch it, the first of them
stores it before anything reads it, and a later kernel (or the same one) reads it: not a
data ensemble's (Python fills it), not one a host step reads or writes (a loss's input, a
batch norm's statistics), not one a time loop touches, and not an output (nothing reads
it: what the user reads after the forward).
"""

from __future__ import annotations

from latte.compiler.ir import Assign, AugAssign, Gemm, Ref, accesses, children
from latte.compiler.program import HostStep, Segment, TimeSteps, flat_steps


def test_values(program) -> dict:
    """Per value ``program``'s test forward keeps in the arena, the kernels it lives across
    (their positions in :meth:`~latte.compiler.program.Program.test_kernels`)."""
    test, bufs, order = program.test, program.buffers, program.test_kernels()
    kept = set()
    for s in flat_steps(test):
        if isinstance(s, HostStep):
            kept |= {bufs.home(bufs.value(e))[0] for e in (*s.ensemble.inputs, s.ensemble)}
    for s in test:
        if isinstance(s, TimeSteps):
            kept |= {bufs.base(a.buffer) for t in flat_steps(s.steps) if isinstance(t, Segment)
                     for k in t.kernels for a in accesses(k.body)}
            kept |= {base for _, base, _ in s.views}
    first, last, read = {}, {}, set()
    for i, kernel in enumerate(order):
        for a in accesses(kernel.body):
            buf = a.buffer
            if buf.key[1:] != ("value",) or not buf.batched or buf in kept:
                continue
            first.setdefault(buf, i)
            last[buf] = i
            if not a.written:
                read.add(buf)
    return {buf: range(i, last[buf] + 1) for buf, i in first.items()
            if buf in read and _first_use(order[i].body, buf) == "store"}


def _first_use(node, buf) -> str | None:
    """How ``node`` first touches ``buf`` in execution order: ``"store"`` (every element it
    writes is overwritten), ``"update"`` (``+=``, a GEMM adding to it) or ``"read"``."""
    if isinstance(node, Gemm):   # its product, then its epilogue
        if buf in (node.a_buf, node.b_buf):
            return "read"
        if node.c_buf is buf:
            return "store" if node.beta == 0 else "update"
        return None if node.epilogue is None else _first_use(node.epilogue, buf)
    if isinstance(node, (Assign, AugAssign)) and isinstance(node.target, Ref):
        found = _first_use(node.value, buf) or next(
            filter(None, (_first_use(i, buf) for i in node.target.index)), None)
        if found is None and node.target.buffer is buf:
            return "store" if isinstance(node, Assign) else "update"
        return found
    if isinstance(node, Ref) and node.buffer is buf:
        return "read"
    return next(filter(None, (_first_use(c, buf) for c in children(node))), None)
