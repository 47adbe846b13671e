"""Data-parallel training over MPI: ``mpiexec -n 2 latte run NET.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import MPIEXEC, latte_run, run_results

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")]

# a tiny MLP (or, with T, an RNN over T steps) trained by solve(); B, OUT, FAIL_AT, SOLVER,
# CLIP and T come from the environment
SCRIPT = textwrap.dedent('''
    import json, os
    import numpy as np
    from latte import Net
    from latte import solvers
    from latte.runtime import distributed
    from latte.solvers import LRPolicy, MomPolicy, SolverParameters, solve
    from latte.solvers.snapshots import newest_snapshot
    from latte.stdlib import (AccuracyLayer, ArrayDataLayer, FullyConnectedLayer, ReLULayer,
                              RNNLayer, SoftmaxLossLayer)

    rng = np.random.default_rng(1)
    T = int(os.environ.get("T", 1))
    seq = (T,) if T > 1 else ()
    X, y = rng.standard_normal((64, *seq, 12)).astype(np.float32), rng.integers(0, 4, (64, *seq))
    Xt, yt = rng.standard_normal((21, *seq, 12)).astype(np.float32), rng.integers(0, 4, (21, *seq))
    net = Net(int(os.environ["B"]), time_steps=T, seed=3)
    data, label = ArrayDataLayer(net, (X, y), test=(Xt, yt))
    if T > 1:
        h = RNNLayer("rnn", net, data, 16)
    else:
        h = ReLULayer("relu1", net, FullyConnectedLayer("ip1", net, data, 16))
    h = FullyConnectedLayer("ip2", net, h, 4)
    SoftmaxLossLayer("loss", net, h, label)
    AccuracyLayer("acc", net, h, label)
    out, fail_at = os.environ["OUT"], int(os.environ.get("FAIL_AT", -1))
    snapshot = newest_snapshot(out)
    if snapshot:                        # resume
        net.load(snapshot)

    class Failing(getattr(solvers, os.environ.get("SOLVER", "SGD"))):
        def step(self, net, iteration):
            if iteration == fail_at and distributed.rank() == 1:
                raise RuntimeError("injected failure")
            super().step(net, iteration)

    params = SolverParameters(LRPolicy.Fixed(0.1), MomPolicy.Fixed(0.9), max_epoch=4,
                              regu_coef=0.001, snapshot_dir=out,
                              clip_gradients=float(os.environ["CLIP"]) if "CLIP" in os.environ
                              else None)
    hist = solve(Failing(params), net)
    if distributed.rank() == 0:
        np.savez(os.path.join(out, "params.npz"), **{p.name: p.value for p in net.params})
        with open(os.path.join(out, "history.json"), "w") as f:
            json.dump({"train": hist.train_loss, "acc": hist.test_accuracy,
                       "test": hist.test_loss, "state": net.solver_state}, f)
''')


def _run(tmp_path, ranks: int, batch: int, name: str, timeout: float = 60, **env):
    script = tmp_path / "net.py"
    script.write_text(SCRIPT)
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    proc = latte_run(script, ranks=ranks, timeout=timeout, LATTE_CACHE_DIR=tmp_path / "cache",
                     B=batch, OUT=out, **env)
    return proc, out


@pytest.mark.parametrize("solver", [{}, {"SOLVER": "Adam", "CLIP": 0.1}, {"T": 5}],
                         ids=["sgd", "adam_clipped", "rnn"])
def test_two_ranks_train_like_one_process_at_twice_the_batch(tmp_path, solver):
    """Gradients are reduced over ranks before the update (and the clipping norm)."""
    one, out1 = _run(tmp_path, 1, 16, "one", **solver)
    assert one.returncode == 0, one.stderr
    two, out2 = _run(tmp_path, 2, 8, "two", **solver)
    assert two.returncode == 0, two.stderr
    p1, h1 = run_results(out1)
    p2, h2 = run_results(out2)
    assert p1.keys() == p2.keys()
    for k in p1:
        np.testing.assert_allclose(p2[k], p1[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # loss and accuracy are reduced over ranks: the histories match
    assert len(h2["train"]) == len(h1["train"]) == 4 * 4
    np.testing.assert_allclose(h2["train"], h1["train"], rtol=1e-5)
    np.testing.assert_allclose(h2["test"], h1["test"], rtol=1e-5)
    assert h2["acc"] == h1["acc"]
    # only rank 0 prints epoch lines and writes the log
    assert two.stderr.count("epoch 4:") == 1
    assert len((out2 / "log.csv").read_text().splitlines()) == 1 + 4


def test_failed_rank_stops_the_job_and_training_resumes_from_the_snapshot(tmp_path):
    # 4 iterations per epoch; rank 1 fails in epoch 3, after the epoch-2 snapshot
    proc, out = _run(tmp_path, 2, 8, "run", timeout=60, FAIL_AT=9)   # a hang fails
    assert proc.returncode != 0
    assert "rank 1 failed" in proc.stderr and "injected failure" in proc.stderr
    snapshot = out / "snapshot_000008.npz"
    with np.load(snapshot) as f:
        assert json.loads(str(f["__state__"])) == {"iteration": 8, "epoch": 2}
    proc, out = _run(tmp_path, 2, 8, "run")
    assert proc.returncode == 0, proc.stderr
    _, hist = run_results(out)
    assert hist["state"] == {"iteration": 16, "epoch": 4}
    assert len(hist["train"]) == 8   # epochs 3 and 4 only


def test_killed_rank_does_not_hang_the_job(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(textwrap.dedent('''
        import os, signal, time
        import numpy as np
        from latte.runtime import distributed
        if distributed.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        distributed.allreduce_sum(np.ones(4))   # rank 0 would wait forever for rank 1
        time.sleep(60)
    '''))
    env = dict(os.environ, LATTE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "latte", "run", str(script)],
                          capture_output=True, text=True, env=env, timeout=60)   # a hang fails
    assert proc.returncode != 0
    # mpiexec names the processes it saw end by PID (the killed one, and at times the rank
    # it then stopped, in either order); latte's first line maps PIDs to ranks
    pids = re.findall(r"PID (\d+)", proc.stdout + proc.stderr)
    assert any(re.search(rf"\b1={pid}@", proc.stderr) for pid in pids), (proc.stdout, proc.stderr)
