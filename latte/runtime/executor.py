"""The executor: runs a compiled program's steps (native segments and host arrays ops)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import time
from typing import Callable

import numpy as np

from latte.compiler import HostStep, Program, Segment, TimeSteps, flat_steps
from latte.compiler.codegen import BOUNDS_OFFSET, BOUNDS_SITE
from latte.compiler.ir import Buffer, Ref, walk
from latte.compiler.jit import CodeLibrary
from latte.errors import CompileError
from latte.runtime.distributed import Communicator
from latte.runtime.memory import Memory
from latte.runtime.profile import Profile

_SEGMENT = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class NativeCode:
    """The segments of one code library, called on one buffer table. With bounds checks
    compiled in (``LATTE_CHECK_BOUNDS=1``), a call raises if the segment recorded an access
    outside a buffer (the access was skipped)."""

    def __init__(self, library: CodeLibrary, segments: list[Segment], table):
        self._fns = {seg.name: _SEGMENT(library.address(seg.name)) for seg in segments}
        self.table = table
        self._table = ctypes.cast(table, ctypes.c_void_p)
        # code built with LATTE_CHECK_BOUNDS=1 has these
        self._site = library.global_address(BOUNDS_SITE)
        self._offset = library.global_address(BOUNDS_OFFSET)

    def call(self, segment: str) -> None:
        self._fns[segment](self._table)
        if self._site:
            site = ctypes.c_void_p.from_address(self._site)
            if site.value:
                what = ctypes.string_at(site.value).decode()
                offset = ctypes.c_int64.from_address(self._offset).value
                site.value = None
                raise CompileError(f"segment {segment}, {what}: the compiled code accessed "
                                   f"offset {offset}, outside the buffer (the access was "
                                   "skipped; a compiler bug: please report it)")


class Executor:
    """Calls segments by function pointer; hands normalization ensembles numpy views.

    With a :class:`Communicator`, each parameter gradient's reduction over ranks starts
    after the last backward segment that writes it, and later steps let it progress.

    With a :class:`Profile`, each step is timed and charged to the ensemble(s) it runs (the
    program should then have one segment per ensemble or fused group:
    ``compile_net(split_segments=True)``).
    """

    def __init__(self, program: Program, memory: Memory, comm: Communicator | None = None,
                 profile: Profile | None = None):
        self.program, self.memory, self.comm, self.profile = program, memory, comm, profile
        self._ready_grads = _ready_grads(program, memory) if comm is not None else {}
        self._update_grads: dict[int, list[np.ndarray]] = {}   # id(segment) -> its gradients
        self.code = NativeCode(program.library, program.segments(), memory.table)
        # the test forward's intermediate values in the arena (program.test_values)
        self.test_code = NativeCode(program.library, program.segments(), memory.test_table)
        self._slots = {b: i for i, b in enumerate(program.buffers.buffers.values())}
        self._loop_views: dict[int, tuple] = {}   # id(TimeSteps) -> its views' table entries
        self._host_calls: dict[tuple, Callable[[], None]] = {}   # (id(HostStep), valid) -> call
        fused = {(g.owner(phase).ensemble, phase): g.name
                 for g in program.groups for phase in ("forward", "backward")}
        # a group fused in the test forward alone runs from its owner's kernel "test"
        in_test = {**fused, **{(g.owner("forward").ensemble, "forward"): g.name
                               for g in program.test_groups}}
        self._labels = {}
        if profile is not None:
            self._labels = {id(s): step_label(s, in_test) for s in program.test}
            self._labels.update({id(s): step_label(s, fused)
                                 for s in program.forward + program.backward})
            profile.count_flops(program, self._labels)

    def _run(self, steps, valid: int, code: NativeCode | None = None) -> None:
        """Run ``steps`` with the segments of ``code`` (default: the training table's)."""
        code = code or self.code
        for step in steps:
            if self.comm is not None:
                self.comm.progress()
            if isinstance(step, Segment):
                code.call(step.name)
                if step.name in self._ready_grads:
                    self.comm.start(self._ready_grads[step.name])
                continue
            if isinstance(step, TimeSteps):
                self._time_steps(step, valid, code)
                if step.name in self._ready_grads:
                    self.comm.start(self._ready_grads[step.name])
                continue
            self._host_step(step, valid)

    def _host_step(self, step: HostStep, valid: int) -> None:
        """A normalization ensemble's array code on its inputs' (and its own) arrays; with
        time steps and a partial batch, on copies of the real items' rows, written back.
        A call on whole arrays is kept (its views never change): a ResNet-50 test forward
        runs 106 host steps, and their bookkeeping took as long as the arrays' work."""
        call = self._host_calls.get((id(step), valid))
        if call is None:
            call, whole = self._host_call(step, valid)
            if whole:
                self._host_calls[id(step), valid] = call
        call()

    def _host_call(self, step: HostStep, valid: int) -> tuple[Callable[[], None], bool]:
        """A function running ``step`` on a batch of ``valid`` items, and whether it works on
        views of the whole arrays (else on copies of rows, made here)."""
        bufs, mem, ens = self.program.buffers, self.memory, step.ensemble
        rows = _real_rows(bufs, valid)
        valid = bufs.batch_size if valid * bufs.time_steps >= bufs.batch_size else valid
        if rows is not None:
            valid = len(rows)
        mine = [bufs.value(ens)] + ([bufs.grad(ens)] if step.phase == "backward" else [])
        written = [bufs.grad(i) for i in ens.inputs] if step.phase == "backward" else mine
        arrays = {b: mem[b] if rows is None else mem[b][rows]
                  for b in [bufs.value(i) for i in ens.inputs] + mine + written}
        values = [arrays[bufs.value(i)] for i in ens.inputs]
        if step.phase == "forward":
            run = functools.partial(ens.forward, values, arrays[bufs.value(ens)], valid)
        else:
            run = functools.partial(ens.backward, values, [arrays[bufs.grad(i)] for i in ens.inputs],
                                    arrays[bufs.value(ens)], arrays[bufs.grad(ens)], valid)
        if rows is None:
            return run, True

        def copied() -> None:
            run()
            for b in written:
                mem[b][rows] = arrays[b]
        return copied, False

    def _time_steps(self, loop: TimeSteps, valid: int, code: NativeCode) -> None:
        """Run ``loop``'s steps once per time step, its step views on that step's rows."""
        mem, table = self.memory, code.table
        if id(loop) not in self._loop_views:
            self._loop_views[id(loop)] = tuple(
                (self._slots[view], mem[base].ctypes.data, mem[view].nbytes, shift,
                 mem[view].ctypes.data, shift < 0 and base.key[1] != "value")
                for view, base, shift in loop.views)
        views = self._loop_views[id(loop)]
        for _, _, row, _, before, dropped in views:
            if dropped:   # gradients into the step before step 0 go here, and nowhere
                ctypes.memset(before, 0, row)
        steps = range(self.program.buffers.time_steps)
        for t in (reversed(steps) if loop.reverse else steps):
            for slot, start, row, shift, before, _ in views:
                table[slot] = start + (t + shift) * row if t + shift >= 0 else before
            self._run(loop.steps, valid, code)

    def _run_profiled(self, steps, valid: int, phase: str, code: NativeCode | None = None) -> None:
        """:meth:`_run`, one step at a time under a clock (kept apart so that the unprofiled
        path pays nothing)."""
        clock, profile, labels = time.perf_counter, self.profile, self._labels
        profile.count(phase)
        for step in steps:
            start = clock()
            self._run((step,), valid, code)
            profile.add(labels[id(step)], phase, clock() - start)

    def forward(self, valid: int, phase: str = "forward") -> None:
        """Run the forward steps of ``phase``: ``"forward"`` (training) or ``"test"`` (no
        backward follows: fused groups keep their intermediates in line buffers, the other
        intermediate values live in the arena)."""
        test = phase == "test"
        steps, code = (self.program.test, self.test_code) if test else (self.program.forward, self.code)
        if self.profile is None:
            self._run(steps, valid, code)
        else:
            self._run_profiled(steps, valid, phase, code)

    def backward(self, valid: int) -> None:
        if self.comm is not None:
            self.comm.wait_all()   # a second backward must not zero gradients in flight
        if self.profile is None:
            self._run(self.program.backward, valid)
        else:
            self._run_profiled(self.program.backward, valid, "backward")

    def update(self, code: NativeCode, segments: list[Segment], last: bool = True) -> None:
        """Run update ``segments`` of ``code`` (a solver's update, or the reductions around
        it); each runs once the reductions over ranks of the gradients it reads are done:
        under MPI the later reductions keep going while the earlier parameters update.
        ``last``: these segments end the training step."""
        for seg in segments:
            if self.comm is not None:
                if id(seg) not in self._update_grads:
                    self._update_grads[id(seg)] = [self.memory[b] for b in
                                                   _param_grads(seg, self.program)]
                self.comm.wait(self._update_grads[id(seg)])
            if self.profile is None:
                code.call(seg.name)
                continue
            start = time.perf_counter()
            code.call(seg.name)
            self.profile.add(step_label(seg), "update", time.perf_counter() - start)
        if last and self.comm is not None:
            self.comm.end_step()
        if last and self.profile is not None:
            self.profile.count("update")


def _real_rows(bufs, valid: int) -> np.ndarray | None:
    """With time steps and a partial batch, the rows of a batched buffer that hold real
    items (the first ``valid`` of every step); None where the first ``valid`` rows do."""
    batch = bufs.batch_size // bufs.time_steps
    if bufs.time_steps == 1 or valid >= batch or valid == 0:   # none real: no copies either
        return None
    return (np.arange(bufs.time_steps)[:, None] * batch + np.arange(valid)).ravel()


def step_label(step, fused: dict | None = None) -> str:
    """The profile row of a step: its ensembles' names in order, joined by ``+``; a kernel
    that belongs to no ensemble (zeroing gradients, the SGD update) as ``(kernel name)``.

    ``fused`` maps ``(ensemble, phase)`` of a fused group's kernel (its first member forward,
    its last backward) to the group's name (its members joined by ``+``): one kernel runs
    them all, so they share one row.
    """
    if isinstance(step, HostStep):
        return step.ensemble.name
    if isinstance(step, TimeSteps):   # one row for the whole loop
        return "+".join(dict.fromkeys(step_label(s, fused) for s in step.steps))
    fused = fused or {}
    names = []
    for kernel in step.kernels:
        if kernel.ensemble is None:
            name = f"({kernel.name})"
        else:
            name = fused.get((kernel.ensemble, kernel.phase), kernel.ensemble.name)
        if name not in names:
            names.append(name)
    return "+".join(names)


def _param_grads(segment: Segment, program: Program) -> list:
    """The parameter gradient buffers ``segment`` reads."""
    grads = {program.buffers.field_grad(ens, name) for ens, name in program.params}
    return sorted({r.buffer for k in segment.kernels for r in walk(k.body)
                   if isinstance(r, Ref) and r.buffer in grads}, key=lambda b: b.name)


def _ready_grads(program: Program, memory: Memory) -> dict[str, list[np.ndarray]]:
    """Per backward segment (or time loop: its steps add to a gradient at every time step),
    the parameter gradients it is the last to write."""
    grads = {program.buffers.field_grad(ens, name) for ens, name in program.params}
    last = {}
    for step in program.backward:
        if isinstance(step, (Segment, TimeSteps)):
            for kernel in [k for s in flat_steps([step]) for k in s.kernels]:
                for node in walk(kernel.body):
                    for f in dataclasses.fields(node):
                        buf = getattr(node, f.name)
                        if isinstance(buf, Buffer) and buf in grads:
                            last[buf] = step.name
    out: dict[str, list[np.ndarray]] = {}
    for ens, name in program.params:
        buf = program.buffers.field_grad(ens, name)
        if buf in last:
            out.setdefault(last[buf], []).append(memory[buf])
    return out
