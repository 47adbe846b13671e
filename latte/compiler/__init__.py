"""The latte compiler. :func:`compile_net` is the whole pipeline, one named step at a time.

Set ``LATTE_DUMP=ir`` (or ``ir,llvm``) to print the loop IR after each pass and the LLVM IR.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace

from latte.compiler.buffers import BufferPlan
from latte.compiler.codegen import ModuleBuilder
from latte.compiler.fusion import ROW_DIM, fusion_groups, keep_or_recompute, merge
from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    Buffer,
    Const,
    Kernel,
    Load,
    Loop,
    Ref,
    accesses,
    walk,
)
from latte.compiler.jit import CodeLibrary, target
from latte.compiler.machine import cache_sizes
from latte.compiler.mapping import ConnAccess, analyze_connection, fit_index_map
from latte.compiler.passes import (
    copy_windows,
    distribute_loops,
    drop_stores,
    fold_zero_init,
    fuse_nests,
    localize,
    match_gemm,
    parallelize,
    prune_dead_gradients,
    tile_loops,
)
from latte.compiler.printer import format_ir
from latte.compiler.synthesis import synthesize, zero_loop
from latte.compiler.verify import verify_bounds
from latte.errors import MappingError
from latte.lang import ActivationEnsemble, DataEnsemble, Ensemble, NormalizationEnsemble


@dataclass(frozen=True)
class Segment:
    """Consecutive kernels compiled into one native function."""

    name: str
    kernels: tuple[Kernel, ...]


@dataclass(frozen=True)
class HostStep:
    """A normalization ensemble's array code, run by the runtime between segments."""

    ensemble: NormalizationEnsemble
    phase: str


@dataclass
class EnsemblePlan:
    """What the compiler decided for one ensemble (``latte explain`` prints it)."""

    ensemble: Ensemble
    accesses: list[ConnAccess]
    kernels: dict[str, Kernel] = field(default_factory=dict)

    def param_shared_dims(self) -> dict[str, tuple[int, ...]]:
        """Per parameter, the sink dims along which all neurons share one vector."""
        out = {}
        for f in self.ensemble.params:
            fit = fit_index_map(self.ensemble, f)
            out[f.name] = tuple(d for d in range(len(self.ensemble.shape))
                                if all(a.coef(f"%{d}") == 0 for a in fit))
        return out


@dataclass
class Program:
    """A compiled net: buffers, the step lists of each phase, and the native code."""

    buffers: BufferPlan
    forward: list
    backward: list
    test: list            # the forward of Phase.TEST (fused intermediates in line buffers)
    update: list          # SGD update segments (one per parameter when split)
    params: list[tuple[Ensemble, str]]
    plans: list[EnsemblePlan]
    opt_level: int
    library: CodeLibrary | None = None
    groups: list = field(default_factory=list)   # fused groups (opt level 3)
    budget: int = 0                               # bytes a tile's working set may use

    def segments(self) -> list[Segment]:
        """Every native segment, each once (the test forward shares unchanged ones)."""
        steps = self.forward + self.backward + [s for s in self.test if s not in self.forward]
        return [s for s in steps if isinstance(s, Segment)] + self.update


def _dump(kind: str, title: str, text: str) -> None:
    if kind in os.environ.get("LATTE_DUMP", "").split(","):
        print(f"==== {title}\n{text}", file=sys.stderr)


