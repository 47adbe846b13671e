"""Step fusion: within a time loop, consecutive ensembles whose kernels are loops over the
step's batch items, and that share buffers only item by item (an LSTM's cell state and
hidden state), run as one batch loop: one item's rows stay in cache from the first
ensemble's work to the next one's, and the threads split one loop instead of several.

Legal when every buffer the two kernels share, and either writes, is accessed per item: the
batch index leads the access (the verifier keeps the rest of the index within the row).
"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.ir import Affine, Block, Kernel, Loop, accesses, substitute
from latte.compiler.passes.parallel import per_item
from latte.compiler.passes.tiling import is_batch_loop


def fuse_steps(plans: list, stepped: dict, phases: tuple) -> list[tuple[str, tuple[str, ...]]]:
    """Merge, in each time loop and phase, runs of consecutive members' kernels into the
    first kernel of the run (the others are left empty); returns each run's phase and
    ensemble names."""
    runs = []
    loops = list(dict.fromkeys(stepped[p.ensemble] for p in plans if p.ensemble in stepped))
    for loop in loops:
        members = sorted((p for p in plans if stepped.get(p.ensemble) is loop),
                         key=lambda p: loop.ensembles.index(p.ensemble))
        for phase in phases:
            order = members[::-1] if phase == "backward" else members
            owner = None
            for plan in order:
                kernel = plan.kernels[phase]
                if not kernel.body.stmts:
                    continue
                if owner is not None and _fusable(owner.kernels[phase], kernel):
                    owner.kernels[phase] = _merge(owner.kernels[phase], kernel)
                    plan.kernels[phase] = replace(kernel, body=Block(()))
                    if runs and runs[-1][0] == phase and runs[-1][1][0] == owner.ensemble.name:
                        runs[-1] = (phase, runs[-1][1] + (plan.ensemble.name,))
                    else:
                        runs.append((phase, (owner.ensemble.name, plan.ensemble.name)))
                    continue
                owner = plan
    return runs


def _batch_loops(kernel: Kernel) -> list[Loop] | None:
    stmts = kernel.body.stmts
    if stmts and all(isinstance(s, Loop) and is_batch_loop(s) and s.start == 0 for s in stmts):
        return list(stmts)
    return None


def _fusable(a: Kernel, b: Kernel) -> bool:
    la, lb = _batch_loops(a), _batch_loops(b)
    if la is None or lb is None or {lp.stop for lp in la + lb} != {la[0].stop}:
        return False
    found = [(lp.var, x) for lp in la + lb for x in accesses(lp)]
    in_a = {x.buffer for lp in la for x in accesses(lp)}
    in_b = {x.buffer for lp in lb for x in accesses(lp)}
    shared = {x.buffer for _, x in found if x.written} & in_a & in_b
    return all(per_item(x, var) and x.view[:1] == x.buffer.shape[:1]
               for var, x in found if x.buffer in shared)


def _merge(a: Kernel, b: Kernel) -> Kernel:
    """One batch loop running ``a``'s loop bodies, then ``b``'s, for each item."""
    first = a.body.stmts[0]
    body = []
    for lp in (*a.body.stmts, *b.body.stmts):
        body += substitute(lp.body, {lp.var: Affine.of(first.var)}).stmts
    return replace(a, body=Block((replace(first, body=Block(tuple(body))),)))
