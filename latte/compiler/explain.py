"""``latte explain``: the compiler's plan for a net, in words and pseudo-code."""

from __future__ import annotations

import math

from latte.compiler import HostStep, Segment, TimeSteps, trials
from latte.compiler.autodiff import derived_backward, format_neuron
from latte.compiler.fusion import ROW_DIM, planner_chain
from latte.compiler.ir import Gemm, Ref, accesses, touched, walk
from latte.compiler.passes.pack import timed
from latte.compiler.passes.tiling import FLOAT_BYTES
from latte.compiler.planner import brainslug, occam
from latte.compiler.printer import fmt_stmt, format_ir
from latte.compiler.program import AFTER_LOOP, BEFORE_LOOP
from latte.compiler.synthesis import neuron_info
from latte.lang import Phase, defines_backward


def _dims(ens, dims) -> str:
    return ", ".join(f"dim {d} (size {ens.shape[d]})" for d in dims) or "none"


def _locality(program) -> list[str]:
    """Fused groups with tile heights and working sets; the planners' traffic estimates."""
    out = [""]
    if program.groups or program.test_groups:
        out.append("fused groups (tile by tile):")
        out += describe(program.groups, program.budget)
    if program.test_groups:
        out.append("fused in the test forward only (where statistics from the net's state are "
                   "constants):")
        out += describe(program.test_groups, program.budget)
    if not program.groups and not program.test_groups and program.opt_level >= 3:
        out.append("fused groups: none (no chain of tiled layers that fuses legally within the budget)")
    lines = [b for b in program.buffers.buffers.values() if b.key[-1] == "lines"]
    if lines:
        test = {a.buffer for s in program.test if isinstance(s, Segment) for k in s.kernels
                for a in accesses(k.body)}
        out.append("  line buffers (per thread: channels x rows x the rest), instead of whole buffers:")
        out += [f"    {b.name[:-len('.lines')]}: {' x '.join(map(str, b.shape[1:]))} "
                f"({b.size // b.shape[0] * FLOAT_BYTES / 1024:.0f} KiB), "
                f"{'test forward' if b in test else 'training backward'}" for b in lines]
    kept = _in_locals(program)
    if kept:
        out.append("  kept in registers by the test forward (each element read back as soon as it "
                   f"is computed): {', '.join(kept)}")
    chain = planner_chain(program.plans)
    if len(chain) > 1 and program.budget:
        batch, budget = program.buffers.batch_size, program.budget
        out += ["", "planners' traffic model (rows: the tallest tiles that fit; the groups above "
                "take the lowest that is wide enough):"]
        for plan in (occam(chain, budget, batch=batch), brainslug(chain, budget, batch=batch)):
            out.append("")
            out.extend("  " + line for line in plan.format().splitlines())
    return out


def _in_locals(program) -> list[str]:
    """The fused groups' intermediate values that no buffer holds in the test forward: its
    group's kernel keeps each element in a local (``localize.keep_in_locals``)."""
    kernels = {k.name: k for s in program.test if isinstance(s, Segment) for k in s.kernels}
    out = []
    for g in program.groups + program.test_groups:
        phase = "test" if g in program.test_groups else "forward"
        kernel = kernels.get(g.owner("forward").kernels[phase].name)
        if kernel is None:
            continue
        names = {b.name for b in touched(kernel.body)}
        for plan in g.plans[:-1]:
            value = program.buffers.value_home(plan.ensemble).name
            if value not in names and f"{value}.lines" not in names:
                out.append(plan.ensemble.name)
    return out


def _test_phase(program) -> list[str]:
    """How the test forward differs from the training one: host steps that do not read their
    inputs there (a batch norm's statistics, from ``net.state``) run first, and the kernels
    only they read do not run."""
    def ensembles(steps):
        return [k.ensemble.name for s in steps if isinstance(s, Segment) for k in s.kernels
                if k.ensemble is not None]
    first = [s.ensemble for s in program.test
             if isinstance(s, HostStep) and not s.ensemble.reads_inputs(Phase.TEST)]
    ran = set(ensembles(program.test))
    ran |= {p.ensemble.name for g in program.groups + program.test_groups
            if g.owner("forward").ensemble.name in ran for p in g.plans}
    skipped = [n for n in ensembles(program.forward) if n not in ran]
    out = [f"test forward: {', '.join(e.name for e in first)} run first (from the net's "
           "state, not their inputs)"] if first else []
    if skipped:
        out.append(f"  not run in the test forward (only those read them): {', '.join(skipped)}")
    out += _normalized(program, set(first), ran)
    return [""] + out if out else []


