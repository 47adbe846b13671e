"""64-byte aligned arrays: how every buffer of a compiled program starts (a vector load of a
row start never splits a cache line). Field arrays are made so as well, so that the program
can keep a parameter where its ensemble holds it, without a copy."""

from __future__ import annotations

import numpy as np

ALIGN = 64


def aligned_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def is_aligned(array: np.ndarray) -> bool:
    """Does ``array`` start on a 64-byte boundary, C-contiguous?"""
    return array.flags.c_contiguous and array.ctypes.data % ALIGN == 0
