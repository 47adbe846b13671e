"""Scheduling: optimized kernels -> the runtime's step lists (segments of native code and
host steps per phase) and the gradient-zeroing kernel. (A solver's update kernels are built
when it first runs: ``latte.compiler.update``.)"""

from __future__ import annotations

from dataclasses import replace

from latte.compiler.buffers import BufferPlan, storage_owner
from latte.compiler.fingerprint import shape
from latte.compiler.ir import Block, Kernel, accesses
from latte.compiler.passes import drop_stores, epilogue, keep_in_locals, localize
from latte.compiler.program import AFTER_LOOP, BEFORE_LOOP, HostStep, Segment, TimeSteps
from latte.compiler.synthesis import zero_loop
from latte.errors import CompileError
from latte.lang import ActivationEnsemble, Ensemble, NormalizationEnsemble, Phase


def phase_steps(ensembles, by_ens, phase: str, prefix: str, split: bool = False,
                loops: dict | None = None, bufs: BufferPlan | None = None) -> list:
    """Consecutive kernels grouped into segments (one per kernel when ``split``); the
    ensembles of a time loop (``loops``: ensemble -> :class:`~latte.lang.time.TimeLoop`)
    into one :class:`TimeSteps` step, backward in reverse."""
    steps, run = [], []
    loops = loops or {}
    ensembles = list(ensembles)

    def flush():
        if run:
            steps.append(Segment(f"{prefix}{len(steps)}", tuple(run)))
            run.clear()

    for ens in ensembles:
        if ens in loops:
            loop = loops[ens]
            if ens is (loop.ensembles[-1] if phase == "backward" else loop.ensembles[0]):
                members = [e for e in ensembles if loops.get(e) is loop]
                for plan in (by_ens[e] for e in members if e in by_ens):   # weights packed
                    if BEFORE_LOOP[phase] in plan.kernels:
                        run.append(plan.kernels[BEFORE_LOOP[phase]])
                        if split:
                            flush()
                flush()
                inner = phase_steps(members, by_ens, phase, f"{prefix}{len(steps)}t", split)
                steps.append(TimeSteps(f"{prefix}{len(steps)}", tuple(inner),
                                       phase == "backward", _views(inner, bufs), tuple(members)))
                if phase == "backward":   # parameter gradients over all steps
                    for plan in (by_ens[e] for e in members if e in by_ens):
                        if AFTER_LOOP in plan.kernels:
                            run.append(plan.kernels[AFTER_LOOP])
                            if split:
                                flush()
        elif ens in by_ens:
            kernel = by_ens[ens].kernels[phase]
            if kernel.body.stmts:
                run.append(kernel)
                if split:
                    flush()
        elif isinstance(ens, NormalizationEnsemble):
            flush()
            steps.append(HostStep(ens, phase))
    flush()
    return steps


def _views(steps: list, bufs: BufferPlan) -> tuple:
    """``(view, buffer, shift)`` of every step view the segments ``steps`` use."""
    found = {a.buffer for s in steps for k in s.kernels for a in accesses(k.body)
             if a.buffer in bufs.views}
    return tuple((v, *bufs.views[v]) for v in sorted(found, key=lambda b: b.name))


