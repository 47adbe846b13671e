"""Training curves: ``log.csv`` and ``iterations.csv`` as ``solve`` writes them (exact on
resume), ``latte plot LOG.csv -o PNG``, and ``latte run`` drawing ``curves.png``."""

from __future__ import annotations

import csv
import struct
import sys
import textwrap

import numpy as np
import pytest
from helpers import latte_run

from latte.cli import main
from latte.plot import draw_beside
from latte.solvers import log as logs

matplotlib = pytest.importorskip("matplotlib")

# 3 epochs of 8 iterations; a snapshot every 5 iterations (inside epochs too)
SCRIPT = textwrap.dedent('''
    import os
    import numpy as np
    from latte import Net
    from latte.solvers import SGD, LRPolicy, SolverParameters, solve
    from latte.stdlib import AccuracyLayer, ArrayDataLayer, FullyConnectedLayer, SoftmaxLossLayer

    rng = np.random.default_rng(1)
    X, y = rng.standard_normal((64, 12)).astype(np.float32), rng.integers(0, 4, 64)
    net = Net(8, seed=3, deterministic=True)
    data, label = ArrayDataLayer(net, (X, y), test=(X[:20], y[:20]), shuffle=True)
    h = FullyConnectedLayer("ip", net, data, 4)
    SoftmaxLossLayer("loss", net, h, label)
    AccuracyLayer("acc", net, h, label)
    history = solve(SGD(SolverParameters(LRPolicy.Fixed(0.1), max_epoch=3, snapshot_every=5,
                                         snapshot_dir=os.environ["OUT"])), net)
    print("losses", *history.train_loss, flush=True)
''')


def _rows(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is no PNG"
    return struct.unpack(">II", data[16:24])


def _write_log(folder, epochs: int = 4, per_epoch: int = 10, iterations: bool = True):
    log = logs.Log(str(folder))
    rng = np.random.default_rng(0)
    it = 0
    for epoch in range(epochs):
        for _ in range(per_epoch):
            it += 1
            log.iteration(it, epoch, 2.0 / it + 0.1 * rng.random())
        log.epoch(epoch, it, 2.0 / it, 1.5 / (epoch + 1), 0.5 + 0.1 * epoch)
    if not iterations:
        (folder / logs.ITERATIONS).unlink()
    return folder / "log.csv"


@pytest.mark.parametrize("iterations", [True, False], ids=["with_iterations", "old_log"])
def test_plot_draws_a_png(tmp_path, capsys, iterations):
    log = _write_log(tmp_path, iterations=iterations)
    out = tmp_path / "figs" / "c.png"
    assert main(["plot", str(log), "-o", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    width, height = _png_size(out)
    assert width > 300 and height > 200
    pixels = matplotlib.image.imread(out)
    assert pixels.shape[:2] == (height, width)
    assert (pixels[..., :3] < 0.5).any()   # something is drawn on the white page


def test_plot_defaults_to_curves_png_beside_the_log(tmp_path):
    log = _write_log(tmp_path)
    assert main(["plot", str(log)]) == 0
    assert _png_size(tmp_path / "curves.png")[0] > 0


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read log"),
    ("a,b\n1,2\n", "is not a latte log"),
    ("epoch,iteration,train_loss,test_loss,test_accuracy\n", "holds no epochs"),
    ("epoch,iteration,train_loss,test_loss,test_accuracy\n0,8,1.5,x,0.2\n", "line 2"),
    ("epoch,iteration,train_loss,test_loss,test_accuracy\n0,8,1.5\n", "line 2: 3 fields"),
], ids=["missing", "foreign", "empty", "not_a_number", "short_row"])
def test_bad_logs_are_errors_naming_the_file(tmp_path, capsys, content, expected):
    log = tmp_path / "log.csv"
    if content is not None:
        log.write_text(content)
    assert main(["plot", str(log), "-o", str(tmp_path / "c.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("latte: error:") and str(log) in err and expected in err, err
    assert not (tmp_path / "c.png").exists()


def test_bad_iterations_csv_names_it(tmp_path, capsys):
    log = _write_log(tmp_path)
    (tmp_path / "iterations.csv").write_text("iteration,epoch,train_loss\n1,0,nan?\n")
    assert main(["plot", str(log)]) == 1
    assert "iterations.csv" in capsys.readouterr().err


def test_without_matplotlib(tmp_path, capsys, monkeypatch):
    log = _write_log(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert draw_beside(log) is None                        # latte run: silently no curves
    assert main(["plot", str(log)]) == 1
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "curves.png").exists()


def test_log_keeps_the_rows_up_to_the_resumed_iteration(tmp_path):
    _write_log(tmp_path, epochs=3, per_epoch=4)
    logs.Log(str(tmp_path), start=6)
    assert [r[1] for r in _rows(tmp_path / "log.csv")] == ["iteration", "4"]
    assert [r[0] for r in _rows(tmp_path / "iterations.csv")] == ["iteration", *"123456"]


def test_latte_run_writes_every_iteration_and_curves_and_resumes_exactly(tmp_path):
    script = tmp_path / "net.py"
    script.write_text(SCRIPT)
    cache = tmp_path / "cache"
    straight = latte_run(script, LATTE_CACHE_DIR=cache, OUT=tmp_path / "a")
    assert straight.returncode == 0, straight.stderr
    a = tmp_path / "a"
    losses = [float(v) for v in straight.stdout.split()[1:]]
    rows = _rows(a / "iterations.csv")
    assert rows[0] == logs.ITERATION_COLUMNS and len(rows) == 1 + 24
    assert [int(r[0]) for r in rows[1:]] == list(range(1, 25))
    assert [int(r[1]) for r in rows[1:]] == [i // 8 for i in range(24)]
    np.testing.assert_array_equal([float(r[2]) for r in rows[1:]], losses)
    assert _png_size(a / "curves.png")[0] > 0
    # 1 epoch (snapshots at iterations 5 and 8), then resume mid-epoch from iteration 5
    b = tmp_path / "b"
    first = latte_run(script, "--max-epoch", "1", LATTE_CACHE_DIR=cache, OUT=b)
    assert first.returncode == 0, first.stderr
    (b / "snapshot_000008.npz").unlink()
    with open(b / "iterations.csv", "a") as f:   # rows written past that snapshot are dropped
        f.write("6,0,9.0\n")
    rest = latte_run(script, "--resume", LATTE_CACHE_DIR=cache, OUT=b)
    assert rest.returncode == 0, rest.stderr
    for name in ("log.csv", "iterations.csv"):
        assert (b / name).read_text() == (a / name).read_text(), name
