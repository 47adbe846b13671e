"""The executor: runs a compiled program's steps (native segments and host arrays ops)."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np

from latte.compiler import Program, Segment
from latte.compiler.ir import Buffer, walk
from latte.runtime.distributed import Communicator
from latte.runtime.memory import Memory

_SEGMENT = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Executor:
    """Calls segments by function pointer; hands normalization ensembles numpy views.

    With a :class:`Communicator`, each parameter gradient's reduction over ranks starts
    after the last backward segment that writes it, and later steps let it progress.
    """

    def __init__(self, program: Program, memory: Memory, comm: Communicator | None = None):
        self.program, self.memory, self.comm = program, memory, comm
        self._ready_grads = _ready_grads(program, memory) if comm is not None else {}
        self._fns = {}
        segments = [s for s in program.forward + program.backward if isinstance(s, Segment)]
        for seg in segments + [program.update]:
            self._fns[seg.name] = _SEGMENT(program.library.address(seg.name))
        self._table = ctypes.cast(memory.table, ctypes.c_void_p)

    def _run(self, steps, valid: int) -> None:
        bufs, mem = self.program.buffers, self.memory
        for step in steps:
            if self.comm is not None:
                self.comm.progress()
            if isinstance(step, Segment):
                self._fns[step.name](self._table)
                if step.name in self._ready_grads:
                    self.comm.start(self._ready_grads[step.name])
                continue
            ens = step.ensemble
            values = [mem[bufs.value(i)] for i in ens.inputs]
            if step.phase == "forward":
                ens.forward(values, mem[bufs.value(ens)], valid)
            else:
                ens.backward(values, [mem[bufs.grad(i)] for i in ens.inputs],
                             mem[bufs.value(ens)], mem[bufs.grad(ens)], valid)

    def forward(self, valid: int) -> None:
        self._run(self.program.forward, valid)

    def backward(self, valid: int) -> None:
        if self.comm is not None:
            self.comm.wait_all()   # a second backward must not zero gradients in flight
        self._run(self.program.backward, valid)

    def update(self) -> None:
        if self.comm is not None:
            self.comm.wait_all()
        self._fns[self.program.update.name](self._table)


def _ready_grads(program: Program, memory: Memory) -> dict[str, list[np.ndarray]]:
    """Per backward segment, the parameter gradients it is the last to write."""
    grads = {program.buffers.field_grad(ens, name) for ens, name in program.params}
    last = {}
    for step in program.backward:
        if isinstance(step, Segment):
            for kernel in step.kernels:
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
