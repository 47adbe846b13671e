"""What the compiler needs to know about the machine: cache sizes, read from sysfs, and the
CPU it makes code for (:func:`target_cpu`: the host's, as LLVM names it) and its vector
registers; and what the profiler measures its speed against: one core's peak
(:func:`peak`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np

from latte.compiler.blas import blas
from latte.compiler.cache import cache_dir, write_atomic

_SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
_DEFAULTS = {1: 32 << 10, 2: 1 << 20, 3: 8 << 20}


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


@functools.lru_cache(maxsize=None)
def cache_sizes() -> dict[int, int]:
    """Bytes of the data (or unified) cache per level, as seen by one core."""
    sizes = dict(_DEFAULTS)
    for index in sorted(_SYS_CACHE.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            sizes[int((index / "level").read_text())] = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    return sizes


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: fewer than the machine has under
    ``taskset`` or a container's CPU set)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


#: LLVM's CPU an AVX2 target (``LATTE_TARGET=avx2``) names, and the feature families it
#: leaves out of the host's.
AVX2_CPU, _NOT_AVX2 = "haswell", ("avx512", "avx10", "evex512", "amx")


def runs_avx2() -> bool:
    """Does this host run code made for an AVX2 machine (AVX2 and FMA)?"""
    features = llvm.get_host_cpu_features()
    return bool(features.get("avx2") and features.get("fma"))


@functools.lru_cache(maxsize=None)
def target_cpu() -> tuple[str, llvm.FeatureMap]:
    """LLVM's name and features of the CPU that code is made for: the host's, or with
    ``LATTE_TARGET=avx2`` an AVX2 machine's (Haswell's, with the host's features less
    AVX-512 and its successors), so that an AVX-512 host runs the tests and benchmarks
    of an AVX2 one (OpenBLAS's Haswell kernels with it: :func:`~latte.compiler.blas.blas`)."""
    name, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features()
    target = os.environ.get("LATTE_TARGET", "host")
    if target == "host":
        return name, features
    if target != "avx2":
        raise ValueError(f"LATTE_TARGET={target!r}: expected 'host' or 'avx2'")
    if not runs_avx2():
        raise ValueError(f"LATTE_TARGET=avx2: this CPU ({name}) has no AVX2 and FMA to run it")
    return AVX2_CPU, llvm.FeatureMap({f: on and not f.startswith(_NOT_AVX2)
                                       for f, on in features.items()})


@functools.lru_cache(maxsize=None)
def vector_registers() -> tuple[int, int]:
    """``(bits, count)`` of the target's widest float vector registers: AVX-512 has 32 of 512
    bits, AVX 16 of 256, SSE 16 of 128."""
    features = target_cpu()[1]
    if features.get("avx512f"):
        return 512, 32
    return (256 if features.get("avx") else 128), 16


# ---------------------------------------------------------------- the peak (the profiler's yardstick)

#: Square sizes of the sgemm timed for the peak: a cache-resident one (finishes within a
#: scheduler slice on a loaded machine) and a larger one.
PEAK_SIZES = (512, 1024)


@dataclass(frozen=True)
class Peak:
    """One core's floating-point peak, as an OpenBLAS sgemm on one thread reaches it; the
    peak at N threads is taken as N times that (not measured)."""

    cpu: str            # the CPU's model name
    llvm_cpu: str       # LLVM's name for it (the code latte generates is made for it)
    vector_bits: int    # the widest float vectors it has
    blas: str           # the OpenBLAS build that was timed
    gflops: float       # one core, single precision

    def at(self, threads: int) -> float:
        """GFLOP/s at ``threads`` threads: one core's times ``threads``."""
        return self.gflops * max(threads, 1)

    def describe(self, threads: int) -> str:
        return (f"{self.cpu} ({self.llvm_cpu}, {self.vector_bits}-bit vectors); peak: "
                f"sgemm on one core {self.gflops:.1f} GFLOP/s x {threads} thread"
                f"{'s' if threads != 1 else ''} = {self.at(threads):.1f} GFLOP/s")


def host() -> dict[str, str | int]:
    """The CPU's model name, LLVM's name and features for it, its vector width in bits and
    the OpenBLAS build: what a measured peak is valid for."""
    llvm_cpu, features = target_cpu()
    config = blas().scipy_openblas_get_config
    config.restype = ctypes.c_char_p
    return {"cpu": _model_name(), "llvm_cpu": llvm_cpu,
            "features": features.flatten(), "vector_bits": vector_registers()[0],
            "blas": config().decode()}


def _model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def one_blas_thread():
    """OpenBLAS's ``cblas_sgemm`` (CBLAS arguments) with its pool held at one thread."""
    lib = blas()
    sgemm = lib.scipy_cblas_sgemm
    sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                           ctypes.c_void_p, ctypes.c_int]
    threads = lib.scipy_openblas_get_num_threads()
    lib.scipy_openblas_set_num_threads(1)
    try:
        yield sgemm
    finally:
        lib.scipy_openblas_set_num_threads(threads)


