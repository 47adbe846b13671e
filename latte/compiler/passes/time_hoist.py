"""Parameter gradients out of a time loop: one nest over every step's items.

In a time loop's backward, an ensemble's parameter gradients sum one term per step, and
nothing in the loop reads them. A nest that only accumulates into parameter gradients can
therefore run once after the loop, over all ``T x batch`` rows of the buffers its step
views show: an LSTM's recurrent weight gradient becomes one GEMM with ``T x batch`` terms
instead of ``T`` GEMMs of ``batch`` terms, each reading and writing the whole gradient.

Legal because what such a nest reads is final when its step's backward runs: values, and
the ensemble's own gradient at step ``t`` (its readers at ``t`` ran before it, those at
``t + 1`` in the iteration before). A read of the step before (``x[t-1]``) is zero at step
0; the nest is hoisted only if that read is a factor of every term it adds, so step 0 adds
nothing and the hoisted nest runs over steps 1..T-1 (``x`` rows 0..T-2).
"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    Buffer,
    Gemm,
    If,
    Kernel,
    Load,
    Loop,
    Ref,
    accesses,
    rewrite,
    walk,
)
from latte.compiler.passes.tiling import is_batch_loop


def hoist_param_grads(kernel: Kernel, grads: frozenset[Buffer], final: frozenset[Buffer],
                      views: dict, steps: int) -> tuple[Kernel, Kernel]:
    """``kernel`` (a time loop's backward, over one step's items) without the nests that
    only add to ``grads``, and a kernel running those nests over all ``steps`` steps.
    ``final``: the gradient buffers whose step rows are final when ``kernel`` runs (its
    ensemble's own); ``views``: step view -> (buffer, shift)."""
    kept, hoisted = [], []
    for stmt in kernel.body.stmts:
        nest = _over_all_steps(stmt, grads, final, views, steps)
        (kept if nest is None else hoisted).append(stmt if nest is None else nest)
    return (replace(kernel, body=Block(tuple(kept))),
            replace(kernel, name=f"{kernel.name}_params", body=Block(tuple(hoisted))))


def _over_all_steps(stmt, grads, final, views: dict, steps: int) -> Loop | None:
    """``stmt`` (a batch loop over one step) as a loop over all steps, or None if it
    writes anything but ``grads``, reads a gradient that is not ``final``, or is not a
    nest of ``+=`` statements."""
    if not (is_batch_loop(stmt) and stmt.start == 0):
        return None
    found = accesses(stmt)
    rows = stmt.stop
    if any(a.written and a.buffer not in grads for a in found):
        return None
    stepped = [a for a in found if a.buffer in views]
    if any(a.index is None or a.index[0] != Affine.of(stmt.var) or a.view[0] != rows
           or (views[a.buffer][0].key[1] == "grad" and views[a.buffer][0] not in final)
           for a in stepped):
        return None
    statements = [s for s in walk(stmt.body) if isinstance(s, (Assign, AugAssign, If, Gemm))]
    if not all(isinstance(s, AugAssign) and s.op == "+" and isinstance(s.target, Ref)
               for s in statements):   # sums, in any order of the steps
        return None
    before = {a.buffer for a in stepped if views[a.buffer][1] < 0}
    if before and not all(_has_factor(s, before) for s in statements):
        return None
    skip = rows if before else 0   # step 0 adds nothing: run steps 1.. reading x[t-1] at t-1

    def to_base(node):
        if isinstance(node, Ref) and node.buffer in views:
            base, shift = views[node.buffer]
            row = Affine.of(stmt.var, 1, skip + shift * rows)
            return Ref(base, (row, *node.index[1:]), (base.shape[0], *node.view[1:]))
        return None

    return replace(rewrite(stmt, to_base), stop=rows * steps - skip)


def _has_factor(stmt, buffers: set) -> bool:
    """``stmt`` (a ``+=``) adds ``a * b * ...`` with a load of one of ``buffers`` among the
    factors (zero when that load is)."""
    factors, todo = [], [stmt.value]
    while todo:
        e = todo.pop()
        if isinstance(e, BinOp) and e.op == "*":
            todo += [e.lhs, e.rhs]
        else:
            factors.append(e)
    return any(isinstance(f, Load) and f.ref.buffer in buffers for f in factors)