def compile_net(net, opt_level: int = 3, split_segments: bool = False, threads: int = 1) -> Program:
    """Analyse, synthesize, optimize and JIT-compile ``net`` for ``threads`` threads.

    ``split_segments`` gives each ensemble's forward and backward its own native segment
    (and zeroing the gradients one of its own), so the runtime can act between ensembles:
    start gradient reductions over MPI, time each ensemble when profiling.
    """
    bufs = BufferPlan(net.batch_size, threads if opt_level >= 2 else 1)
    _check_activations(net)
    for ens in net.ensembles:  # every ensemble has values and gradients, used or not
        bufs.value(ens), bufs.grad(ens)
    dead = frozenset(bufs.grad(e) for e in net.ensembles
                     if isinstance(e, DataEnsemble) and not getattr(e, "needs_grad", False))
    budget = cache_sizes()[2]   # a tile's working set: the L2 (Occam: "fits in the cache")
    plans = []
    for ens in net.ensembles:
        if isinstance(ens, Ensemble):
            # analysis: mapping functions -> affine access relations (isl)
            plans.append(EnsemblePlan(ens, [analyze_connection(c) for c in net.connections_into(ens)]))
    for plan in plans:
        for phase in ("forward", "backward"):
            # synthesis: neuron body -> loop nest over (batch, ensemble dims), SoA refs
            kernel = synthesize(plan.ensemble, phase, plan.accesses, bufs)
            verify_bounds(kernel)
            # data ensembles need no gradient
            kernel = prune_dead_gradients(kernel, dead)
            _dump("ir", f"{kernel.name} synthesized", format_ir(kernel))
            # split neuron bodies into perfect nests
            plan.kernels[phase] = distribute_loops(kernel) if opt_level >= 1 else kernel
    # cross-layer fusion: chains whose tile T reads only the producer's tile T (isl)
    groups = fusion_groups(net, plans, budget, bufs.threads) if opt_level >= 3 else []
    forced = {ens: (ROW_DIM, rows) for g in groups for ens, rows in g.rows.items()}
    pre_zeroed: set[Buffer] = set()   # gradients a first writer overwrites need no zeroing
    first_touch = _first_grad_touch(net, plans, bufs, dead) if opt_level >= 1 else {}
    for plan in plans if opt_level >= 1 else ():
        ens = plan.ensemble
        for phase in ("forward", "backward"):
            kernel = plan.kernels[phase]
            if opt_level >= 2:
                # row-plane tiles sized to the cache budget (or to the fused group's)
                kernel = tile_loops(kernel, budget, forced.get(ens))
            # sliding windows gathered into tile buffers, then GEMMs over them
            kernel = copy_windows(kernel, bufs)
            kernel = match_gemm(kernel)
            # the first writer of a zeroed buffer overwrites it (a GEMM with beta = 0, a store)
            zeroed = frozenset(bufs.field_grad(ens, f.name) for f in ens.params) | first_touch[ens]
            kernel, folded = fold_zero_init(kernel, zeroed if phase == "backward" else frozenset())
            pre_zeroed |= folded
            plan.kernels[phase] = kernel
    for group in groups:
        # what backward needs (a pool's arg-max): kept, or recomputed per tile if cheaper
        keep_or_recompute(group, bufs)
        for phase in ("forward", "backward"):
            fused = merge(group, phase)
            for plan in group.plans:
                plan.kernels[phase] = replace(plan.kernels[phase], body=Block(()))
            group.owner(phase).kernels[phase] = fused
    for plan in plans if opt_level >= 2 else ():
        for phase in ("forward", "backward"):
            # nests over the same tiles run tile by tile; batch x tiles across threads,
            # private gradients reduced in thread order
            kernel = parallelize(fuse_nests(plan.kernels[phase]), bufs)
            plan.kernels[phase] = kernel
    for group in groups:
        # recomputed fields live in per-thread tile buffers of the backward group
        owner = group.owner("backward")
        again = {b for c in group.choices.values() if c.recompute for b in c.fields}
        owner.kernels["backward"] = localize(owner.kernels["backward"], again, bufs)
    for plan in plans if opt_level >= 2 else ():
        for phase in ("forward", "backward"):
            _dump("ir", f"{plan.kernels[phase].name} optimized", format_ir(plan.kernels[phase]))
    params = [(e, f.name) for e in net.ensembles if isinstance(e, Ensemble) for f in e.params]
    by_ens = {p.ensemble: p for p in plans}
    forward = _steps(net.ensembles, by_ens, "forward", "fwd", split_segments)
    test = _test_steps(forward, groups, bufs)
    backward = _steps(reversed(net.ensembles), by_ens, "backward", "bwd", split_segments)
    zero = parallelize(Kernel("zero_grads", _zero_grads(net, bufs, dead | pre_zeroed), None,
                              "backward"), bufs)
    if backward and isinstance(backward[0], Segment) and not split_segments:
        backward[0] = Segment(backward[0].name, (zero, *backward[0].kernels))
    else:
        backward.insert(0, Segment("bwd_zero", (zero,)))
    kernels = [parallelize(k, bufs) for k in _update_kernels(params, bufs)]
    update = ([Segment(f"update{p}", (k,)) for p, k in enumerate(kernels)] if split_segments
              else [Segment("update", tuple(kernels))])
    program = Program(bufs, forward, backward, test, update, params, plans, opt_level, groups=groups,
                      budget=budget)
    # codegen: every segment into one LLVM module, then O3 + JIT (or the disk cache)
    index = {b: i for i, b in enumerate(bufs.buffers.values())}
    mb = ModuleBuilder(index, bufs.threads)
    for seg in program.segments():
        mb.add_segment(seg.name, list(seg.kernels))
    ir_text = str(mb.module)
    _dump("llvm", "LLVM IR", ir_text)
    program.library = target().compile(ir_text)
    return program