def test_steps(forward: list, groups: list, bufs: BufferPlan, test_groups: list = ()) -> list:
    """The forward steps of ``Phase.TEST``. No backward follows, so ``Batch`` fields that
    forward only writes (a max-pool's arg-max) are not stored, and each fused group keeps
    the intermediate values nothing after it reads (its members' but the last one's) in
    per-thread line buffers, or in locals where the next statements read them back at once.
    Host steps that ignore their inputs in the test phase (a batch norm's statistics, from
    ``net.state``) run first, and kernels whose values only such steps read (the
    statistics' partial sums) do not run: their values are stale in TEST.
    Each of ``test_groups`` (fused in this phase alone) runs its kernel ``"test"`` in place
    of its members' kernels; a nest that starts a kernel folds into the previous kernel's
    product (:func:`_fold_across`), and a product whose output nothing but its epilogue
    reads does not store it."""
    steps, pairs = _fold_across(_with_test_groups(_hoist_and_prune(forward, bufs), test_groups))
    kernels = [k for s in steps if isinstance(s, Segment) for k in s.kernels]
    found = [accesses(k.body) for k in kernels]
    hosts = {bufs.value(i) for s in steps if isinstance(s, HostStep)
             and s.ensemble.reads_inputs(Phase.TEST) for i in s.ensemble.inputs}
    looped = {bufs.base(b) for s in steps if isinstance(s, TimeSteps) for b in _reads(s)}
    read = hosts | looped | {a.buffer for f in found for a in f if not a.written}
    dead = {a.buffer for f in found for a in f if a.written and a.buffer.batched
            and a.buffer.key[1] not in ("value", "grad")} - read
    members = {g.owner("forward").kernels["forward"].name: [p.ensemble for p in g.plans]
               for g in groups}
    members |= {g.owner("forward").kernels["test"].name: [p.ensemble for p in g.plans]
                for g in test_groups}
    for name, (a, b) in pairs.items():   # a kernel and the next one folded into it: a group
        members[name] = members.get(name, [a.ensemble]) + members.get(b.name, [b.ensemble])
    test = {}
    for i, k in enumerate(kernels):
        kernel = drop_stores(k, dead)
        if k.name in members:
            ensembles = members[k.name]
            # the buffers the kernels access (a zero-copy join's, for its inputs)
            values = [bufs.value_home(e) for e in ensembles]
            # an in-place activation of an input from outside the group (a data ensemble)
            # reads that input's buffer: it is no intermediate of the group
            outside = {v for e, v in zip(ensembles, values)
                       if storage_owner(e) not in set(ensembles)}
            elsewhere = hosts | looped | outside | {a.buffer for j, f in enumerate(found)
                                                    if j != i for a in f}
            inner = set(values[:-1]) - {values[-1]} - elsewhere
            kernel = localize(keep_in_locals(epilogue.unstored(kernel, inner), inner), inner, bufs)
        if kernel is not k:
            test[k.name] = kernel
    originals = {s.name: s for s in forward if isinstance(s, Segment)}
    out = []
    for s in steps:
        if isinstance(s, Segment):
            ks = tuple(test.get(k.name, k) for k in s.kernels)
            s = originals[s.name] if ks == originals[s.name].kernels else Segment(f"test_{s.name}", ks)
        out.append(s)
    return out


def _fold_across(steps: list) -> tuple[list, dict]:
    """``steps`` where a kernel ends with a tiled product and the next one (of its segment,
    or the first of the next segment, then joined to this one) starts with an element-wise
    nest over the product's output: the nest folded into the product
    (:func:`~latte.compiler.passes.epilogue.fold_pair`; ResNet-50's strided 1x1 projections,
    which the planner leaves out of their batch norm, add and ReLU's group), the second
    kernel left with the rest of its statements (none, as a rule: it keeps its place and
    name). And each first kernel's name -> the two kernels as they were: they run as a
    fused group, what the first writes and only the second reads an intermediate."""
    out, pairs = [], {}
    for s in steps:
        if not isinstance(s, Segment) or not epilogue.enabled():
            out.append(s)
            continue
        prev = out.pop() if out and isinstance(out[-1], Segment) else None
        kernels = list(prev.kernels) if prev is not None else []
        for k in s.kernels:
            a = kernels[-1] if kernels else None
            folded = epilogue.fold_pair(a.body.stmts[-1], k.body.stmts[0]) if (
                a is not None and a.body.stmts and k.body.stmts) else None
            if folded is not None:
                pairs[a.name] = (a, k)
                kernels[-1] = replace(a, body=Block((*a.body.stmts[:-1], folded)))
                k = replace(k, body=Block(k.body.stmts[1:]))
            kernels.append(k)
        if prev is not None and kernels[:len(prev.kernels)] == list(prev.kernels):
            out += [prev, Segment(s.name, tuple(kernels[len(prev.kernels):]))]
        else:
            out.append(Segment((prev or s).name, tuple(kernels)))
    return out, pairs


def _with_test_groups(steps: list, groups: list) -> list:
    """``steps`` with each group's test kernel where its first member's kernel was, and its
    other members' kernels (and the training groups' they own) removed."""
    member = {p.ensemble: g for g in groups for p in g.plans}
    placed, out = set(), []
    for s in steps:
        if isinstance(s, Segment) and any(k.ensemble in member for k in s.kernels):
            ks = []
            for k in s.kernels:
                g = member.get(k.ensemble)
                if g is None:
                    ks.append(k)
                elif k.ensemble is g.plans[0].ensemble:
                    ks.append(g.plans[0].kernels["test"])
                    placed.add(g.name)
            if not ks:
                continue
            s = Segment(s.name, tuple(ks))
        out.append(s)
    if len(placed) != len(groups):
        raise CompileError(f"test forward: no kernel of the first member of fused group(s) "
                           f"{sorted({g.name for g in groups} - placed)} is scheduled")
    return out


