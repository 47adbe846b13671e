"""Data-parallel MLP training: 1 process x 2 threads vs ``mpiexec -n 2`` x 1 thread.

    python benchmarks/mpi.py [--repeat 30]

The MLP of ``benchmarks/mlp.py`` (784-1024-1024-10) at a global batch of 128 (64 per rank
under MPI). Prints the median SGD step time and throughput, and for MPI how much of the
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
from harness import emit, median_ms, run_worker, table, worker_args  # noqa: E402
from mlp import SIZES, latte_mlp  # noqa: E402

GLOBAL_BATCH = 128


def latte_worker(threads: int, repeat: int) -> dict:
    from latte.runtime import distributed

    net = latte_mlp(GLOBAL_BATCH // distributed.world_size(), threads)

    def step():
        net.forward()
        net.backward()
        net.update(0.01, 0.9, 0.0005)

    ms = median_ms(step, repeat=repeat)
    if distributed.comm() is not None:   # every rank's median; report the slowest
        from mpi4py import MPI

        ms = distributed.comm().allreduce(ms, op=MPI.MAX)
    stats = net.comm_stats or {}
    return {"step": ms, "exposed": stats.get("exposed_ms_per_step")}


def _mpi_worker(overlap: bool, repeat: int) -> dict | None:
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1", LATTE_MPI_OVERLAP="1" if overlap else "0")
    cmd = [mpiexec, "-n", "2", sys.executable, __file__, "--worker", "latte", "--threads", "1",
           "--repeat", str(repeat)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        print(f"[mpiexec -n 2 failed]\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[0])


def main() -> None:
    args = worker_args()
    if args.worker:
        result = latte_worker(args.threads[0], args.repeat)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            emit(result)
        return
    single = run_worker(__file__, "latte", 2, ["--repeat", str(args.repeat)])
    overlapped = _mpi_worker(True, args.repeat)
    blocking = _mpi_worker(False, args.repeat)
    rows = []
    for name, r in (("1 rank x 2 threads", single), ("2 ranks x 1 thread, overlap", overlapped),
                    ("2 ranks x 1 thread, blocking", blocking)):
        if r is None:
            rows.append([name, "-", "-", "-"])
            continue
        exposed = "" if r["exposed"] is None else f"{r['exposed']:.2f}"
        rows.append([name, f"{r['step']:.2f}", f"{GLOBAL_BATCH / r['step'] * 1e3:,.0f}", exposed])
    print(f"MLP {'-'.join(map(str, SIZES))}, global batch {GLOBAL_BATCH}, one SGD step, "
          f"median of {args.repeat}")
    print(table(rows, ["configuration", "step ms", "images/s", "reduction wait ms/step"]))
    if overlapped and blocking and blocking["exposed"]:
        hidden = 1 - overlapped["exposed"] / blocking["exposed"]
        print(f"communication hidden by overlap: {hidden:.0%} "
              f"({overlapped['exposed']:.2f} of {blocking['exposed']:.2f} ms/step left exposed)")


if __name__ == "__main__":
    main()
