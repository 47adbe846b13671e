"""Failures that hang nothing and lose nothing: MPI ranks that disagree or leave early stop
the job with a message naming them; ``latte run NET.py | head`` trains to the end."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import MPIEXEC, latte_run

# a tiny MLP; WHAT makes rank 1 differ: its batch size, data set size, epochs, net, or it
# returns (exit status 0) before training
SCRIPT = textwrap.dedent('''
    import os, sys
    import numpy as np
    from latte import Net
    from latte.runtime import distributed
    from latte.solvers import SGD, LRPolicy, SolverParameters, solve
    from latte.stdlib import ArrayDataLayer, FullyConnectedLayer, SoftmaxLossLayer

    odd = distributed.rank() == 1 and os.environ.get("WHAT", "")
    if odd == "early":
        sys.exit(0)
    n = 80 if odd == "data" else 64
    rng = np.random.default_rng(1)
    X, y = rng.standard_normal((n, 12)).astype(np.float32), rng.integers(0, 4, n)
    net = Net(16 if odd == "batch" else 8, seed=3)
    data, label = ArrayDataLayer(net, (X, y))
    h = FullyConnectedLayer("ip", net, data, 5 if odd == "net" else 4)
    SoftmaxLossLayer("loss", net, h, label)
    solve(SGD(SolverParameters(LRPolicy.Fixed(0.1), max_epoch=3 if odd == "epochs" else 2,
                               snapshot_dir=os.environ.get("OUT"))), net)
    for i in range(int(os.environ.get("PRINTS", 0))):   # one write a line: two ranks'
        sys.stdout.write(f"line {i}\\n")                # lines may interleave, not split
        sys.stdout.flush()
''')

needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")


def _run(tmp_path, *, ranks: int = 2, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "net.py"
    script.write_text(SCRIPT)
    return latte_run(script, ranks=ranks, timeout=60, LATTE_CACHE_DIR=tmp_path / "cache",
                     **env)   # a hang fails


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("what, difference", [
    ("batch", "batch size: rank 0 has 8, rank 1 has 16"),
    ("data", "data source 0's train samples: rank 0 has 64, rank 1 has 80"),
    ("epochs", "epochs: rank 0 has 2, rank 1 has 3"),
    ("net", "ensemble 2: rank 0 has ip of shape (4,), rank 1 has ip of shape (5,)"),
])
def test_ranks_that_disagree_stop_with_one_error(tmp_path, what, difference):
    proc = _run(tmp_path, WHAT=what)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("latte: error:")]
    assert len(errors) == 1, proc.stderr   # said once, by rank 0
    assert errors[0].startswith(f"latte: error: ranks disagree on {difference}; "), errors[0]
    assert "(from net.py, line 19)" in errors[0]   # the solve() call


@pytest.mark.mpi
@needs_mpi
def test_a_rank_that_finishes_early_stops_the_job(tmp_path):
    proc = _run(tmp_path, WHAT="early", LATTE_MPI_EXIT_GRACE=1)
    assert proc.returncode != 0
    assert ("rank 0 failed: rank 1 finished the script (exit status 0) while rank 0 waits for "
            "it in ") in proc.stderr, proc.stderr


@pytest.mark.mpi
@needs_mpi
def test_ranks_that_agree_finish_normally(tmp_path):
    proc = _run(tmp_path, PRINTS=1)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("line 0") == 2 and "error" not in proc.stderr


def test_output_closed_by_its_reader_does_not_stop_training(tmp_path):
    """``latte run net.py | head -1``: the script prints a line per iteration after head
    has gone; training ends normally, the log has every epoch, stderr says why it went
    quiet."""
    script = tmp_path / "net.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    # 20,000 lines (~190 KB) outgrow a pipe's buffer (64 KiB), so the script writes after
    # head has gone whatever the timing (2,000 lines fit in it: no write failed, seen once)
    env = {"LATTE_CACHE_DIR": str(tmp_path / "cache"), "OUT": str(out), "PRINTS": "20000"}
    run = subprocess.Popen([sys.executable, "-m", "latte", "run", str(script)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **env})
    head = subprocess.run(["head", "-1"], stdin=run.stdout, capture_output=True, text=True,
                          timeout=60)
    run.stdout.close()
    err = run.stderr.read()
    assert run.wait(timeout=60) == 0, err
    assert head.stdout == "line 0\n"
    assert err.count("latte: standard output was closed by its reader; training continues") == 1
    assert "Error" not in err and "Exception" not in err, err
    with open(out / "log.csv") as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["0", "1"]
