"""The BLAS library generated code calls: scipy-openblas32 (LP64, ``scipy_`` prefix)."""

from __future__ import annotations

import ctypes
import functools
import os


@functools.lru_cache(maxsize=None)
def blas() -> ctypes.CDLL:
    from latte.compiler.machine import AVX2_CPU, target_cpu  # noqa: PLC0415 (imports this)

    if target_cpu()[0] == AVX2_CPU:   # code made for an AVX2 machine: its kernels
        os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")
    # start with no worker threads (they would idle against latte's own); set_blas_threads
    # grows the pool where sgemm itself should be threaded. Importing the wheel loads it.
    saved = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import scipy_openblas32

        path = os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so")
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    finally:
        if saved is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = saved


def set_blas_threads(n: int) -> None:
    """Threads OpenBLAS may use inside one sgemm call."""
    blas().scipy_openblas_set_num_threads(ctypes.c_int(max(1, int(n))))


def pin_other_blas() -> None:
    """Other OpenBLAS copies in the process (numpy ships its own) run on one thread: their
    idle pools would fight latte's threads for the cores."""
    ours = os.path.realpath(blas()._name)
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line and "/" in line}
    for path in paths - {ours}:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                     "openblas_set_num_threads"):
            if hasattr(lib, name):
                getattr(lib, name)(ctypes.c_int(1))
                break