def _hoist_and_prune(forward: list, bufs: BufferPlan) -> list:
    """``forward`` with the host steps that do not read their inputs in ``Phase.TEST``
    first, without the kernels whose values only those steps read (transitively), and
    without the segments left empty. A kernel stays when a value it writes is read by a
    step that stays, or by no later step at all (an output)."""
    early = [s for s in forward if isinstance(s, HostStep) and not s.ensemble.reads_inputs(Phase.TEST)]
    needed: set = set()
    later = {bufs.value(i) for s in early for i in s.ensemble.inputs}
    kept: list = []
    for step in reversed(forward):
        if isinstance(step, TimeSteps):   # kept whole: its steps depend on each other
            reads = {bufs.base(b) for b in _reads(step)}
            needed |= reads
            later |= reads
            kept.append(step)
            continue
        if isinstance(step, HostStep):
            if step not in early:
                needed |= {bufs.value(i) for i in step.ensemble.inputs}
                kept.append(step)
            continue
        live = []
        for k in reversed(step.kernels):
            found = accesses(k.body)
            reads = {a.buffer for a in found if not a.written}
            values = {a.buffer for a in found if a.written and a.buffer.key[1] == "value"}
            if not values or values & needed or values - later:
                live.append(k)
                needed |= reads
            later |= reads
        if live:
            kept.append(Segment(step.name, tuple(reversed(live))))
    return early + kept[::-1]


def _reads(loop: TimeSteps) -> set:
    """The buffers (step views among them) a time loop's kernels read."""
    return {a.buffer for s in loop.steps for k in s.kernels for a in accesses(k.body)
            if not a.written}


def zero_grads(net, bufs: BufferPlan, skip) -> Kernel:
    """``grad[:] = 0`` for every gradient buffer not in ``skip`` (dead, or overwritten by
    its first writer); a window (a zero-copy join's input) is zeroed with its join's."""
    grads = []
    for ens in net.ensembles:
        if not isinstance(ens, ActivationEnsemble):
            g = bufs.grad(ens)
            if g not in skip and g not in bufs.windows:
                grads.append(g)
        if isinstance(ens, Ensemble):
            grads += [g for f in ens.params if (g := bufs.field_grad(ens, f.name)) not in skip]
    body = Block(tuple(zero_loop(g, f"_z{i}") for i, g in enumerate(grads)))
    return Kernel("zero_grads", body, None, "backward")


#: A segment whose kernels cost more than this to compile (their shapes' IR length, as
#: :func:`~latte.compiler.codegen.split` weighs modules; about half a second of LLVM's
#: time) runs as consecutive pieces, which ``split`` can place in modules apart: one
#: segment (a whole backward pass) no longer bounds how evenly LLVM's work divides among
#: the cores.
PIECE_COST = 50_000


def cut(steps: list) -> list:
    """``steps`` with each segment (time loops' too) as its pieces, in order: the segment
    itself, or consecutive runs of its kernels named ``name``, ``name__p1``, ... (C
    identifiers, for ``latte export``). A new piece starts where a kernel of a shape not yet
    in the current one would take it past :data:`PIECE_COST`."""
    out = []
    for step in steps:
        if isinstance(step, TimeSteps):
            out.append(replace(step, steps=tuple(cut(list(step.steps)))))
        elif isinstance(step, Segment):
            out.extend(_pieces(step))
        else:
            out.append(step)
    return out


def _pieces(segment: Segment) -> list[Segment]:
    """``segment`` cut as :func:`cut` says."""
    runs: list[list[Kernel]] = [[]]
    held: set[str] = set()
    cost = 0   # of the shapes held by the current piece
    for kernel in segment.kernels:
        key = shape(kernel, False)
        if key not in held:
            if runs[-1] and cost + len(key) > PIECE_COST:
                runs.append([])
                held, cost = set(), 0
            held.add(key)
            cost += len(key)
        runs[-1].append(kernel)
    if len(runs) == 1:
        return [segment]
    return [Segment(segment.name if i == 0 else f"{segment.name}__p{i}", tuple(run))
            for i, run in enumerate(runs)]