def _normalized(program, stats: set, ran: set) -> list[str]:
    """Per ensemble that reads statistics from the net's state in the test forward (a batch
    norm's element-wise part): fused with the kernel of the ensemble it normalizes, or why
    not. (Folding into the producer's weights is not done: a fused group applies the
    statistics to each tile its producer just wrote, in cache.)"""
    groups = {p.ensemble: g for g in program.groups + program.test_groups for p in g.plans}
    out = []
    for plan in program.plans:
        ens = plan.ensemble
        srcs = [a.conn.source for a in plan.accesses]
        if ens.name not in ran or not stats & set(srcs):
            continue
        prod = next((s for s in srcs if s not in stats), None)
        g = groups.get(ens)
        head = f"  {ens.name!r} (with {', '.join(s.name for s in srcs if s in stats)}):"
        if prod is not None and g is not None and prod in g.rows:
            out.append(f"{head} fused with {prod.name!r} in group {g.name}, not folded into its "
                       "weights")
            continue
        readers = [p.ensemble.name for p in program.plans if p.ensemble is not ens
                   and p.ensemble.name in ran and any(a.conn.source is prod for a in p.accesses)]
        why = ("fusion runs at opt level 3" if program.opt_level < 3 else
               f"{prod.name!r} is also read by {', '.join(map(repr, readers))}" if readers else
               f"{prod.name!r} is not a tiled loop nest, or no tiling of a chain through it is "
               "legal (isl) within the cache budget")
        where = f"; it runs in group {g.name}" if g is not None else ""
        out.append(f"{head} neither fused with {prod.name!r} nor folded into its weights: "
                   f"{why}{where}")
    return out


def _joins(program) -> list[str]:
    """Each concatenation (:mod:`latte.compiler.joins`): zero-copy, its inputs' buffers
    windows of its own, or a copy and why."""
    out = [f"  {j.ensemble.name!r}: " + (
        "zero-copy: " + ", ".join(f"{e.name!r} from channel {first}" for e, first in j.inputs)
        if j.why_not is None else f"a copy: {j.why_not}") for j in program.joins]
    return ["", "joins (where safe, the inputs write into the join's buffers):", *out] if out else []


def _time(program) -> list[str]:
    """The time loops: which ensembles run step by step, which once over every step."""
    bufs = program.buffers
    if bufs.time_steps == 1:
        return []
    batch = bufs.batch_size // bufs.time_steps
    loops = [s for s in program.forward if isinstance(s, TimeSteps)]
    looped = {e for s in loops for e in s.ensembles}
    once = [p.ensemble.name for p in program.plans if p.ensemble not in looped]
    out = ["", f"time: {bufs.time_steps} steps of {batch} items"]
    for loop in loops:
        names = [e.name for e in loop.ensembles]
        out.append(f"  time loop {loop.name} (step by step, {batch} items a step; backward "
                   f"from the last step down): {', '.join(names)}")
    out.append(f"  once over all {bufs.batch_size} items (no recurrence): "
               f"{', '.join(once) or 'none'}")
    for phase, names in program.fused_steps:
        out.append(f"  one loop over a step's items ({phase}): {' + '.join(names)}")
    after = [p.ensemble.name for p in program.plans if AFTER_LOOP in p.kernels]
    if after:
        out.append(f"  parameter gradients once after the backward loop, over all "
                   f"{bufs.batch_size} items: {', '.join(after)}")
    packed = [f"{p.ensemble.name} ({', '.join(ph for ph, k in BEFORE_LOOP.items() if k in p.kernels)})"
              for p in program.plans if any(k in p.kernels for k in BEFORE_LOOP.values())]
    if packed:
        out.append(f"  parameters packed once before the loop, the step's GEMMs over them tiled: "
                   f"{', '.join(packed)}")
    return out


def describe(groups: list, budget: int) -> list[str]:
    """Each fused group, its tile heights, tiles per item and per-tile working set."""
    out = []
    for g in groups:
        rows = ", ".join(f"{p.ensemble.name} {g.rows[p.ensemble]}" for p in g.plans)
        first = g.plans[0].ensemble
        out.append(f"  group {g.name}: tile rows {rows} ({first.shape[ROW_DIM] // g.rows[first]} "
                   f"tiles an item); working set per tile {g.footprint / 1024:.0f} KiB (budget "
                   f"{budget / 1024:.0f} KiB)")
        for c in g.choices.values():
            fields = ", ".join(b.name for b in c.fields)
            out.append(f"    {fields}: {'recomputed in backward' if c.recompute else 'kept'} "
                       f"(estimated off-chip bytes: keep {c.keep_bytes / 2**20:.2f} MiB, "
                       f"recompute {c.recompute_bytes / 2**20:.2f} MiB)")
    return out


