"""The ``latte`` command, run as ``python -m latte`` in a subprocess on small scripts."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from latte.progress import Progress

MLP = """
import numpy as np
from latte import Net
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import (AccuracyLayer, ArrayDataLayer, FullyConnectedLayer, ReLULayer,
                          SoftmaxLossLayer)

rng = np.random.default_rng(0)
X = rng.random((128, 1, 4, 4), dtype=np.float32)
y = (X.reshape(128, -1).sum(1) > 8).astype(np.int64)
net = Net(16, num_threads=1{net_args})
data, label = ArrayDataLayer(net, (X[:96], y[:96]), test=(X[96:], y[96:]))
ip1 = FullyConnectedLayer("ip1", net, data, 8)
r1 = ReLULayer("relu1", net, ip1)
ip2 = FullyConnectedLayer("ip2", net, r1, 2)
SoftmaxLossLayer("loss", net, ip2, label)
AccuracyLayer("accuracy", net, ip2, label)
params = SolverParameters(lr_policy=LRPolicy.Fixed(0.1), mom_policy=MomPolicy.Fixed(0.9),
                          max_epoch=2, snapshot_dir={snapshot_dir!r})
history = solve(SGD(params), net)
print("epochs", len(history.test_accuracy))
print("final_loss", repr(history.train_loss[-1]))
"""


def _script(tmp_path: Path, body: str, name: str = "net.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _mlp(tmp_path: Path, snapshot_dir: Path | None = None, net_args: str = ", seed=1") -> Path:
    return _script(tmp_path, MLP.format(snapshot_dir=snapshot_dir and str(snapshot_dir),
                                        net_args=net_args))


def _latte(tmp_path: Path, *args: object, traceback: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.setdefault("LATTE_CACHE_DIR", str(tmp_path / "cache"))   # conftest sets a session one
    env.pop("LATTE_TRACEBACK", None)
    if traceback:
        env["LATTE_TRACEBACK"] = "1"
    return subprocess.run([sys.executable, "-m", "latte", *map(str, args)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


def _printed(out: str, key: str) -> str:
    return next(line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(key + " "))


def test_run_trains_and_writes_log(tmp_path):
    snap = tmp_path / "snap"
    result = _latte(tmp_path, "run", _mlp(tmp_path, snap))
    assert result.returncode == 0, result.stderr
    assert _printed(result.stdout, "epochs") == "2"
    with open(snap / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert (snap / "snapshot_000012.npz").exists()
    # one summary line per epoch on stderr
    assert result.stderr.count("epoch 1: train loss") == 1
    assert "epoch 2: train loss" in result.stderr and "test accuracy" in result.stderr


def test_max_epoch_overrides_the_script(tmp_path):
    snap = tmp_path / "snap"
    result = _latte(tmp_path, "run", _mlp(tmp_path, snap), "--max-epoch", 1)
    assert result.returncode == 0, result.stderr
    assert _printed(result.stdout, "epochs") == "1"
    with open(snap / "log.csv") as f:
        assert len(list(csv.DictReader(f))) == 1


def test_seed_makes_runs_repeatable(tmp_path):
    script = _mlp(tmp_path, net_args="")
    losses = []
    for _ in range(2):
        result = _latte(tmp_path, "run", script, "--seed", 123, "--threads", 1, "--max-epoch", 1)
        assert result.returncode == 0, result.stderr
        losses.append(_printed(result.stdout, "final_loss"))
    assert losses[0] == losses[1]
    other = _latte(tmp_path, "run", script, "--seed", 124, "--threads", 1, "--max-epoch", 1)
    assert _printed(other.stdout, "final_loss") != losses[0]


def test_profile_prints_a_table(tmp_path):
    result = _latte(tmp_path, "run", _mlp(tmp_path), "--profile", "--opt-level", 1)
    assert result.returncode == 0, result.stderr
    for phase in ("compile", "forward (train", "backward", "update", "forward (test"):
        assert f"  {phase}" in result.stderr


def _table(stderr: str, first: str, stop: str) -> dict[str, list[str]]:
    """The rows of a ``--profile`` table (name -> the other columns), from the line after
    the one starting with ``first`` to the one whose name is ``stop``."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    rows = {}
    for line in lines[start + 2:]:
        name, *cols = re.split(r"\s{2,}|\s(?=[-\d])", line.strip())
        rows[name] = cols
        if name == stop:
            return rows
    raise AssertionError(f"no {stop!r} row in:\n{stderr}")


def test_profile_prints_time_per_ensemble(tmp_path):
    result = _latte(tmp_path, "run", _mlp(tmp_path), "--profile")   # opt level 3
    assert result.returncode == 0, result.stderr
    phases = _table(result.stderr, "profile:", "rest of the script")
    ensembles = _table(result.stderr, "per ensemble", "total")
    # every non-data ensemble, data loading, zeroing the gradients, the update and the
    # parameters' finite check
    assert set(ensembles) == {"(data)", "ip1", "relu1", "ip2", "loss", "accuracy",
                              "(zero_grads)", "(sgd_update)", "(finite_check)", "total"}
    ms = {name: [float(c) if c != "-" else 0.0 for c in cols[:3]]
          for name, cols in ensembles.items()}
    *rows, total = ms.values()
    for col in range(3):   # forward, backward, total: the rows add up to the total row
        assert sum(r[col] for r in rows) == pytest.approx(total[col], abs=0.002 * len(rows))
    assert total[0] + total[1] <= total[2] + 0.01      # the update is in neither column
    shares = [float(cols[3].rstrip("%")) for name, cols in ensembles.items() if name != "total"]
    assert sum(shares) == pytest.approx(100, abs=0.1 * len(shares))
    # and to (roughly) the time the phases took: the rest is Python around the steps
    per_call = sum(float(phases[p][2]) for p in ("forward (train, incl. data)", "backward",
                                                  "update"))
    assert 0.5 * per_call <= total[2] <= per_call * 1.05 + 0.01
    assert ms["ip1"][0] > 0 and ms["ip1"][1] > 0