def measure_sgemm(sizes: tuple[int, ...] = PEAK_SIZES, seconds: float = 1.0) -> float:
    """GFLOP/s of OpenBLAS sgemm on one thread: the best run of square products of each
    size (at least 3 runs each, more within ``seconds``; the best resists other load)."""
    best = 0.0
    with one_blas_thread() as sgemm:
        for n in sizes:
            a = np.random.default_rng(0).random((n, n), dtype=np.float32)
            c = np.empty_like(a)
            runs, deadline = 0, time.perf_counter() + seconds / len(sizes)
            while runs < 4 or (runs < 50 and time.perf_counter() < deadline):
                start = time.perf_counter()   # the first run warms up
                sgemm(101, 111, 111, n, n, n, 1.0, a.ctypes.data, n, a.ctypes.data, n, 0.0,
                      c.ctypes.data, n)
                if runs:
                    best = max(best, 2.0 * n ** 3 / (time.perf_counter() - start) / 1e9)
                runs += 1
    return best


def peak(measure: Callable[[], float] = measure_sgemm) -> Peak:
    """This machine's :class:`Peak` (``measure()``: one core's GFLOP/s), :func:`measured`."""
    info = host()
    fields = {k: info[k] for k in ("cpu", "llvm_cpu", "vector_bits", "blas")}
    return Peak(**fields, gflops=measured("gflops", measure, "peak"))


def measured(name: str, measure: Callable[[], float], prefix: str | None = None) -> float:
    """``measure()`` (a positive number) on this machine: measured the first time and cached
    in the compile cache's folder as ``{prefix or name}-{key}.json``, keyed by the CPU, its
    features and the OpenBLAS build; later calls, in any process, read the file (a damaged
    one is measured again). Processes that measure at once all take the first value
    written, so that they make the same choices."""
    info, path = _record(name, prefix)
    try:
        found = _read(path, name)
        if found is not None:
            return found
        damaged = True
    except FileNotFoundError:
        damaged = False
    except (OSError, ValueError, KeyError, TypeError):
        damaged = True   # measure again, and replace it
    value = float(measure())
    try:
        write_atomic(path, json.dumps({**info, name: value}, indent=1).encode(), replace=damaged)
        return value
    except OSError:
        pass   # another process wrote it meanwhile, or a read-only cache
    try:
        return _read(path, name) or value
    except (OSError, ValueError, KeyError, TypeError):
        return value


def recorded(name: str, prefix: str | None = None) -> float | None:
    """What :func:`measured` cached for ``name`` on this machine; None if nothing (valid)."""
    try:
        return _read(_record(name, prefix)[1], name)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record(name: str, prefix: str | None) -> tuple[dict, Path]:
    """This machine's description and the file holding ``name``'s value on it."""
    info = host()
    key = hashlib.sha256(json.dumps({**info, "name": name}, sort_keys=True).encode()).hexdigest()
    return info, cache_dir() / f"{prefix or name}-{key[:16]}.json"


def _read(path: Path, name: str) -> float | None:
    value = float(json.loads(path.read_text())[name])
    return value if math.isfinite(value) and value > 0 else None
