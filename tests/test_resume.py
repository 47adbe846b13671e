"""Snapshots and resuming: training resumed from a snapshot is bitwise the training that
never stopped; damaged, foreign or incomplete snapshots are refused whole; a killed
process always leaves a whole newest snapshot; a snapshot folder is never mixed up."""

from __future__ import annotations

import csv
import io
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import textwrap
import time
import zipfile

import numpy as np
import pytest
from helpers import MPIEXEC, latte_run, run_results

from latte.compiler import cache
from latte.errors import DataError, LatteError, TrainingError
from latte.solvers import SGD, Adam, LRPolicy, MomPolicy, SolverParameters, solve
from latte.solvers.snapshots import newest_snapshot, snapshots

# a tiny deterministic MLP with dropout and shuffling, trained by `latte run` (OUT, EVERY
# and SOLVER from the environment) or built by the tests through build()
SCRIPT = textwrap.dedent('''
    import json, os
    import numpy as np
    from latte import Net
    from latte import solvers
    from latte.runtime import distributed
    from latte.solvers import LRPolicy, MomPolicy, SolverParameters, solve
    from latte.stdlib import (ArrayDataLayer, DropoutLayer, FullyConnectedLayer, ReLULayer,
                              SoftmaxLossLayer)

    def build(batch=8):
        rng = np.random.default_rng(0)
        X, y = rng.standard_normal((44, 12)).astype(np.float32), rng.integers(0, 4, 44)
        net = Net(batch, seed=5, deterministic=True, num_threads=1)
        data, label = ArrayDataLayer(net, (X, y), test=(X[:13], y[:13]), shuffle=True)
        h = ReLULayer("relu", net, FullyConnectedLayer("ip1", net, data, 16))
        h = DropoutLayer("drop", net, h, 0.3)
        SoftmaxLossLayer("loss", net, FullyConnectedLayer("ip2", net, h, 4), label)
        return net

    if __name__ == "__main__":
        net = build(int(os.environ.get("B", 8)))
        out = os.environ["OUT"]
        every = int(os.environ["EVERY"]) if "EVERY" in os.environ else None
        params = SolverParameters(LRPolicy.Fixed(0.05), MomPolicy.Fixed(0.9), max_epoch=4,
                                  snapshot_dir=out, snapshot_every=every, keep_snapshots=2)
        history = solve(getattr(solvers, os.environ.get("SOLVER", "SGD"))(params), net)
        if distributed.rank() == 0:
            np.savez(os.path.join(out, "params.npz"), **{p.name: p.value for p in net.params})
            with open(os.path.join(out, "history.json"), "w") as f:
                json.dump({"train": history.train_loss, "state": net.solver_state}, f)
''')


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(SCRIPT)
    return path


def build(script, batch: int = 8):
    return runpy.run_path(str(script), run_name="resume_net")["build"](batch)


def params_of(net) -> dict:
    return {p.name: p.value.copy() for p in net.params}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def sgd(out, epochs: int, **kw) -> SGD:
    return SGD(SolverParameters(LRPolicy.Fixed(0.05), MomPolicy.Fixed(0.9), max_epoch=epochs,
                                snapshot_dir=str(out), **kw))


# ---------------------------------------------------------------- exact resume
@pytest.mark.parametrize("every", [None, 3], ids=["each_epoch", "every_3_iterations"])
def test_four_epochs_equal_two_plus_resume_plus_two(script, tmp_path, every):
    """5 iterations per epoch. With a snapshot every 3 iterations the run goes on to
    iteration 15, and the two newest snapshots are lost (as if it had been killed after
    iteration 9): the resumed run starts inside epoch 2, and drops the log rows past it."""
    straight = build(script)
    h4 = solve(sgd(tmp_path / "a", 4, snapshot_every=every), straight)
    first = build(script)
    solve(sgd(tmp_path / "b", 2 if every is None else 3, snapshot_every=every), first)
    start = 10
    if every:
        assert [p.name for p in snapshots(tmp_path / "b")] == [
            "snapshot_000009.npz", "snapshot_000012.npz", "snapshot_000015.npz"]
        for p in snapshots(tmp_path / "b")[1:]:
            p.unlink()
        start = 9
    resumed = build(script)   # a new net: its own initial weights, from the same seed
    h = solve(sgd(tmp_path / "b", 4, snapshot_every=every, resume=True), resumed)
    assert h.train_loss == h4.train_loss[start:]
    assert_same(params_of(resumed), params_of(straight))
    assert resumed.solver_state == straight.solver_state == {"iteration": 20, "epoch": 4}
    logs = [(tmp_path / out / "log.csv").read_text() for out in "ab"]
    assert logs[0] == logs[1]


