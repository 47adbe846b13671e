"""Loop coalescing: two nested loops that walk every buffer as one run become one loop.

``for a in range(A): for b in range(B): body``, where the body is straight-line code and
``a`` and ``b`` occur only in affine buffer references, each with ``coef(a) == B *
coef(b)``, visits the same addresses in the same order as one loop of ``A * B``
iterations over ``b``. Rows of an element-wise nest at deep layers are short (7 to 28
floats): LLVM fully unrolls such a constant trip count before it vectorizes and then packs
the copies into 4-float vectors (a batch norm + add + ReLU over 14 x 28 rows ran at a
quarter of its speed); one loop of 392 vectorizes at the host's width. Innermost pairs
first, so a nest merges as far out as its references stay contiguous. Loops a parallel
loop collapses with stay as they are. ``LATTE_COALESCE=0`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import replace

from latte.compiler.ir import (
    Affine,
    Block,
    Gemm,
    If,
    Kernel,
    Loop,
    LoopKind,
    Ref,
    Var,
    children,
    rewrite,
    substitute,
)


def coalesce_loops(kernel: Kernel) -> Kernel:
    """``kernel`` with every coalescible pair of nested loops merged (innermost first)."""
    if os.environ.get("LATTE_COALESCE") == "0":
        return kernel
    return replace(kernel, body=_block(kernel.body, 0))


def _block(block: Block, collapsed: int) -> Block:
    only = collapsed if len(block.stmts) == 1 else 0
    stmts = tuple(_stmt(s, only) for s in block.stmts)
    return block if all(a is b for a, b in zip(stmts, block.stmts)) else Block(stmts)


def _stmt(s, collapsed: int):
    """``s`` with the loops in it coalesced; ``collapsed``: how many loops from here down
    belong to a parallel loop's collapsed nest."""
    if isinstance(s, If):
        then, orelse = _block(s.then, 0), _block(s.orelse, 0)
        return s if then is s.then and orelse is s.orelse else replace(s, then=then, orelse=orelse)
    if not isinstance(s, Loop):
        return s
    inside = dict(s.meta).get("collapse", 1) - 1 if s.kind is LoopKind.PARALLEL else 0
    body = _block(s.body, max(collapsed - 1, inside))
    if body is not s.body:
        s = replace(s, body=body)
    if collapsed or s.kind is LoopKind.PARALLEL or len(s.body.stmts) != 1:
        return s
    inner = s.body.stmts[0]
    if not isinstance(inner, Loop) or inner.kind is LoopKind.PARALLEL:
        return s
    return _merged(s, inner) or s


def _merged(outer: Loop, inner: Loop) -> Loop | None:
    """The one loop ``outer`` and ``inner`` (its only statement) amount to, or None."""
    a, b, extent = outer.var, inner.var, inner.extent
    if not _coalescible(inner.body, a, b, extent):
        return None
    shift = {a: Affine(const=outer.start), b: Affine.of(b, 1, inner.start)}

    def flat(node) -> Ref | None:
        off = node.offset() if isinstance(node, Ref) else None
        if off is None or not off.vars & {a, b}:
            return None
        return Ref(node.buffer, (substitute(off, shift),), (node.buffer.size,))

    return replace(inner, start=0, stop=outer.extent * extent, body=rewrite(inner.body, flat))


def _coalescible(body: Block, a: str, b: str, extent: int) -> bool:
    """Whether ``a`` and ``b`` occur in ``body`` (no loops or products in it) only in affine
    references with ``coef(a) == extent * coef(b)``."""
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, (Loop, Gemm)):
            return False
        if isinstance(node, Var) and node.name in (a, b):
            return False
        if isinstance(node, Affine) and node.vars & {a, b}:
            return False
        if isinstance(node, Ref) and node.offset() is not None:
            off = node.offset()
            if off.coef(a) != extent * off.coef(b):
                return False
            continue
        stack.extend(children(node))
    return True
