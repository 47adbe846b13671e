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
import resource
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


def machine() -> str:
    """The CPU, its core count and vector width, for a table's caption (what latte's
    ``--profile`` names: ``latte.compiler.machine.host``)."""
    from latte.compiler.machine import host  # noqa: PLC0415

    info = host()
    return (f"{info['cpu']}, {os.cpu_count()} CPUs, {info['vector_bits']}-bit vectors "
            f"({info['llvm_cpu']})")


# glibc returns blocks above 32 MiB to the OS on free, so an eager framework that allocates
# its activations per call page-faults them in again every call (costly in a VM). With
# these settings every worker keeps freed memory, and such a framework runs warm.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def run_worker(script: str, framework: str, threads: int, extra: list[str] | None = None,
               env: dict[str, str] | None = None) -> dict | None:
    """Run ``script --worker framework --threads N`` and parse its JSON line (None: skipped);
    ``env`` adds variables to the worker's environment (which otherwise is ours, so
    ``OPENBLAS_*`` settings carry over)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {}))
    cmd = [sys.executable, script, "--worker", framework, "--threads", str(threads), *(extra or [])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(f"[{framework} x{threads} failed]\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def worker_args(repeat: int = 30) -> argparse.Namespace:
    """Options every benchmark takes; ``--quick`` is a smoke run (3 repetitions, 1 warm-up)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default=None, help="internal: run one measurement")
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a fast smoke run: few repetitions")
    ap.add_argument("--stock-malloc", action="store_true",
                    help="leave glibc malloc as it is (default: workers keep freed memory, "
                         "see KEEP_FREED_MEMORY)")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.warmup = min(args.repeat, 3), 1
    return args


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment a driver adds for its workers (see ``--stock-malloc``)."""
    return {} if args.stock_malloc else KEEP_FREED_MEMORY


def worker_options(args: argparse.Namespace) -> list[str]:
    """The options a driver passes on to its workers."""
    return ["--repeat", str(args.repeat), "--warmup", str(args.warmup)]


def malloc_note(args: argparse.Namespace) -> str:
    """How the workers' malloc ran, for a table's title (see ``--stock-malloc``)."""
    return "stock malloc" if args.stock_malloc else "warm malloc"


def fwd_bwd(net):
    """One forward and backward pass of a latte net, as a function to time."""
    def run():
        net.forward()
        net.backward()
    return run


def sgd_step(net):
    """One SGD training step of a latte net (forward, backward, update with lr 0.01,
    momentum 0.9, weight decay 5e-4), as a function to time."""
    def step():
        net.forward()
        net.backward()
        net.update(0.01, 0.9, 0.0005)
    return step


def torch_sgd_timing(model, x, y, channels_last: bool, warmup: int, repeat: int) -> dict:
    """The median ms of one SGD step of ``model`` in PyTorch eager (cross-entropy loss) on
    the batch ``x``, ``y``, and the note naming the layout; with ``channels_last`` the model
    and the batch are converted to that layout first."""
    import torch  # noqa: PLC0415

    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=0.0005)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {"step": median_ms(step, warmup=warmup, repeat=repeat), "note": torch_note(channels_last)}


def torch_note(channels_last: bool) -> str:
    """The notes column of a PyTorch worker: its version and memory layout."""
    import torch  # noqa: PLC0415

    return f"torch {torch.__version__}, {'channels_last' if channels_last else 'NCHW'}"


def latte_profile(net, fn, warmup: int, repeat: int) -> dict[str, dict[str, float]]:
    """Per ensemble and phase, mean ms per call of ``fn`` on a net built with
    ``profile=True`` (see :class:`latte.runtime.profile.Profile`), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    net.profile.reset()
    for _ in range(repeat):
        fn()
    return net.profile.ms_per_call()


def scaling_table(profiles: dict[int, dict[str, dict[str, float]]],
                  phases: tuple[str, ...] = ("forward", "backward")) -> str:
    """Per ensemble, ms per call at each thread count and the speedup from the fewest to the
    most threads, for each phase (from :func:`latte_profile` results keyed by threads)."""
    counts = sorted(profiles)
    lo, hi = counts[0], counts[-1]
    names = list(profiles[lo])
    header = ["ensemble"]
    for phase in phases:
        header += [f"{phase} ms x{t}" for t in counts] + ([f"{phase} x{lo}/x{hi}"]
                                                          if hi != lo else [])
    rows = []
    totals = {t: {p: 0.0 for p in phases} for t in counts}
    for name in names + ["total"]:
        if name != "total" and not any(profiles[lo][name].get(p) for p in phases):
            continue
        row = [name]
        for phase in phases:
            ms = {}
            for t in counts:
                if name == "total":
                    ms[t] = totals[t][phase]
                else:
                    ms[t] = profiles[t].get(name, {}).get(phase, 0.0)
                    totals[t][phase] += ms[t]
            row += [f"{ms[t]:.3f}" if ms[t] else "-" for t in counts]
            if hi != lo:
                row.append(f"{ms[lo] / ms[hi]:.2f}x" if ms[lo] and ms[hi] else "-")
        rows.append(row)
    return table(rows, header)


def serve_torch_or_latte(args: argparse.Namespace, latte_worker, torch_worker) -> bool:
    """In a worker process, run the framework asked for (``latte``, ``torch`` or ``torch-cl``)
    and emit its result; False in the parent."""
    if not args.worker:
        return False
    threads = args.threads[0]
    if args.worker == "latte":
        emit(latte_worker(threads, args.repeat, args.warmup))
    else:
        emit(torch_worker(threads, args.repeat, args.warmup, args.worker == "torch-cl"))
    return True


def run_frameworks(script: str, args: argparse.Namespace, frameworks) -> dict[int, dict]:
    """Per thread count, each framework's worker result (None where it failed)."""
    return {threads: {fw: run_worker(script, fw, threads, worker_options(args), worker_env(args))
                      for fw in frameworks} for threads in args.threads}


def emit(result: dict) -> None:
    print(json.dumps(result), flush=True)


def openblas_core() -> str:
    from latte.compiler.blas import blas  # noqa: PLC0415

    lib = blas()
    lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
    return lib.scipy_openblas_get_corename().decode()


class OtherLoad:
    """How busy other processes kept the machine while a benchmark ran: CPU time used by all
    processes (``/proc/stat``, Linux) minus our own and our workers'. Thread scaling means
    little when other processes hold the cores."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        ours = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))
        return busy, ours, time.perf_counter()

    def note(self) -> str:
        end = self._sample()
        if self.start is None or end is None:
            return "load of other processes unknown"
        others = max(0.0, (end[0] - self.start[0]) - (end[1] - self.start[1]))
        cores = others / max(end[2] - self.start[2], 1e-9)
        warn = "; timings are noisy, rerun on an idle machine" if cores > 0.1 else ""
        return (f"other processes kept {cores:.2f} of {os.cpu_count()} CPUs busy on average "
                f"during the run{warn}")


def table(rows: list[list[str]], header: list[str]) -> str:
    """A GitHub-markdown table."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(r) for r in rows])
