"""The executor: runs a compiled program's steps (native segments and host arrays ops)."""

from __future__ import annotations

import ctypes

from latte.compiler import Program, Segment
from latte.runtime.memory import Memory

_SEGMENT = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Executor:
    """Calls segments by function pointer; hands normalization ensembles numpy views."""

    def __init__(self, program: Program, memory: Memory):
        self.program, self.memory = program, memory
        self._fns = {}
        segments = [s for s in program.forward + program.backward if isinstance(s, Segment)]
        for seg in segments + [program.update]:
            self._fns[seg.name] = _SEGMENT(program.library.address(seg.name))
        self._table = ctypes.cast(memory.table, ctypes.c_void_p)

    def _run(self, steps, valid: int) -> None:
        bufs, mem = self.program.buffers, self.memory
        for step in steps:
            if isinstance(step, Segment):
                self._fns[step.name](self._table)
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
        self._run(self.program.backward, valid)

    def update(self) -> None:
        self._fns[self.program.update.name](self._table)