def _test_steps(forward: list, groups: list, bufs: BufferPlan) -> list:
    """The forward steps of ``Phase.TEST``. No backward follows, so ``Batch`` fields that
    forward only writes (a max-pool's arg-max) are not stored, and each fused group keeps
    the intermediate values nothing after it reads (its members' but the last one's) in
    per-thread line buffers."""
    kernels = [k for s in forward if isinstance(s, Segment) for k in s.kernels]
    found = {id(k): accesses(k.body) for k in kernels}
    hosts = {bufs.value(i) for s in forward if isinstance(s, HostStep) for i in s.ensemble.inputs}
    read = hosts | {a.buffer for k in kernels for a in found[id(k)] if not a.written}
    dead = {a.buffer for k in kernels for a in found[id(k)] if a.written and a.buffer.batched
            and a.buffer.key[1] not in ("value", "grad")} - read
    owners = {id(g.owner("forward").kernels["forward"]): g for g in groups}
    test = {}
    for k in kernels:
        kernel = drop_stores(k, dead)
        if id(k) in owners:
            values = [bufs.value(p.ensemble) for p in owners[id(k)].plans]
            elsewhere = hosts | {a.buffer for o in kernels if o is not k for a in found[id(o)]}
            kernel = localize(kernel, set(values[:-1]) - {values[-1]} - elsewhere, bufs)
        if kernel is not k:
            test[id(k)] = kernel
    return [Segment(f"test_{s.name}", tuple(test.get(id(k), k) for k in s.kernels))
            if isinstance(s, Segment) and any(id(k) in test for k in s.kernels) else s
            for s in forward]


def _steps(ensembles, by_ens, phase: str, prefix: str, split: bool = False) -> list:
    """Consecutive kernels grouped into segments (one per kernel when ``split``)."""
    steps, run = [], []

    def flush():
        if run:
            steps.append(Segment(f"{prefix}{len(steps)}", tuple(run)))
            run.clear()

    for ens in ensembles:
        if ens in by_ens:
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


def _first_grad_touch(net, plans, bufs: BufferPlan, dead) -> dict:
    """Per ensemble, the gradient buffers its backward kernel is the first to touch (in
    backward order): they are still zero when it runs. Host steps (losses) come first."""
    seen = set(dead) | {bufs.grad(i) for e in net.ensembles if isinstance(e, NormalizationEnsemble)
                        for i in e.inputs}
    out = {}
    for plan in reversed(plans):
        touched = {r.buffer for r in walk(plan.kernels["backward"].body) if isinstance(r, Ref)}
        out[plan.ensemble] = frozenset(b for b in touched - seen if b.key[1] == "grad")
        seen |= touched
    return out


def _check_activations(net) -> None:
    """An in-place activation must be the only reader of its source's values."""
    for ens in net.ensembles:
        if not isinstance(ens, ActivationEnsemble):
            continue
        src = ens.source
        if isinstance(src, ActivationEnsemble):
            raise MappingError(f"activation {ens.name!r} works in place on {src.name!r}, itself an "
                               "in-place activation; chained in-place activations would back-"
                               "propagate through overwritten values")
        readers = [c.sink.name for c in net.connections if c.source is src]
        readers += [e.name for e in net.ensembles if isinstance(e, NormalizationEnsemble)
                    and any(i is src for i in e.inputs)]
        readers += [e.name for e in net.ensembles if isinstance(e, ActivationEnsemble)
                    and e.source is src and e is not ens]
        if readers:
            raise MappingError(f"activation {ens.name!r} works in place on {src.name!r}, but "
                               f"{readers} also read {src.name!r}; connect them to {ens.name!r} "
                               "instead or use a layer that is not in place")


def _zero_grads(net, bufs: BufferPlan, dead) -> Block:
    grads = []
    for ens in net.ensembles:
        if not isinstance(ens, ActivationEnsemble):
            g = bufs.grad(ens)
            if g not in dead:
                grads.append(g)
        if isinstance(ens, Ensemble):
            grads += [g for f in ens.params if (g := bufs.field_grad(ens, f.name)) not in dead]
    return Block(tuple(zero_loop(g, f"_z{i}") for i, g in enumerate(grads)))


def _update_kernels(params, bufs: BufferPlan) -> list[Kernel]:
    """Per parameter, SGD with momentum: ``hist = mom*hist + lr*(grad + decay*param);
    param -= hist``. The runtime writes ``lr``, ``mom`` and ``decay`` per parameter into the
    scalar buffer."""
    scal = bufs.scalars(3 * len(params))
    kernels = []
    for p, (ens, name) in enumerate(params):
        val, grad, hist = bufs.field(ens, name), bufs.field_grad(ens, name), bufs.history(ens, name)
        i = Affine.of(f"_u{p}")
        v, g, h = (Ref(b, (i,), (b.size,)) for b in (val, grad, hist))
        lr, mom, decay = (Load(Ref(scal, (Affine((), 3 * p + j),), scal.shape)) for j in range(3))
        new_hist = BinOp("+", BinOp("*", mom, Load(h)),
                         BinOp("*", lr, BinOp("+", Load(g), BinOp("*", decay, Load(v)))))
        loop = Loop(f"_u{p}", 0, val.size, Block((Assign(h, new_hist), AugAssign(v, "-", Load(h)))))
        kernels.append(Kernel("sgd_update", Block((loop,)), None, "update"))
    return kernels


__all__ = ["Program", "Segment", "HostStep", "EnsemblePlan", "compile_net", "format_ir",
           "Buffer", "Const", "walk"]
