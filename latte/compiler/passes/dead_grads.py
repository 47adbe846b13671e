"""Dead-gradient pruning: drop stores into gradients nobody reads.

A data ensemble fed from a dataset needs no gradient, so ``grad_inputs`` of the first layer
(for an FC layer, a whole GEMM) is not computed. Guarantees: only statements whose target
is a dead buffer are removed, then loops left empty.
"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.ir import Assign, AugAssign, Block, Buffer, If, Kernel, Loop, Ref


def prune_dead_gradients(kernel: Kernel, dead: frozenset[Buffer]) -> Kernel:
    """Remove stores into ``dead`` buffers from ``kernel``."""
    return replace(kernel, body=_block(kernel.body, dead))


def _block(block: Block, dead) -> Block:
    out = []
    for s in block.stmts:
        if isinstance(s, (Assign, AugAssign)) and isinstance(s.target, Ref) and s.target.buffer in dead:
            continue
        if isinstance(s, Loop):
            s = replace(s, body=_block(s.body, dead))
            if not s.body.stmts:
                continue
        elif isinstance(s, If):
            s = replace(s, then=_block(s.then, dead), orelse=_block(s.orelse, dead))
            if not s.then.stmts and not s.orelse.stmts:
                continue
        out.append(s)
    return Block(tuple(out))
