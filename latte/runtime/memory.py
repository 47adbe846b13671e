"""Aligned SoA buffers for a compiled program, and the pointer table native code reads."""

from __future__ import annotations

import ctypes

import numpy as np

from latte.compiler import Program

ALIGN = 64


def aligned_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class Memory:
    """Owns every buffer of a program; ``table`` holds their addresses in plan order."""

    def __init__(self, program: Program):
        self.arrays = {}
        for buf in program.buffers.buffers.values():
            self.arrays[buf] = aligned_zeros(buf.shape, np.int32 if buf.dtype == "int32" else np.float32)
        bufs = program.buffers
        for plan in program.plans:
            ens = plan.ensemble
            for f in ens.fields.values():
                arr = self.arrays[bufs.field(ens, f.name)]
                arr[...] = f.array  # a Batch field broadcasts over the batch
            for acc in plan.accesses:
                if acc.table is not None:
                    self.arrays[bufs.table(acc.conn, acc.table.shape)][...] = acc.table
        addrs = [self.arrays[b].ctypes.data for b in bufs.buffers.values()]
        self.table = (ctypes.c_void_p * max(1, len(addrs)))(*addrs)

    def __getitem__(self, buf) -> np.ndarray:
        return self.arrays[buf]