def _bad_mapping_script(tmp_path: Path) -> Path:
    body = """
    import numpy as np
    from latte import Ensemble, Net, add_connections
    from latte.solvers import SGD, SolverParameters, solve
    from latte.stdlib import ArrayDataLayer, SoftmaxLossLayer, WeightedNeuron

    net = Net(4)
    data, label = ArrayDataLayer(net, (np.zeros((8, 3), np.float32), np.zeros(8, np.int64)))
    W, b = np.zeros((2, 5), np.float32), np.zeros((2, 1), np.float32)
    fc = Ensemble(net, "fc", WeightedNeuron, (2,), weights=(W, lambda o: o), bias=(b, lambda o: o))
    add_connections(net, data, fc, lambda o: (range(0, 5),))   # reads past the 3 inputs
    SoftmaxLossLayer("loss", net, fc, label)
    solve(SGD(SolverParameters()), net)
    """
    return _script(tmp_path, body)


def test_latte_error_is_one_paragraph_without_traceback(tmp_path):
    result = _latte(tmp_path, "run", _bad_mapping_script(tmp_path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("latte: error: ")
    assert "'fc'" in lines[0] and "net.py, line" in lines[0]
    assert "Traceback" not in result.stderr


def test_traceback_on_request(tmp_path):
    result = _latte(tmp_path, "run", _bad_mapping_script(tmp_path), traceback=True)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "latte: error: " in result.stderr


def test_other_exception_names_its_type(tmp_path):
    result = _latte(tmp_path, "run", _script(tmp_path, "x = 1\nraise ValueError('boom')\n"))
    assert result.returncode == 1
    assert result.stderr.strip() == ("latte: error: ValueError: boom (from net.py, line 2); "
                                     "set LATTE_TRACEBACK=1 to see the traceback")


def test_script_sees_argv_main_and_its_folder(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    body = """
    import sys
    from helper import VALUE
    if __name__ == "__main__":
        print(VALUE, sys.argv)
        sys.exit(3)
    """
    result = _latte(tmp_path, "run", _script(tmp_path, body, "sub.py"))
    assert result.returncode == 3
    assert result.stdout.strip() == f"42 {[str(tmp_path / 'sub.py')]}"


@pytest.mark.parametrize("args, status", [(["run", "missing.py"], 1), (["explain", "missing.py"], 1),
                                          ([], 2), (["run"], 2), (["run", "x.py", "--opt-level", "7"], 2),
                                          (["run", "x.py", "--threads", "0"], 2)])
def test_bad_invocations(tmp_path, args, status):
    result = _latte(tmp_path, *args)
    assert result.returncode == status
    assert "error:" in result.stderr and "Traceback" not in result.stderr


def test_explain_prints_the_plan_without_training(tmp_path):
    snap = tmp_path / "snap"
    result = _latte(tmp_path, "explain", _mlp(tmp_path, snap))
    assert result.returncode == 0, result.stderr
    assert "GEMM match" in result.stdout and "sgemm(" in result.stdout
    assert "shared along" in result.stdout
    assert "== ensemble 'ip1'" in result.stdout and "== ensemble 'ip2'" in result.stdout
    assert "epochs" not in result.stdout           # stopped at solve()
    assert not (snap / "log.csv").exists()


def test_explain_opt_level_0_has_no_gemm(tmp_path):
    result = _latte(tmp_path, "explain", _mlp(tmp_path), "--opt-level", 0)
    assert result.returncode == 0, result.stderr
    assert "opt_level 0" in result.stdout and "sgemm(" not in result.stdout


def test_explain_nets_of_a_script_that_never_solves(tmp_path):
    body = MLP.format(snapshot_dir=None, net_args="").split("params =")[0]
    body += "net2 = Net(8)\nArrayDataLayer(net2, (X, y))\n"
    result = _latte(tmp_path, "explain", _script(tmp_path, body))
    assert result.returncode == 0, result.stderr
    assert "#### net 1 of 2 (batch size 16)" in result.stdout
    assert "#### net 2 of 2 (batch size 8)" in result.stdout


def test_explain_a_script_without_nets(tmp_path):
    result = _latte(tmp_path, "explain", _script(tmp_path, "print('hi')\n"))
    assert result.returncode == 1
    assert "creates no latte.Net" in result.stderr


def test_progress_bar_and_epoch_line():
    class Terminal:
        def __init__(self):
            self.text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return True

    term = Terminal()
    progress = Progress(term)
    for epoch in range(2):
        for it in range(3):
            progress("iteration", epoch=epoch, iteration=it, loss=0.5, images=16)
        progress("epoch", epoch=epoch, accuracy=0.75, test_loss=0.25, train_loss=0.5)
    assert "epoch 2:   0%" in term.text and "/3 " in term.text   # total learned from epoch 1
    assert "epoch 2: train loss 0.5000, test loss 0.2500, test accuracy 75.00%" in term.text