def test_adam_moments_and_batch_norm_state_resume(tmp_path):
    from latte import Net
    from latte.stdlib import ArrayDataLayer, BatchNormLayer, FullyConnectedLayer, SoftmaxLossLayer

    def build_bn():
        rng = np.random.default_rng(1)
        net = Net(6, seed=2, deterministic=True, num_threads=1)
        data, label = ArrayDataLayer(net, (rng.standard_normal((30, 5)).astype(np.float32),
                                           rng.integers(0, 3, 30)))
        h = BatchNormLayer("bn", net, FullyConnectedLayer("ip1", net, data, 7))
        SoftmaxLossLayer("loss", net, FullyConnectedLayer("ip2", net, h, 3), label)
        return net

    def adam(out, epochs, **kw):
        return Adam(SolverParameters(LRPolicy.Cosine(0.01, 20), max_epoch=epochs,
                                     snapshot_dir=str(out), **kw))
    straight, first, resumed = build_bn(), build_bn(), build_bn()
    solve(adam(tmp_path / "a", 4), straight)
    solve(adam(tmp_path / "b", 2), first)
    solve(adam(tmp_path / "b", 4, resume=True), resumed)
    assert_same(params_of(resumed), params_of(straight))
    assert_same(resumed.state, straight.state)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=[
    pytest.mark.mpi, pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")])])
def test_latte_run_resume_continues_bitwise(script, tmp_path, ranks):
    """`latte run --max-epoch 2`, then `latte run --resume` in a new process: the log, the
    iterations and the parameters continue as in one run of 4 epochs (under MPI too: each
    rank's dropout stream is its own)."""
    batch = 8 // ranks
    a, b = tmp_path / "a", tmp_path / "b"
    for out, args in ((a, ()), (b, ("--max-epoch", "2")), (b, ("--resume",))):
        proc = latte_run(script, *args, ranks=ranks, OUT=out, B=batch)
        assert proc.returncode == 0, proc.stderr
    (pa, ha), (pb, hb) = run_results(a), run_results(b)
    assert_same(pa, pb)
    assert hb["train"] == ha["train"][10:] and hb["state"] == ha["state"]
    logs = [list(csv.reader(open(out / "log.csv"))) for out in (a, b)]
    assert logs[1] == logs[0] and [r[1] for r in logs[0][1:]] == ["5", "10", "15", "20"]


def test_a_new_run_refuses_another_runs_folder(script, tmp_path):
    out = tmp_path / "run"
    assert latte_run(script, "--max-epoch", "1", OUT=out).returncode == 0
    proc = latte_run(script, "--max-epoch", "1", OUT=out)
    assert proc.returncode == 1
    assert "holds another run's files" in proc.stderr and "--resume" in proc.stderr
    assert [p.name for p in snapshots(out)] == ["snapshot_000005.npz"]   # left alone
    proc = latte_run(script, "--max-epoch", "1", "--overwrite", OUT=out)
    assert proc.returncode == 0, proc.stderr
    assert len(list(csv.reader(open(out / "log.csv")))) == 2   # a new log: header, epoch 1
    with pytest.raises(LatteError, match="holds another run's files"):
        solve(sgd(out, 1), build(script))


# ---------------------------------------------------------------- snapshot files
def test_snapshot_every_and_keep(script, tmp_path):
    net = build(script)
    solve(sgd(tmp_path, 2, snapshot_every=4, keep_snapshots=2), net)
    # iterations 4 and 8 inside epochs, 10 the end of training
    assert [p.name for p in snapshots(tmp_path)] == ["snapshot_000008.npz",
                                                     "snapshot_000010.npz"]
    assert newest_snapshot(tmp_path).name == "snapshot_000010.npz"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_stale_temporaries_are_removed(script, tmp_path, latte_cache_dir):
    out = tmp_path / "run"
    out.mkdir()
    junk = out / ".snapshot_000004.npz.x1y2.tmp"   # a write killed before its rename
    junk.write_bytes(b"partial")
    solve(sgd(out, 1, resume=True), build(script))
    assert not junk.exists()

    old, fresh = (latte_cache_dir / f".{k}.o.abc{k}.tmp" for k in ("0" * 32, "1" * 32))
    for p in (old, fresh):
        p.write_bytes(b"partial")
    os.utime(old, (time.time() - 2 * cache.STALE_SECONDS,) * 2)
    cache._swept.discard((cache.cache_dir(), ".o"))
    cache.store("2" * 32, b"object")
    assert not old.exists() and fresh.exists()   # a young one may be a write in progress
    fresh.unlink()


def test_nothing_non_finite_is_snapshotted(script, tmp_path):
    net = build(script)
    path = tmp_path / "s.npz"
    net.save(path)
    before = path.read_bytes()
    net.params[1].value[0] = np.inf
    with pytest.raises(TrainingError, match=r"'value/ip1.bias' holds a NaN or an infinity"):
        net.save(path)
    assert path.read_bytes() == before   # the last good snapshot stays

    net = build(script)   # diverges at once: stopped before any snapshot of it is written
    solver = SGD(SolverParameters(LRPolicy.Fixed(1e30), max_epoch=2, snapshot_dir=str(tmp_path / "d"),
                                  snapshot_every=1))
    with pytest.raises(TrainingError):
        solve(solver, net)
    for snap in snapshots(tmp_path / "d"):
        build(script).load(snap)   # whatever was written loads: all finite


# ---------------------------------------------------------------- bad files
def _state(net) -> tuple:
    source = net.data_sources()[0]
    return params_of(net), dict(net.solver_state), source.snapshot()[0], \
        net.rng.bit_generator.state


def _rewrite(src, dst, drop=(), change=None) -> None:
    """Copy the npz ``src`` to ``dst`` without the keys ``drop``, ``change`` applied."""
    with np.load(src) as f:
        arrays = {k: f[k] for k in f.files if k not in drop}
    if change:
        change(arrays)
    np.savez(dst, **arrays)


def test_bad_snapshots_are_refused_whole(script, tmp_path):
    net = build(script)
    solve(sgd(tmp_path / "run", 1), net)
    good = newest_snapshot(tmp_path / "run")
    other = build(script)
    other.forward()   # a batch read ahead, a position of its own
    before = _state(other)
    size = good.stat().st_size
    cases = {
        "truncated": (lambda p: p.write_bytes(good.read_bytes()[:size // 2]), "cannot be read"),
        "empty": (lambda p: p.write_bytes(b""), "cannot be read"),
        "text": (lambda p: p.write_text("epoch,iteration\n"), "cannot be read"),
        "flipped": (lambda p: p.write_bytes(_flip(good.read_bytes())), "cannot be read"),
        "foreign": (lambda p: np.savez(p, weights=np.ones(3)), "not a latte snapshot"),
        "last key missing": (lambda p: _rewrite(good, p, drop=["state/ip2.bias", "value/ip2.bias"]),
                             "has no 'value/ip2.bias'"),
        "generator missing": (lambda p: _rewrite(good, p, change=_drop_generator),
                              "random generator 'ensemble:drop'"),
        "order damaged": (lambda p: _rewrite(good, p, change=_damage_order),
                          "data source 0: the train batch order"),
        "nan": (lambda p: _rewrite(good, p, change=_nan), "'value/ip2.weights' holds a NaN"),
        "float64": (lambda p: _rewrite(good, p, change=_float64), "dtype float64"),
        "foreign header": (lambda p: _rewrite(good, p, change=_foreign_header),
                           "header is foreign"),
    }
    for name, (make, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.npz"
        make(path)
        with pytest.raises(DataError, match=message) as err:
            other.load(path)
        assert str(path) in str(err.value), name
        after = _state(other)
        assert_same(after[0], before[0])
        assert after[1:] == before[1:], name
    other.load(good)   # and a good one loads
    assert_same(params_of(other), params_of(net))
    with pytest.raises(DataError, match="does not exist"):
        other.load(tmp_path / "missing.npz")


def _flip(data: bytes) -> bytes:
    """``data`` with bytes in the middle of the first array's payload changed."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = z.infolist()[-1]
    at = info.header_offset + 30 + len(info.filename) + 100
    return data[:at] + bytes(b ^ 0xFF for b in data[at:at + 8]) + data[at + 8:]


def _drop_generator(arrays):
    header = json.loads(str(arrays["__latte__"]))
    del header["ranks"][0]["ensemble:drop"]
    arrays["__latte__"] = np.array(json.dumps(header))


def _damage_order(arrays):
    arrays["source/0/order/train"] = np.zeros_like(arrays["source/0/order/train"])


def _nan(arrays):
    arrays["value/ip2.weights"] = arrays["value/ip2.weights"].copy()
    arrays["value/ip2.weights"][0, 0] = np.nan


def _float64(arrays):
    arrays["value/ip1.weights"] = arrays["value/ip1.weights"].astype(np.float64)


def _foreign_header(arrays):
    arrays["__latte__"] = np.array(json.dumps({"format": "something else"}))


# ---------------------------------------------------------------- killed processes
def test_sigkill_at_random_moments_leaves_a_whole_newest_snapshot(script, tmp_path):
    """20 runs of `latte run --resume` in one folder (a snapshot every iteration, two
    kept), each killed at a random moment after it has written its first snapshot (so that
    a slow start on a busy machine cannot leave every run without one): the newest snapshot
    always loads, and each run resumes from where the last one was killed."""
    out = tmp_path / "run"
    rng = random.Random(7)
    environ = dict(os.environ, OUT=str(out), EVERY="1")
    net = build(script)
    progress = []
    for _ in range(20):
        proc = subprocess.Popen([sys.executable, "-m", "latte", "run", str(script), "--resume",
                                 "--max-epoch", "1000"], env=environ,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        before, deadline = newest_snapshot(out), time.monotonic() + 120
        while newest_snapshot(out) == before and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))   # between (or during) the following writes
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, err.decode()
        newest = newest_snapshot(out)
        if newest is not None:
            net.load(newest)   # checks the whole file
            progress.append(net.solver_state["iteration"])
    assert progress and progress == sorted(progress) and progress[-1] > progress[0]
    # two kept; a kill after a new snapshot is whole but before the oldest goes leaves a
    # third, which the next write removes
    assert len(snapshots(out)) <= 3
    solve(sgd(out, 0, resume=True), build(script))   # a start removes killed writes' files
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_hdf5_data_resumes_exactly(tmp_path):
    h5py = pytest.importorskip("h5py")
    from latte import Net
    from latte.stdlib import FullyConnectedLayer, HDF5DataLayer, SoftmaxLossLayer

    rng = np.random.default_rng(3)
    for name, n in (("a.h5", 17), ("b.h5", 14)):   # a set of two files
        with h5py.File(tmp_path / name, "w") as f:
            f["data"] = rng.standard_normal((n, 6)).astype(np.float32)
            f["label"] = rng.integers(0, 3, (n, 1))

    def build_h5():
        net = Net(4, seed=9, deterministic=True, num_threads=1)
        data, label = HDF5DataLayer(net, [tmp_path / "a.h5", tmp_path / "b.h5"])
        SoftmaxLossLayer("loss", net, FullyConnectedLayer("ip", net, data, 3), label)
        return net
    straight, first, resumed = build_h5(), build_h5(), build_h5()
    h4 = solve(sgd(tmp_path / "a", 4), straight)
    solve(sgd(tmp_path / "b", 2), first)
    h = solve(sgd(tmp_path / "b", 4, resume=True), resumed)
    assert h.train_loss == h4.train_loss[len(h4.train_loss) // 2:]
    assert_same(params_of(resumed), params_of(straight))
