"""Shared benchmark harness: each measurement runs in its own worker process.

Two threaded runtimes in one process (PyTorch's OpenMP pool and OpenBLAS's) slow each
other down, so the driver starts one worker per (framework, threads) and prints the
medians side by side, measured in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time


def median_ms(fn, warmup: int = 5, repeat: int = 30) -> float:
    """Median wall time of ``fn()`` in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run_worker(script: str, framework: str, threads: int, extra: list[str] | None = None) -> dict | None:
    """Run ``script --worker framework --threads N`` and parse its JSON line (None: skipped)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, script, "--worker", framework, "--threads", str(threads), *(extra or [])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(f"[{framework} x{threads} failed]\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def worker_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default=None, help="internal: run one measurement")
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=30)
    return ap.parse_args()


def emit(result: dict) -> None:
    print(json.dumps(result), flush=True)


def openblas_core() -> str:
    from latte.compiler.blas import blas  # noqa: PLC0415

    lib = blas()
    lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
    return lib.scipy_openblas_get_corename().decode()


def table(rows: list[list[str]], header: list[str]) -> str:
    """A GitHub-markdown table."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(r) for r in rows])
