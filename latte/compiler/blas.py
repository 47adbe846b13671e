"""The BLAS library generated code calls: scipy-openblas32 (LP64, ``scipy_`` prefix)."""

from __future__ import annotations

import ctypes
import functools
import os


@functools.lru_cache(maxsize=None)
def blas() -> ctypes.CDLL:
    import scipy_openblas32

    path = os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so")
    return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def set_blas_threads(n: int) -> None:
    """Threads OpenBLAS may use inside one sgemm call."""
    blas().scipy_openblas_set_num_threads(ctypes.c_int(max(1, int(n))))


def blas_threads() -> int:
    return int(blas().scipy_openblas_get_num_threads())
