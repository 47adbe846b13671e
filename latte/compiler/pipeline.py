"""The compiler's pipeline: a declared list of named steps, run by :func:`compile_net`.

Each step has a name, the lowest opt level it runs at, and a function. A kernel step is
``fn(c, kernel) -> kernel``, applied to every ensemble's forward and backward kernel; a
net step is ``fn(c) -> None`` over the whole :class:`Compilation` (planning fusion,
merging groups, scheduling). The kernels are verified (bounds, well-formedness) after
synthesis and after the last step, or after every step with ``LATTE_VERIFY=steps`` (the
test suite and the random tester run so); with ``LATTE_DUMP=ir`` (every step) or
``LATTE_DUMP=ir:STEP`` (one) they are printed to stderr.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Callable

from latte.compiler import schedule, stored
from latte.compiler.buffers import BufferPlan, StepBuffers
from latte.compiler.codegen import ModuleBuilder, split
from latte.compiler.description import Undescribable, describe, wanted
from latte.compiler.fingerprint import fingerprint, kernel_buffers, shape
from latte.compiler.fusion import (
    ROW_DIM,
    fusion_groups,
    keep_or_recompute,
    merge,
    mergeable,
    test_groups,
)
from latte.compiler.graph_checks import check_graph
from latte.compiler.ir import Block, Kernel, Ref, accesses, walk
from latte.compiler.jit import in_background, target
from latte.compiler.joins import join_in_place
from latte.compiler.machine import cache_sizes, vector_registers
from latte.compiler.mapping import analyze_connections
from latte.compiler.passes import (
    copy_windows,
    distribute_loops,
    fold_zero_init,
    fuse_nests,
    localize,
    match_gemm,
    parallelize,
    prune_dead_gradients,
    tile_loops,
)
from latte.compiler.passes.coalesce import coalesce_loops
from latte.compiler.passes.epilogue import fold_epilogues
from latte.compiler.passes.gather_grads import gather_input_grads
from latte.compiler.passes.guards import split_guards
from latte.compiler.passes.pack import measure_in_place, pack_weights, tile_in_place
from latte.compiler.passes.stream import store_budget, stream_stores
from latte.compiler.passes.tiling import is_batch_loop
from latte.compiler.passes.time_hoist import hoist_param_grads
from latte.compiler.passes.unswitch import unswitch_neuron_loops
from latte.compiler.passes.winograd import takes, winograd
from latte.compiler.passes.zero_init import fold_across
from latte.compiler.printer import format_ir
from latte.compiler.program import (
    AFTER_LOOP,
    BEFORE_LOOP,
    EnsemblePlan,
    Program,
    Segment,
    TimeSteps,
)
from latte.compiler.step_fusion import fuse_steps
from latte.compiler.synthesis import synthesize
from latte.compiler.verify import verify_kernel
from latte.lang import DataEnsemble, Ensemble, NormalizationEnsemble
from latte.lang.time import time_loops

PHASES = ("forward", "backward")


@dataclass
class Compilation:
    """The state the steps share: the net, its buffers, per-ensemble plans and kernels."""

    net: object
    opt_level: int
    bufs: BufferPlan
    split: bool
    budget: int = 0                                  # bytes a tile's working set may use
    dead: frozenset = frozenset()                    # gradients nothing needs (data)
    plans: list[EnsemblePlan] = field(default_factory=list)
    groups: list = field(default_factory=list)       # fused groups (opt level 3)
    test_groups: list = field(default_factory=list)  # more groups of the test forward alone
    first_touch: dict = field(default_factory=dict)  # ensemble -> gradients still zero there
    pre_zeroed: set = field(default_factory=set)     # gradients their first writer overwrites
    stepped: dict = field(default_factory=dict)      # ensemble -> its time loop
    fused_steps: list = field(default_factory=list)  # time-loop ensembles run as one loop
    joins: list = field(default_factory=list)        # concatenations, zero-copy or why not
    program: Program | None = None

    def kernels(self) -> list[Kernel]:
        """Every ensemble kernel, then the scheduled ones no plan holds (zeroing the
        gradients, the test forward's kernels with line buffers)."""
        found = [k for p in self.plans for k in p.kernels.values()]
        if self.program is not None:
            planned = {id(k) for k in found}
            found += [k for s in self.program.segments() for k in s.kernels
                      if id(k) not in planned]
        return found


@dataclass(frozen=True)
class Step:
    name: str
    min_opt: int
    fn: Callable
    per_kernel: bool = True


# ------------------------------------------------------------------ net steps

def _analyze(c: Compilation) -> None:
    """Mapping functions -> affine access relations (isl) or gather tables."""
    for ens in c.net.ensembles:   # every ensemble has values and gradients, used or not
        c.bufs.value(ens), c.bufs.grad(ens)
    c.dead = frozenset(c.bufs.grad(e) for e in c.net.ensembles
                       if isinstance(e, DataEnsemble) and not getattr(e, "needs_grad", False))
    c.plans = [EnsemblePlan(e, analyze_connections(c.net.connections_into(e)))
               for e in c.net.ensembles if isinstance(e, Ensemble)]
    c.stepped = {e: loop for loop in time_loops(c.net) for e in loop.ensembles}


def _synthesize(c: Compilation) -> None:
    """Neuron bodies -> loop nests over (batch, ensemble dims), SoA buffer refs; a time
    loop's ensembles over one step's items (step views of the buffers)."""
    for plan in c.plans:
        bufs = StepBuffers(c.bufs) if plan.ensemble in c.stepped else c.bufs
        for phase in PHASES:
            plan.kernels[phase] = synthesize(plan.ensemble, phase, plan.accesses, bufs)
    c.dead |= {v for v in c.bufs.views if c.bufs.base(v) in c.dead}


def _join_in_place(c: Compilation) -> None:
    """A concatenation's inputs write into its buffers, where that is safe: their buffers
    become windows of its, its kernels go."""
    c.joins = join_in_place(c.net, c.plans, c.bufs, c.stepped, c.opt_level)


def _hoist_param_grads(c: Compilation) -> None:
    """A time loop's parameter gradient nests: once after the loop, over every step's rows
    (kernel ``"after_loop"``)."""
    for plan in c.plans:
        ens = plan.ensemble
        if ens in c.stepped and ens.params:
            grads = frozenset(c.bufs.field_grad(ens, f.name) for f in ens.params)
            kept, hoisted = hoist_param_grads(plan.kernels["backward"], grads,
                                              frozenset({c.bufs.grad(ens)}), c.bufs.views,
                                              c.bufs.time_steps)
            if hoisted.body.stmts:
                plan.kernels["backward"], plan.kernels[AFTER_LOOP] = kept, hoisted


def _plan_fusion(c: Compilation) -> None:
    """Chains whose tile T reads only the producer's tiles near T (isl), sized to the cache."""
    plans = [p for p in c.plans if p.ensemble not in c.stepped]
    c.groups = fusion_groups(c.net, plans, c.budget, c.bufs.threads)
    # in Phase.TEST a batch norm's statistics are constants: it fuses with its convolution
    c.test_groups = test_groups(c.net, plans, c.groups, c.budget, c.bufs.threads)


def _first_touch(c: Compilation) -> None:
    """Per ensemble, the gradient buffers its backward kernel is the first to touch (in
    backward order): they are still zero when it runs. Host steps (losses) come first. For
    a time loop's ensemble, the step views (``[t]``) of gradients that nothing touched before
    the loop and no kernel sees at another step (``[t-1]``): zero when the step starts."""
    bufs = c.bufs
    seen = set(c.dead) | {bufs.grad(i) for e in c.net.ensembles
                          if isinstance(e, NormalizationEnsemble) for i in e.inputs}
    other_steps = {base for base, shift in bufs.views.values() if shift}
    before_loop: dict = {}   # time loop -> what was touched when it starts, or at [t-1]
    for plan in reversed(c.plans):
        kernels = [k for name, k in plan.kernels.items() if name in ("backward", AFTER_LOOP)]
        refs = {r.buffer for k in kernels for r in walk(k.body) if isinstance(r, Ref)}
        loop = c.stepped.get(plan.ensemble)
        if loop is None:
            first = frozenset(b for b in refs - seen if b.key[1] == "grad")
        else:
            if id(loop) not in before_loop:
                before_loop[id(loop)] = seen | other_steps
            touched = before_loop[id(loop)]
            first = frozenset(v for v in refs if bufs.views.get(v, (None, 1))[1] == 0
                              and bufs.base(v) not in touched and bufs.base(v).key[1] == "grad")
        c.first_touch[plan.ensemble] = first
        seen |= {bufs.base(b) for b in refs}


def _fold_zero_init(c: Compilation, kernel: Kernel) -> Kernel:
    """The first writer of a zeroed buffer overwrites it (a GEMM with beta = 0, a store)."""
    if kernel.phase != "backward":
        return fold_zero_init(kernel)[0]
    ens = kernel.ensemble
    grads = frozenset(c.bufs.field_grad(ens, f.name) for f in ens.params)
    if ens in c.stepped:   # its parameters' gradients sum over the steps: only the nests run
        # once after the loop may overwrite them, those no step of the loop touches
        if kernel is not next(p for p in c.plans if p.ensemble is ens).kernels.get(AFTER_LOOP):
            return kernel   # its steps' gradients: _fold_step_grads
        stepped = [p.kernels["backward"] for p in c.plans if p.ensemble in c.stepped]
        zeroed = grads - {a.buffer for k in stepped for a in accesses(k.body)}
    else:
        zeroed = grads | c.first_touch[ens]
    kernel, folded = fold_zero_init(kernel, zeroed)
    c.pre_zeroed |= folded
    return kernel


def _fold_step_grads(c: Compilation) -> None:
    """A gradient's step view still zero when a time step starts, which the loop's kernels
    only write, each element once (an LSTM's gates in two kernels): the writes overwrite,
    and the gradient needs no zeroing."""
    loops: dict = {}   # id(time loop) -> its ensembles' plans, in backward order
    for plan in reversed(c.plans):
        if plan.ensemble in c.stepped:
            loops.setdefault(id(c.stepped[plan.ensemble]), []).append(plan)
    for plans in loops.values():
        views = sorted({v for p in plans for v in c.first_touch[p.ensemble]}, key=lambda v: v.name)
        for view in views:
            touching = [p for p in plans
                        if any(a.buffer is view for a in accesses(p.kernels["backward"].body))]
            kernels = fold_across([p.kernels["backward"] for p in touching], view)
            if kernels is not None:
                for p, k in zip(touching, kernels):
                    p.kernels["backward"] = k
                c.pre_zeroed.add(c.bufs.base(view))


def _fuse_groups(c: Compilation) -> None:
    """Each fused group's kernels become one, run by its owner; what backward needs (a
    pool's arg-max) is kept, or recomputed per tile if that moves fewer bytes. A group whose
    untiled statements cannot be ordered around its skewed tile loop is not fused."""
    c.groups = [g for g in c.groups if mergeable(g)]
    c.test_groups = [g for g in c.test_groups if mergeable(g, ("forward",))]
    for group in c.test_groups:   # the test forward's kernel "test", from the members' own
        group.owner("forward").kernels["test"] = replace(merge(group, "forward"),
                                                         name=f"{group.name}.test")
    for group in c.groups:
        keep_or_recompute(group, c.bufs)
        for phase in PHASES:
            fused = merge(group, phase)
            for plan in group.plans:
                plan.kernels[phase] = replace(plan.kernels[phase], body=Block(()))
            group.owner(phase).kernels[phase] = fused


def _fuse_steps(c: Compilation) -> None:
    """A time loop's element-wise ensembles: one loop over the step's items."""
    c.fused_steps = fuse_steps(c.plans, c.stepped, PHASES)


def _localize_recomputed(c: Compilation) -> None:
    """Recomputed fields live in per-thread tile buffers of the backward group."""
    for group in c.groups:
        owner = group.owner("backward")
        again = {b for ch in group.choices.values() if ch.recompute for b in ch.fields}
        owner.kernels["backward"] = localize(owner.kernels["backward"], again, c.bufs)


def _pack_weights(c: Compilation) -> None:
    """GEMMs over parameters that reuse them enough read them packed: a time loop's once
    before the loop, the others at the start of their kernel (``LATTE_PACK=0``: BLAS)."""
    if _blas_only():
        return
    params = frozenset(c.bufs.field(e, f.name) for e in c.net.ensembles
                       if isinstance(e, Ensemble) for f in e.params)
    l2 = cache_sizes()[2]
    for plan in c.plans:
        stepped = plan.ensemble in c.stepped
        for phase in PHASES:
            kernel, packs = pack_weights(plan.kernels[phase], c.bufs, params,
                                         vector_registers(), l2, stepped)
            if not packs:
                continue
            if stepped:
                plan.kernels[BEFORE_LOOP[phase]] = Kernel(f"{kernel.name}_pack", Block(tuple(packs)),
                                                          kernel.ensemble, phase)
            else:
                kernel = replace(kernel, body=Block((*packs, *kernel.body.stmts)))
            plan.kernels[phase] = kernel


def _tile_gemms(c: Compilation) -> None:
    """GEMMs that BLAS would pack for little work: the micro-kernel on B in place
    (``LATTE_PACK=0``: BLAS)."""
    if _blas_only():
        return
    vector, caches = vector_registers(), cache_sizes()
    measure_in_place([k for plan in c.plans for k in plan.kernels.values()], vector, caches[2],
                     caches[max(caches)])
    for plan in c.plans:
        for name, kernel in plan.kernels.items():
            plan.kernels[name] = tile_in_place(kernel, vector, caches[2], caches[max(caches)])


def _blas_only() -> bool:
    """``LATTE_PACK=0``: every GEMM a BLAS call, no packing, no tiled products."""
    return os.environ.get("LATTE_PACK") == "0"


def _schedule(c: Compilation) -> None:
    """Kernels -> segments and host steps per phase; the gradient-zeroing kernel (a
    solver's update is compiled when it first runs: ``latte.compiler.update``)."""
    net, bufs = c.net, c.bufs
    params = [(e, f.name) for e in net.ensembles if isinstance(e, Ensemble) for f in e.params]
    by_ens = {p.ensemble: p for p in c.plans}
    forward = schedule.phase_steps(net.ensembles, by_ens, "forward", "fwd", c.split,
                                   c.stepped, bufs)
    test = schedule.test_steps(forward, c.groups, bufs, c.test_groups)
    backward = schedule.phase_steps(reversed(net.ensembles), by_ens, "backward", "bwd", c.split,
                                    c.stepped, bufs)
    zero = parallelize(schedule.zero_grads(net, bufs, c.dead | c.pre_zeroed), bufs, c.budget)
    if backward and isinstance(backward[0], Segment) and not c.split:
        backward[0] = Segment(backward[0].name, (zero, *backward[0].kernels))
    else:
        backward.insert(0, Segment("bwd_zero", (zero,)))
    c.program = Program(bufs, forward, backward, test, params, c.plans, c.opt_level,
                        groups=c.groups, budget=c.budget, test_groups=c.test_groups,
                        fused_steps=c.fused_steps, joins=c.joins)


def _every_scheduled(c: Compilation, fn: Callable[[Kernel], Kernel]) -> None:
    """Every scheduled kernel and plan kernel replaced by ``fn`` of it (a kernel two phases
    share stays shared)."""
    done: dict[int, Kernel] = {}

    def kernel(k: Kernel) -> Kernel:
        if id(k) not in done:
            done[id(k)] = fn(k)
        return done[id(k)]

    def steps(items: list) -> list:
        out = []
        for s in items:
            if isinstance(s, Segment):
                s = Segment(s.name, tuple(kernel(k) for k in s.kernels))
            elif isinstance(s, TimeSteps):
                s = replace(s, steps=tuple(steps(list(s.steps))))
            out.append(s)
        return out

    p = c.program
    p.forward, p.backward, p.test = steps(p.forward), steps(p.backward), steps(p.test)
    for plan in c.plans:
        plan.kernels = {phase: kernel(k) for phase, k in plan.kernels.items()}


def _stream_stores(c: Compilation) -> None:
    """Every scheduled kernel with its store-bound products streaming their stores."""
    budget = store_budget(c.bufs, cache_sizes())
    _every_scheduled(c, lambda k: stream_stores(k, c.bufs, budget))


def _cut_segments(c: Compilation) -> None:
    """Every phase's segments as :func:`~latte.compiler.schedule.cut` leaves them."""
    p = c.program
    p.forward, p.backward, p.test = (schedule.cut(s) for s in (p.forward, p.backward, p.test))


STEPS = (
    Step("analyze", 0, _analyze, per_kernel=False),
    Step("synthesize", 0, _synthesize, per_kernel=False),
    # zero-copy joins (at opt level 0 they only say why not): before every pass that reads
    # indices, so GEMMs derive their leading dimensions from the join's buffer
    Step("join_in_place", 0, _join_in_place, per_kernel=False),
    # data ensembles need no gradient
    Step("prune_dead_gradients", 0, lambda c, k: prune_dead_gradients(k, c.dead)),
    # tests every neuron of an item makes alike run once per item, the neurons under them
    Step("unswitch", 1, lambda c, k: unswitch_neuron_loops(k)),
    # neuron bodies split into perfect nests
    Step("distribute_loops", 1, lambda c, k: distribute_loops(k)),
    # a time loop's parameter gradients: one nest over all steps, after the loop
    Step("hoist_param_grads", 1, _hoist_param_grads, per_kernel=False),
    Step("plan_fusion", 3, _plan_fusion, per_kernel=False),
    Step("first_touch", 1, _first_touch, per_kernel=False),
    # same-size stride-1 windows' input gradients: gathers (a transposed convolution)
    Step("gather_grads", 2, lambda c, k: gather_input_grads(k, c.bufs, _grad_owners(c))),
    # row-plane tiles sized to the cache budget (or to the fused group's)
    Step("tile_loops", 2, lambda c, k: tile_loops(k, c.budget, _forced(c, k), _sharing(c, k))),
    # 3x3 stride-1 windows through Winograd's transforms: 16 GEMMs over transformed tiles
    Step("winograd", 2, lambda c, k: winograd(k, c.bufs, cache_sizes()[3])),
    # sliding windows gathered into tile buffers, then GEMMs over them
    Step("copy_windows", 1, lambda c, k: copy_windows(k, c.bufs)),
    Step("match_gemm", 1, lambda c, k: match_gemm(k)),
    Step("fold_zero_init", 1, _fold_zero_init),
    Step("fold_step_grads", 1, _fold_step_grads, per_kernel=False),
    Step("fuse_groups", 3, _fuse_groups, per_kernel=False),
    # a time loop's element-wise ensembles: one loop over the step's items
    Step("fuse_steps", 3, _fuse_steps, per_kernel=False),
    # nests over the same tiles run tile by tile
    Step("fuse_nests", 2, lambda c, k: fuse_nests(k)),
    # batch x tiles across threads, private gradients reduced in thread order
    Step("parallelize", 2, lambda c, k: parallelize(k, c.bufs, c.budget)),
    # GEMMs over parameters that reuse them: B packed once per pass, then tiled products
    Step("pack_weights", 2, _pack_weights, per_kernel=False),
    # the other GEMMs over an A that stays in cache, B read along its rows: tiled, B in place
    Step("tile_gemms", 2, _tile_gemms, per_kernel=False),
    # an element-wise nest after a tiled product (a bias, a batch norm, an add, a ReLU): run
    # on each element as the product stores its tiles
    Step("fold_epilogues", 2, lambda c, k: fold_epilogues(k)),
    Step("localize_recomputed", 3, _localize_recomputed, per_kernel=False),
    # a loop testing its index against padding: the tests only where they can fail
    Step("split_guards", 1, lambda c, k: split_guards(k)),
    Step("schedule", 0, _schedule, per_kernel=False),
    # nested loops that walk every buffer as one run: one loop LLVM vectorizes whole (after
    # the test forward's line buffers, which read the rows of the nests)
    Step("coalesce_loops", 1, lambda c: _every_scheduled(c, coalesce_loops), per_kernel=False),
    # a store-bound product writing more than the L2s hold (the line buffers placed): its
    # tiles stored past the caches
    Step("stream_stores", 2, _stream_stores, per_kernel=False),
    # segments that cost much to compile: consecutive pieces, compiled side by side
    Step("cut_segments", 0, _cut_segments, per_kernel=False),
)


# the kernels are verified after these steps (what the user wrote), and the final ones as
# their code is built (:func:`_library`); with LATTE_VERIFY=steps after every step, which
# names the step that broke an invariant
VERIFIED_AFTER = ("synthesize",)


def _grad_owners(c: Compilation) -> dict:
    """Gradient buffer -> its ensemble (an in-place activation's: either of the two)."""
    return {c.bufs.grad(e): e for e in c.net.ensembles}


def _sharing(c: Compilation, kernel: Kernel) -> int:
    """The threads ``kernel``'s row tiles are shared among, as their height is chosen: 1 (the
    cache alone decides) where Winograd takes one of its nests."""
    if c.bufs.threads == 1 or any(is_batch_loop(s) and takes(s) for s in kernel.body.stmts):
        return 1
    return c.bufs.threads


def _forced(c: Compilation, kernel: Kernel) -> tuple[int, int] | None:
    """The tile rows a fused group imposes on ``kernel``'s ensemble."""
    for g in c.groups + c.test_groups:
        if kernel.ensemble in g.rows:
            return ROW_DIM, g.rows[kernel.ensemble]
    return None


def _dump(step: str, kernels: list[Kernel]) -> None:
    wanted = [d for d in os.environ.get("LATTE_DUMP", "").split(",") if d.startswith("ir")]
    if any(d in ("ir", f"ir:{step}") for d in wanted):
        for k in kernels:
            print(f"==== {k.name} after {step}\n{format_ir(k)}", file=sys.stderr)


def compile_net(net, opt_level: int = 3, split_segments: bool = False, threads: int = 1) -> Program:
    """Analyse, synthesize, optimize and JIT-compile ``net`` for ``threads`` threads.

    ``split_segments`` gives each ensemble's forward and backward its own native segment
    (and zeroing the gradients one of its own), so the runtime can act between ensembles:
    start gradient reductions over MPI, time each ensemble when profiling.

    The graph is checked first (what that adds to the net, the copies some activations work
    on, is part of its description); then a program compiled before for an equal description
    is loaded from the disk cache (:mod:`latte.compiler.stored`) instead of compiling, unless
    ``LATTE_DUMP`` watches the steps or ``LATTE_STORED_PROGRAMS=0``. Python's cyclic garbage
    collector is paused meanwhile (:func:`collector_paused`).
    """
    with collector_paused():
        return _compile_net(net, opt_level, split_segments, threads)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off inside (as it was after). Compiling makes
    millions of short-lived objects, and each collection they set off walks every live one
    (``benchmarks/init_time.py``: README, session 27). The cyclic garbage (llvmlite's IR)
    waits for the collector to come back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _compile_net(net, opt_level: int, split_segments: bool, threads: int) -> Program:
    check_graph(net)
    desc = None
    if wanted():
        try:
            desc = describe(net, (opt_level, split_segments, threads))
        except Undescribable:
            pass
    found = stored.load(desc) if desc is not None else None
    if found is not None:
        program, fp, speed = found
        program.stored = True
        program.library = _library(program, fp, speed, _verifier())
        return program
    verify = _verifier()
    program = _run_steps(net, opt_level, split_segments, threads, verify)
    # opt level 0 is the plain-loop baseline the others are checked against: LLVM's O1
    # compiles it in half the time, and nothing at that level is meant to be fast
    speed = 1 if opt_level == 0 else 3
    fp = fingerprint(program.segments(), program.buffer_index(), program.buffers.threads)
    program.transient_layout   # noqa: B018  (placed now, the stored program holds it)
    # stored while LLVM compiles (a program whose kernels fail the verifier may be stored:
    # loading it compiles its code, which verifies them again and fails as here)
    storing = in_background(None if desc is None else lambda: stored.store(desc, program, fp, speed))
    try:
        program.library = _library(program, fp, speed, verify)
        storing.wait()
    finally:
        storing.cancel()
    return program


def _verifier() -> Callable[[list[Kernel]], None]:
    """A function verifying kernels, each only once (it holds them, so ids stay unique),
    and of kernels alike (one shape over buffers of the same shapes: ResNet's repeated
    blocks) only the first; the rest verify alike."""
    checked: dict[int, Kernel] = {}
    passed: set = set()

    def verify(kernels: list[Kernel]) -> None:
        for kernel in kernels:   # a kernel a step returned unchanged is not checked again
            if checked.get(id(kernel)) is not kernel:
                alike = (shape(kernel, False),
                         tuple((b.shape, b.size) for b in kernel_buffers(kernel)))
                if alike not in passed:
                    verify_kernel(kernel)
                    passed.add(alike)
                checked[id(kernel)] = kernel
    return verify


def _run_steps(net, opt_level: int, split_segments: bool, threads: int,
               verify: Callable[[list[Kernel]], None]) -> Program:
    """The program :data:`STEPS` make of ``net`` (its native code not built yet)."""
    bufs = BufferPlan(net.batch_size, threads if opt_level >= 2 else 1, net.time_steps)
    # a tile's working set: the L2
    c = Compilation(net, opt_level, bufs, split_segments, budget=cache_sizes()[2])
    every_step = os.environ.get("LATTE_VERIFY") == "steps"
    for step in STEPS:
        if opt_level < step.min_opt:
            continue
        if step.per_kernel:
            for plan in c.plans:
                for phase in plan.kernels:   # forward, backward (and a fused group's test)
                    plan.kernels[phase] = step.fn(c, plan.kernels[phase])
        else:
            step.fn(c)
        kernels = c.kernels()
        if every_step or (step.name in VERIFIED_AFTER and step is not STEPS[-1]):
            verify(kernels)
        _dump(step.name, kernels)
    return c.program


def _library(program: Program, fp: str, speed: int, verify: Callable[[list[Kernel]], None]):
    """``program``'s native code at LLVM speed ``speed``: codegen puts every segment into
    LLVM modules, then O3 + JIT; the disk cache is looked up by the program's fingerprint
    ``fp`` first, and on a hit the LLVM IR is never built. The segments' kernels are verified
    while their code compiles, and the code is neither cached nor run unless they pass: a
    hit holds code made from the same kernels (the fingerprint covers them and the
    verifier's source), which passed then."""
    index, segments, threads = program.buffer_index(), program.segments(), program.buffers.threads
    return target().library(fp, lambda parts: llvm_ir(segments, index, threads, parts), speed=speed,
                            check=lambda: verify([k for seg in segments for k in seg.kernels]))


def llvm_ir(segments: list[Segment], index: dict, threads: int,
            parts: int = 1) -> list[Callable[[], str]]:
    """Functions building the LLVM IR of ``segments`` over the buffer table ``index`` as at
    most ``parts`` modules of about equal work (``LATTE_DUMP=llvm`` prints them)."""
    def module(group: list[Segment]) -> str:
        mb = ModuleBuilder(index, threads)
        for seg in group:
            mb.add_segment(seg.name, list(seg.kernels))
        if "llvm" in os.environ.get("LATTE_DUMP", "").split(","):
            print(f"==== LLVM IR\n{mb.module}", file=sys.stderr, flush=True)
        return str(mb.module)
    return [lambda g=group: module(g) for group in split(segments, parts)]
