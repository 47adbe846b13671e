"""Aligned SoA buffers for a compiled program, and the pointer table native code reads."""

from __future__ import annotations

import ctypes
import os

import numpy as np

from latte.aligned import aligned_zeros, is_aligned
from latte.compiler import Program


def window(home: np.ndarray, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """The strided view of ``home`` whose item ``n`` (shaped ``shape[1:]``, C order) starts
    at element ``offset`` of ``home``'s item ``n``."""
    inner, item = [home.itemsize], home.strides[0]
    for extent in reversed(shape[2:]):
        inner.insert(0, inner[0] * extent)
    start = home.reshape(-1)[offset:]
    return np.lib.stride_tricks.as_strided(start, shape, (item, *inner))


def shared_transients(program: Program) -> dict:
    """Views of one arena for the transient buffers (:mod:`latte.compiler.buffers`) that
    every kernel using them fills (not a recurrent weight packed before a time loop and read
    at its steps), placed by :attr:`~latte.compiler.program.Program.transient_layout`.
    ``LATTE_SHARE_TRANSIENTS=0``: one allocation each (and the test forward's values in
    their own buffers)."""
    if os.environ.get("LATTE_SHARE_TRANSIENTS") == "0":
        return {}
    placed = program.transient_layout
    arena = aligned_zeros((max((end for _, end in placed.values()), default=0) // 4,), np.float32)
    return {buf: arena[at // 4: at // 4 + buf.size].reshape(buf.shape)
            for buf, (at, _) in placed.items()}


class Memory:
    """Owns every buffer of a program; ``table`` holds their addresses in plan order. A window
    of another buffer (a zero-copy join's producer) is a strided view of it. A field whose
    array has the buffer's shape and alignment is kept where its ensemble holds it (the
    ensemble's own copy, made aligned): VGG-16's 553 MB of weights are not copied again.
    Transient buffers share memory (:func:`shared_transients`); ``test_table`` points the
    test forward's intermediate values there too (``program.test_values``), their own
    arrays keeping the last training forward's."""

    def __init__(self, program: Program):
        bufs = program.buffers
        # the parameters and fields kept where their ensembles hold them
        self.arrays = {bufs.field(p.ensemble, f.name): f.array for p in program.plans
                       for f in p.ensemble.fields.values()
                       if f.array.shape == bufs.field(p.ensemble, f.name).shape
                       and is_aligned(f.array)}
        shared = shared_transients(program)
        tested = program.test_values
        self.arrays.update({b: a for b, a in shared.items() if b not in tested})
        for buf in bufs.buffers.values():
            if buf not in bufs.windows and buf not in self.arrays:
                self.arrays[buf] = aligned_zeros(buf.shape, np.int32 if buf.dtype == "int32" else np.float32)
        for buf in bufs.windows:
            home, offset = bufs.home(buf)
            self.arrays[buf] = window(self.arrays[home], buf.shape, offset)
        for plan in program.plans:
            ens = plan.ensemble
            for f in ens.fields.values():
                arr = self.arrays[bufs.field(ens, f.name)]
                if arr is not f.array:
                    arr[...] = f.array  # a Batch field broadcasts over the batch
            for acc in plan.accesses:
                if acc.table is not None:
                    self.arrays[bufs.table(acc.conn, acc.table.shape)][...] = acc.table
        self.table = _table([self.arrays[b] for b in bufs.buffers.values()])
        # the test forward's: its intermediate values in the arena (views keep it alive)
        self.test_arrays = {b: shared[b] for b in tested if b in shared}
        self.test_table = _table([self.test_arrays.get(b, self.arrays[b])
                                  for b in bufs.buffers.values()])

    def __getitem__(self, buf) -> np.ndarray:
        return self.arrays[buf]


def _table(arrays: list) -> ctypes.Array:
    """The pointer table of ``arrays`` (in plan order) that native code reads."""
    return (ctypes.c_void_p * max(1, len(arrays)))(*[a.ctypes.data for a in arrays])
