"""Data-parallel training: 1 process x 2 threads vs ``mpiexec -n 2`` x 1 thread.

    python benchmarks/mpi.py [--repeat 30]

The MLP of ``benchmarks/mlp.py`` (784-1024-1024-10) at a global batch of 128 and the LeNet of
``benchmarks/lenet.py`` at a global batch of 64 (half of each per rank under MPI). Prints
the median SGD step time and throughput, and for MPI how much of the
gradient reduction the overlap hides: 1 - (time blocked in the final Wait per step) /
(time of the same reductions done as blocking Allreduce after backward,
``LATTE_MPI_OVERLAP=0``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    emit,
    malloc_note,
    median_ms,
    run_worker,
    sgd_step,
    table,
    worker_args,
    worker_env,
    worker_options,
)
from lenet import latte_lenet  # noqa: E402
from mlp import SIZES, latte_mlp  # noqa: E402

NETS = {  # name: (global batch, builder(batch per rank, threads))
    f"MLP {'-'.join(map(str, SIZES))}": (128, latte_mlp),
    "LeNet": (64, lambda batch, threads: latte_lenet(threads, batch=batch)),
}


def latte_worker(name: str, threads: int, repeat: int, warmup: int) -> dict:
    from latte.runtime import distributed

    global_batch, build = NETS[name]
    net = build(global_batch // distributed.world_size(), threads)
    ms = median_ms(sgd_step(net), warmup=warmup, repeat=repeat)
    if distributed.comm() is not None:   # every rank's median; report the slowest
        from mpi4py import MPI

        ms = distributed.comm().allreduce(ms, op=MPI.MAX)
    stats = net.comm_stats or {}
    return {"step": ms, "exposed": stats.get("exposed_ms_per_step")}


def _mpi_worker(name: str, overlap: bool, options: list[str], extra_env: dict) -> dict | None:
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1", LATTE_MPI_OVERLAP="1" if overlap else "0",
               LATTE_BENCH_NET=name, **extra_env)
    cmd = [mpiexec, "-n", "2", sys.executable, __file__, "--worker", "latte", "--threads", "1",
           *options]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        print(f"[mpiexec -n 2 failed]\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[0])


def main() -> None:
    args = worker_args()
    if args.worker:
        result = latte_worker(os.environ["LATTE_BENCH_NET"], args.threads[0], args.repeat,
                              args.warmup)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            emit(result)
        return
    for name in NETS:
        os.environ["LATTE_BENCH_NET"] = name
        options, env = worker_options(args), worker_env(args)
        single = run_worker(__file__, "latte", 2, options, env)
        report(name, single, _mpi_worker(name, True, options, env),
               _mpi_worker(name, False, options, env), args.repeat, malloc_note(args))


def report(name: str, single, overlapped, blocking, repeat: int, malloc: str) -> None:
    global_batch = NETS[name][0]
    rows = []
    for config, r in (("1 rank x 2 threads", single), ("2 ranks x 1 thread, overlap", overlapped),
                      ("2 ranks x 1 thread, blocking", blocking)):
        if r is None:
            rows.append([config, "-", "-", "-"])
            continue
        exposed = "" if r["exposed"] is None else f"{r['exposed']:.2f}"
        rows.append([config, f"{r['step']:.2f}", f"{global_batch / r['step'] * 1e3:,.0f}", exposed])
    print(f"{name}, global batch {global_batch}, one SGD step, median of {repeat}, {malloc}")
    print(table(rows, ["configuration", "step ms", "images/s", "reduction wait ms/step"]))
    if overlapped and blocking and blocking["exposed"]:
        hidden = 1 - overlapped["exposed"] / blocking["exposed"]
        print(f"communication hidden by overlap: {hidden:.0%} "
              f"({overlapped['exposed']:.2f} of {blocking['exposed']:.2f} ms/step left exposed)")
    print()


if __name__ == "__main__":
    main()
