"""What an exported model is made of: the test program's native code, the buffers it
touches laid out in one arena (the passes' temporaries and the test forward's intermediate
values sharing a region of it, placed as the runtime places them), their constant
contents, and where the samples go.

:func:`model_image` reads a compiled net (after ``net.load`` of a snapshot, if any) and
prepares it for inference as ``net.predict`` does: the ensembles that prepare fields for the
test phase (dropout's all-ones mask) do so, and the host steps that do not read their
inputs in ``Phase.TEST`` (a batch norm's running statistics) run once, here; their results
become constants of the image. Any other host step the output needs would have to run in
Python: that is an :class:`~latte.errors.ExportError` naming the ensemble. A time loop
becomes a loop of the C driver, which points the step views at each step's rows as the
runtime's executor does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from latte.aligned import ALIGN
from latte.compiler import HostStep, Segment, TimeSteps, flat_steps
from latte.compiler.ir import Buffer, accesses
from latte.compiler.jit import target
from latte.compiler.pipeline import llvm_ir
from latte.errors import ExportError
from latte.lang import Phase
from latte.runtime.predict import PredictPlan, _plan, _sample_shape, _timed, prepare_fields


@dataclass(frozen=True)
class Slot:
    """One buffer of the table: its place in the arena and, when it does not start as
    zeros, the place of its initial bytes in the blob."""

    index: int
    name: str
    arena_offset: int
    nbytes: int
    blob_offset: int | None


@dataclass(frozen=True)
class Samples:
    """Where one sample's floats go in an ensemble's value buffer: ``outer`` runs (time
    steps) of ``inner`` contiguous floats, item ``b``'s run ``t`` at element
    ``offset + t * outer_stride + b * batch_stride`` of buffer slot ``slot``."""

    ensemble: str
    shape: tuple[int, ...]     # one sample, as predict takes or returns it
    slot: int
    offset: int
    outer: int
    outer_stride: int
    batch_stride: int
    inner: int


@dataclass(frozen=True)
class StepLoop:
    """A time loop of the test forward: its ``segments`` once per step t = 0..steps-1,
    after pointing each view (table slot, its buffer's slot, bytes per step, shift) at the
    rows of step t + shift of its buffer, or at its own zeros before step 0."""

    steps: int
    segments: tuple[str, ...]
    views: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class ModelImage:
    """Everything the C driver needs: ``objects`` define ``segments`` (each
    ``void seg(void **table)``); ``program`` runs them per batch of ``batch_size`` items,
    in order: a segment's name, or a :class:`StepLoop`."""

    objects: tuple[bytes, ...]
    segments: tuple[str, ...]
    program: tuple
    slots: tuple[Slot, ...]
    table_size: int
    arena_bytes: int
    blob: bytes
    batch_size: int
    input: Samples
    output: Samples
    threads: int
    blas_threads: int


def model_image(net) -> ModelImage:
    """The image of ``net``'s ``Phase.TEST`` forward to its default output, with its
    parameters and state as they are now."""
    net.init()
    plan: PredictPlan = _plan(net, None)
    program, memory = net.program, net._memory
    bufs = program.buffers
    _prepare(net, plan)
    segments = [s for s in flat_steps(plan.steps) if isinstance(s, Segment)]
    constant = {bufs.value(s.ensemble) for s in plan.steps if isinstance(s, HostStep)}
    index = {b: i for i, b in enumerate(bufs.buffers.values())}
    loops = [s for s in plan.steps if isinstance(s, TimeSteps)]
    used = sorted({a.buffer for s in segments for k in s.kernels for a in accesses(k.body)}
                  | {base for loop in loops for _, base, _ in loop.views}
                  | {bufs.value(plan.input), bufs.value(plan.output)}, key=index.__getitem__)
    shared = _shared(program, plan, used)
    slots, blob, arena = [], bytearray(), 0
    for buf in used:
        if buf in shared:
            continue
        data = memory[buf]
        blob_offset = None
        if _is_constant(buf, constant) and data.any():
            blob += bytes(-len(blob) % ALIGN)
            blob_offset = len(blob)
            blob += data.tobytes()
        slots.append(Slot(index[buf], buf.name, arena, data.nbytes, blob_offset))
        arena += data.nbytes + (-data.nbytes % ALIGN)
    for buf, (start, _) in shared.items():   # filled before they are read: no blob
        slots.append(Slot(index[buf], buf.name, arena + start, 4 * buf.size, None))
    arena += max((end for _, end in shared.values()), default=0)
    threads = bufs.threads
    objects = target().objects(program.library,
                               lambda parts: llvm_ir(program.segments(), index, threads, parts))
    order = tuple(_loop(s, bufs.time_steps, memory, index) if isinstance(s, TimeSteps)
                  else s.name for s in plan.steps if not isinstance(s, HostStep))
    return ModelImage(tuple(objects), tuple(s.name for s in segments), order, tuple(slots),
                      len(index), arena, bytes(blob), net.batch_size,
                      _samples(net, plan.input, index), _samples(net, plan.output, index),
                      threads, 1 if program.opt_level >= 2 else threads)


def _shared(program, plan: PredictPlan, used: list) -> dict:
    """The buffers of ``used`` that share one region of the arena as the runtime's do
    (:attr:`~latte.compiler.program.Program.transient_layout`: the passes' temporaries,
    and the test forward's intermediate values where the image runs the test program),
    each at its place in that region."""
    placed = program.transient_layout
    tested = program.test_values if plan.phase != "test" else frozenset()
    return {b: placed[b] for b in used if b in placed and b not in tested}


def _loop(loop: TimeSteps, steps: int, memory, index: dict) -> StepLoop:
    """``loop`` for the C driver (a forward loop of segments)."""
    inner = [s for s in loop.steps if not isinstance(s, Segment)]
    if inner or loop.reverse:
        raise ExportError(f"cannot export: time loop {loop.name!r} runs "
                          f"{type(inner[0]).__name__ if inner else 'backward'} steps, which "
                          "the C driver does not run")
    return StepLoop(steps, tuple(s.name for s in loop.steps),
                    tuple((index[view], index[base], memory[view].nbytes, shift)
                          for view, base, shift in loop.views))


def _prepare(net, plan: PredictPlan) -> None:
    """Put the net in its test-phase state as ``net.predict`` does, and run the host steps
    that compute constants from ``net.state``; refuse any other host step."""
    prepare_fields(net, plan)
    hosts = [s for s in plan.steps if isinstance(s, HostStep)]
    for step in hosts:
        if step.ensemble.reads_inputs(Phase.TEST):
            raise ExportError(f"cannot export: the output {plan.output.name!r} depends on "
                              f"{step.ensemble.name!r} ({type(step.ensemble).__name__}), an "
                              "ensemble computed by Python code at run time")
        step.ensemble.phase = Phase.TEST
    net.run_steps(hosts)


def _is_constant(buf: Buffer, constant: set) -> bool:
    """Whether ``buf``'s contents before a batch matter: parameters, fields and gather
    tables, a ``Batch`` field (dropout's mask), and the values of the host steps run at
    export time. Values and gradients the batch computes, per-thread scratch, private
    copies and step views start as zeros."""
    if buf in constant:
        return True
    owner, what = buf.key[0], buf.key[-1]
    if owner in ("scratch", "step") or isinstance(owner, Buffer):
        return False
    return what not in ("value", "grad") and not str(what).startswith("grad_")


def _samples(net, ens, index: dict) -> Samples:
    """Where ``ens``'s samples live in its value buffer (the view ``net.value`` gives is
    ``(batch, *shape)``, or ``(T, batch, *shape)`` with time steps)."""
    buf = net.program.buffers.value(ens)
    view, base = net.value(ens), net._memory[buf]
    item = 4
    timed = _timed(view, ens)
    inner = int(np.prod(ens.shape, dtype=np.int64))
    lead = view.strides[:2] if timed else (0, view.strides[0])
    if view.dtype != np.float32 or not view[(0,) * (1 + timed)].flags.c_contiguous:
        raise ExportError(f"cannot export: the values of {ens.name!r} are not float32 items "
                          "stored one after the other")
    return Samples(ens.name, _sample_shape(view, ens), index[buf],
                   (view.ctypes.data - base.ctypes.data) // item, view.shape[0] if timed else 1,
                   lead[0] // item, lead[1] // item, inner)