def _trial(g: Gemm) -> list[str]:
    """Where this machine timed ``g``'s product both ways (:mod:`latte.compiler.trials`): the
    ratio that chose BLAS or the micro-kernel on B in place."""
    if g.trans_b or (g.panel and g.packed) or not timed(g):
        return []
    ratio = trials.speedup(trials.key(g))
    return [] if ratio is None else [
        f"      timed on this machine: the micro-kernel on B in place ran it at {ratio:.2f}x "
        "BLAS's speed"]


def _arena(program) -> list[str]:
    """How much memory the transient buffers and the test forward's intermediate values
    share (:attr:`Program.transient_layout`)."""
    placed = program.transient_layout
    if not placed:
        return []
    parts = []
    for what, bufs in (("temporaries of passes", [b for b in placed if b not in program.test_values]),
                       ("the test forward's intermediate values", list(program.test_values))):
        mib = sum(placed[b][1] - placed[b][0] for b in bufs) / 2**20
        parts.append(f"{what} {len(bufs)} buffers, {mib:.1f} MiB")
    shared = max(end for _, end in placed.values())
    return [f"arena: {'; '.join(parts)}; together {shared / 2**20:.1f} MiB (each filled before "
            "it is read, apart from those in use with it)"]


def explain_program(program) -> str:
    """Per ensemble: shared dimensions, GEMM matches and the generated loops."""
    cached = program.library is not None and program.library.from_cache
    made = "stored program loaded (not compiled)" if program.stored else "compiled"
    out = [f"opt_level {program.opt_level}; {len(program.buffers.buffers)} buffers; {made}; "
           f"native code {'from the disk cache' if cached else 'compiled'}", *_arena(program)]
    out += _locality(program)
    out += _test_phase(program)
    out += _joins(program)
    out += _time(program)
    for plan in program.plans:
        ens = plan.ensemble
        out.append("")
        out.append(f"== ensemble {ens.name!r}: {ens.neuron_type.__name__} x {ens.shape}")
        for k, acc in enumerate(plan.accesses):
            kind = "affine" if acc.dims is not None else "gather table"
            if acc.quotients():   # floor divisions of sink dimensions, strip-mined
                kind = "quasi-affine, strip-mined " + ", ".join(
                    f"{_dims(ens, (d,))} by {q}" for d, q in acc.quotients().items())
            pad = "" if acc.in_bounds else f", padded with {acc.conn.padding:g}"
            pad += ", recurrent: the step before" if acc.conn.recurrent else ""
            out.append(f"  input {k} from {acc.conn.source.name!r}: {acc.length} values per "
                       f"neuron ({kind}{pad}); shared along {_dims(ens, acc.shared_dims())}")
            if acc.relation is not None:
                out.append(f"    relation {acc.relation}")
        for name, dims in plan.param_shared_dims().items():
            out.append(f"  param {name!r} {ens.fields[name].array.shape}: shared along {_dims(ens, dims)}")
        if "backward" in plan.kernels and not defines_backward(ens.neuron_type):
            out.append("  backward: derived from forward (reverse mode):")
            body = derived_backward(ens, neuron_info(ens, plan.accesses))
            out.extend("    " + line for line in format_neuron(body).splitlines())
        for phase, kernel in plan.kernels.items():
            gemms = [n for n in walk(kernel.body) if isinstance(n, Gemm)]
            if phase in BEFORE_LOOP.values():   # packing nests
                continue
            out.append(f"  {phase}: {len(gemms)} GEMM match(es)")
            if any(isinstance(r, Ref) and ".flipped" in r.buffer.name
                   for r in walk(kernel.body)):
                out.append("    input gradient as a gather: the output gradient convolved with "
                           "the weights transposed and flipped (copied once per run)")
            for planes in sorted({g.a_buf.shape[0] for g in gemms if g.a_buf.key[0] == "derived"}):
                size = math.isqrt(planes)
                out.append(f"    Winograd F({size - 2}x{size - 2}, 3x3): the 3x3 window as {planes} "
                           f"GEMMs over transformed {size}x{size} tiles of the source (weights "
                           "transformed once per run)")
            if any(".wgrad" in g.c_buf.name for g in gemms):
                out.append("    Winograd F(3x3, 2x2) weight gradient: 16 GEMMs over transformed "
                           "output-gradient and source tiles, summed over the batch, transformed "
                           "back once")
            if any(g.c_buf.key[0] == "derived" and (".winograd" in g.c_buf.name
                                                   or ".wgrad" in g.c_buf.name) for g in gemms):
                out.append("    Winograd products over the whole batch's tiles, the threads "
                           "sharing the planes (the transformed weights outweigh the tiles)")
            for g in gemms:
                out.extend("    " + line.strip() for line in fmt_stmt(g))
                out.extend(_trial(g))
        for kernel in plan.kernels.values():
            out.append("")
            out.extend("  " + line for line in format_ir(kernel).splitlines())
    return "\n".join(out)
