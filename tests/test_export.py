"""``latte export``: the C library, run by a C program in a clean environment, against
``net.predict`` of the trained net it was exported from."""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from latte import Net
from latte.cli import main
from latte.compiler import Segment, flat_steps, schedule
from latte.errors import ExportError
from latte.export import export
from latte.lang import NormalizationEnsemble
from latte.stdlib import (
    ConvolutionLayer,
    DropoutLayer,
    FullyConnectedLayer,
    GRULayer,
    LSTMLayer,
    MemoryDataLayer,
    ReLULayer,
)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

# reads n samples from a file, predicts, writes the outputs; "bad" checks argument errors
PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "latte_model.h"

int main(int argc, char **argv)
{
    float one[1];
    if (strcmp(argv[1], "bad") == 0)
        return !(latte_model_predict(one, -1, one) && latte_model_predict(NULL, 1, one)
                 && latte_model_predict(one, 1, NULL) && latte_model_predict(one, 0, one) == 0);
    long n = atol(argv[2]), in = latte_model_input_size(), out = latte_model_output_size();
    float *x = malloc(sizeof(float) * (in * n + 1)), *y = malloc(sizeof(float) * (out * n + 1));
    FILE *f = fopen(argv[1], "rb");
    if (!f || fread(x, sizeof(float), in * n, f) != (size_t)(in * n))
        return 3;
    fclose(f);
    int status = latte_model_predict(x, (int)n, y);
    if (status)
        return 10 + status;
    f = fopen(argv[3], "wb");
    if (!f || fwrite(y, sizeof(float), out * n, f) != (size_t)(out * n))
        return 4;
    return fclose(f) != 0;
}
"""

# a training script as a user writes it; {layers} builds the net between data and loss
SCRIPT = """
import numpy as np
from latte import Net
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import *

rng = np.random.default_rng(0)
X = rng.standard_normal((60, *{shape}), dtype=np.float32)
y = rng.integers(0, 3, 60)
net = Net(8, num_threads={threads}, opt_level={opt_level}, seed=0)
data, label = ArrayDataLayer(net, (X, y), shuffle=True)
{layers}
SoftmaxLossLayer("loss", net, out, label)
AccuracyLayer("accuracy", net, out, label)
solve(SGD(SolverParameters(lr_policy=LRPolicy.Fixed(0.05), mom_policy=MomPolicy.Fixed(0.9),
                           max_epoch=1)), net)
"""

MLP = """
h = ReLULayer("relu1", net, FullyConnectedLayer("ip1", net, data, 32))
out = FullyConnectedLayer("ip2", net, h, 3)
"""

LENET = """
c1 = ConvolutionLayer("conv1", net, data, 6, 3, pad=1)
p1 = MaxPoolingLayer("pool1", net, c1, 2)
c2 = ReLULayer("relu2", net, ConvolutionLayer("conv2", net, p1, 8, 3))
p2 = MaxPoolingLayer("pool2", net, c2, 2)
h = TanhLayer("tanh3", net, FullyConnectedLayer("ip3", net, p2, 24))
out = FullyConnectedLayer("ip4", net, h, 3)
"""

BATCH_NORM = """
c1 = ConvolutionLayer("conv1", net, data, 4, 3, pad=1, bias=False)
b1 = ReLULayer("relu1", net, BatchNormLayer("bn1", net, c1))
h = BatchNormLayer("bn2", net, FullyConnectedLayer("ip2", net, b1, 16))
out = FullyConnectedLayer("ip3", net, DropoutLayer("drop", net, h, 0.3), 3)
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    """The C program's source (compiled against each export's header)."""
    path = tmp_path_factory.mktemp("program") / "main.c"
    path.write_text(PROGRAM)
    return path


def _compile(program: Path, model: Path) -> Path:
    exe = model / "main"
    subprocess.run(["gcc", "-O2", "-I", str(model), str(program), "-L", str(model),
                    "-llatte_model", f"-Wl,-rpath,{model}", "-o", str(exe)], check=True)
    return exe


def _run_clean(exe: Path, *args: str) -> int:
    """Run ``exe`` with an empty environment: no Python, no venv, no LD_LIBRARY_PATH; only
    the OpenBLAS kernels this process chose, if it chose them (``LATTE_TARGET=avx2`` runs
    Haswell's), so that C runs the same code."""
    kernels = [f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']}"
               ] if "OPENBLAS_CORETYPE" in os.environ else []
    return subprocess.run(["env", "-i", *kernels, str(exe), *args], cwd=exe.parent).returncode


def _predict_in_c(program: Path, model: Path, x: np.ndarray, n_out: int) -> np.ndarray:
    exe = _compile(program, model)
    np.ascontiguousarray(x, np.float32).tofile(model / "x.bin")
    assert _run_clean(exe, str(model / "x.bin"), str(len(x)), str(model / "y.bin")) == 0
    return np.fromfile(model / "y.bin", np.float32).reshape(len(x), n_out)


def _trained(tmp_path: Path, layers: str, shape, threads: int, opt_level: int):
    """Run the training script; returns it, its trained net and a snapshot of that net."""
    script = tmp_path / "net.py"
    script.write_text(SCRIPT.format(layers=textwrap.dedent(layers), shape=tuple(shape),
                                    threads=threads, opt_level=opt_level))
    net = runpy.run_path(str(script), run_name="__main__")["net"]
    net.save(tmp_path / "snap.npz")
    return script, net, tmp_path / "snap.npz"


@pytest.mark.parametrize("layers, shape, threads, opt_level", [
    (MLP, (10,), 1, 3),
    (LENET, (1, 12, 12), 1, 3),
    (LENET, (1, 12, 12), 2, 2),
    (BATCH_NORM, (2, 6, 6), 1, 3),
    (BATCH_NORM, (2, 6, 6), 1, 0),
], ids=["mlp", "lenet", "lenet-2-threads", "batch-norm", "batch-norm-opt0"])
def test_exported_library_predicts_as_the_net(tmp_path, program, layers, shape, threads,
                                              opt_level):
    script, net, snapshot = _trained(tmp_path, layers, shape, threads, opt_level)
    if "bn1" in layers:   # the running statistics moved away from (0, 1)
        assert np.abs(net.state["bn1.running_mean"]).max() > 1e-3
    model = tmp_path / "model"
    assert main(["export", str(script), "-o", str(model), "--snapshot", str(snapshot)]) == 0
    x = np.random.default_rng(1).standard_normal((19, *shape)).astype(np.float32)
    expected = net.predict(x)                      # 19 samples: two batches of 8 and 3
    got = _predict_in_c(program, model, x, expected.shape[1])
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * scale)
    if threads == 1:
        np.testing.assert_array_equal(got, expected)   # the same object code, in order


@pytest.mark.parametrize("threads", [1, 2])
def test_recurrent_net_runs_its_time_loop_in_c(tmp_path, program, threads):
    """An LSTM under a GRU, T = 5: the driver steps the loop's views as the runtime does
    (the step before step 0 reads zeros); 7 sequences are a batch of 4 and a padded one."""
    steps = 5
    net = Net(4, time_steps=steps, num_threads=threads, seed=2)
    data = MemoryDataLayer(net, "data", (3,))
    FullyConnectedLayer("out", net, GRULayer("gru", net, LSTMLayer("lstm", net, data, 6), 5), 2)
    model = tmp_path / "model"
    export(net, model)
    x = np.random.default_rng(3).standard_normal((7, steps, 3)).astype(np.float32)
    expected = net.predict(x).reshape(7, -1)
    got = _predict_in_c(program, model, x.reshape(7, -1), steps * 2)
    if threads == 1:
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_segments_cut_into_pieces_run_in_order_in_c(tmp_path, program, monkeypatch):
    """Every kernel a segment of its own (``schedule.PIECE_COST`` at 1): the driver runs
    them in order, in the time loop too, and predicts as the net."""
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path / "cache"))   # code of its own
    monkeypatch.setattr(schedule, "PIECE_COST", 1)
    steps = 3
    net = Net(4, time_steps=steps, num_threads=1, seed=2)
    data = MemoryDataLayer(net, "data", (3,))
    FullyConnectedLayer("out", net, ReLULayer("relu", net, LSTMLayer("lstm", net, data, 6)), 2)
    model = tmp_path / "model"
    export(net, model)
    assert any("__p" in s.name for s in flat_steps(net.program.test) if isinstance(s, Segment))
    x = np.random.default_rng(3).standard_normal((5, steps, 3)).astype(np.float32)
    expected = net.predict(x).reshape(5, -1)
    np.testing.assert_array_equal(_predict_in_c(program, model, x.reshape(5, -1), steps * 2),
                                  expected)


def test_bad_arguments_return_nonzero(tmp_path, program):
    net = _memory_net(2)
    model = tmp_path / "model"
    export(net, model)
    assert _run_clean(_compile(program, model), "bad") == 0


def test_library_needs_no_python(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTE_DOT", "0")   # products along k in BLAS: sgemm
    net = Net(8, num_threads=2)   # sgemm and parallel loops: OpenBLAS and libgomp
    data = MemoryDataLayer(net, "data", (3, 12, 12))
    FullyConnectedLayer("ip", net, ConvolutionLayer("conv", net, data, 8, 3), 10)
    model = tmp_path / "model"
    written = export(net, model)
    assert written == [model / name for name in
                       ("latte_model.h", "liblatte_model.so", "libscipy_openblas.so", "libgomp.so.1")]
    ldd = subprocess.run(["ldd", str(model / "liblatte_model.so")], capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    assert "libpython" not in ldd and "not found" not in ldd
    for lib in written[2:]:   # the copies beside it, found through $ORIGIN
        assert f"{lib.name} => {lib} " in ldd
    resolved = [line.split()[2] for line in ldd.splitlines() if " => " in line]
    assert all(path.startswith((str(model), "/lib", "/usr/lib")) for path in resolved), ldd
    exported = subprocess.run(["nm", "-D", "--defined-only", str(model / "liblatte_model.so")],
                              capture_output=True, text=True, check=True).stdout
    assert sorted(line.split()[-1] for line in exported.splitlines() if " T " in line) == [
        "latte_model_input_size", "latte_model_output_size", "latte_model_predict"]


def test_memory_data_net_without_loss(tmp_path, program):
    """No loss: the output is the last ensemble; dropout is the identity in the library."""
    net = _memory_net(3)
    rng = np.random.default_rng(2)
    for p in net.params:
        p.value[...] = rng.standard_normal(p.value.shape)
    model = tmp_path / "model"
    export(net, model)
    x = rng.standard_normal((7, 5)).astype(np.float32)
    got = _predict_in_c(program, model, x, 4)
    w1, b1, w2, b2 = (p.value.astype(np.float64) for p in net.params)
    reference = np.maximum(x @ w1.T + b1.ravel(), 0) @ w2.T + b2.ravel()
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got, net.predict(x))


class _Doubled(NormalizationEnsemble):
    """Array code that reads its input in the test phase: it cannot leave Python."""

    def forward(self, inputs, value, valid):
        value[...] = 2 * inputs[0]


def test_host_step_on_the_output_path_is_refused(tmp_path):
    net = Net(4, num_threads=1)
    data = MemoryDataLayer(net, "data", (5,))
    doubled = _Doubled(net, "doubled", [FullyConnectedLayer("ip1", net, data, 6)], (6,))
    FullyConnectedLayer("ip2", net, doubled, 2)
    with pytest.raises(ExportError, match="'doubled'"):
        export(net, tmp_path / "model")
    assert not (tmp_path / "model" / "liblatte_model.so").exists()


def test_cli_names_the_refused_ensemble(tmp_path, capsys):
    script = tmp_path / "net.py"
    script.write_text(textwrap.dedent("""
        from latte import Net
        from latte.lang import NormalizationEnsemble
        from latte.stdlib import FullyConnectedLayer, MemoryDataLayer

        class Doubled(NormalizationEnsemble):
            def forward(self, inputs, value, valid):
                value[...] = 2 * inputs[0]

        net = Net(4, num_threads=1)
        data = MemoryDataLayer(net, "data", (5,))
        doubled = Doubled(net, "doubled", [FullyConnectedLayer("ip1", net, data, 6)], (6,))
        FullyConnectedLayer("ip2", net, doubled, 2)
    """))
    assert main(["export", str(script), "-o", str(tmp_path / "model")]) == 1
    assert "'doubled'" in capsys.readouterr().err


def _memory_net(batch: int) -> Net:
    net = Net(batch, num_threads=1)
    data = MemoryDataLayer(net, "data", (5,))
    h = ReLULayer("relu1", net, FullyConnectedLayer("ip1", net, data, 6))
    FullyConnectedLayer("ip2", net, DropoutLayer("drop", net, h, 0.5), 4)
    return net


def test_exports_into_an_existing_folder_again(tmp_path, program):
    """A second export replaces the first one's files (weights changed in between)."""
    net = _memory_net(2)
    model = tmp_path / "model"
    export(net, model)
    net.params[0].value[...] += 0.5
    export(net, model)
    x = np.random.default_rng(3).standard_normal((3, 5)).astype(np.float32)
    np.testing.assert_array_equal(_predict_in_c(program, model, x, 4), net.predict(x))
    assert sorted(os.listdir(model)) == sorted(
        ["latte_model.h", "liblatte_model.so", "main", "x.bin", "y.bin"])


def test_onnx_model_exported_matches_pytorch(tmp_path, program):
    """A model trained elsewhere: a ResNet-style PyTorch model with batch norm, imported from
    ONNX and exported, gives PyTorch's eval outputs from C."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnx")
    from test_onnx import export as to_onnx
    from test_onnx import randomize_bn, resnet

    from latte.onnx import load_onnx

    torch.manual_seed(0)
    model = resnet()
    randomize_bn(model, np.random.default_rng(0))
    to_onnx(model, (3, 16, 16), tmp_path / "model.onnx", dynamic=False, keep_bn=True)
    net, _, _ = load_onnx(tmp_path / "model.onnx", 4, num_threads=1)
    export(net, tmp_path / "lib")
    x = np.random.default_rng(1).standard_normal((6, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        expected = model.double()(torch.from_numpy(x).double()).numpy()
    got = _predict_in_c(program, tmp_path / "lib", x, expected.shape[1])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    np.testing.assert_array_equal(got, net.predict(x))


def test_export_recompiles_an_object_missing_from_the_cache(tmp_path, program):
    """The cache entry of the net's code is gone: the IR is compiled again, to the same code."""
    from latte.compiler import cache

    net = _memory_net(3)
    net.init()
    cache.entry_path(net.program.library.key).unlink()
    export(net, tmp_path / "model")
    x = np.random.default_rng(4).standard_normal((5, 5)).astype(np.float32)
    np.testing.assert_array_equal(_predict_in_c(program, tmp_path / "model", x, 4), net.predict(x))


def test_intermediate_values_and_temporaries_share_the_arena(tmp_path, program):
    """Two ResNet-50 bottlenecks: the image places the test forward's intermediate values
    and the passes' temporaries in one region as the runtime does, so its arena is
    smaller than its buffers together, and it predicts as the net."""
    from latte import stdlib
    from latte.export.image import model_image
    from latte.zoo import nets

    net = Net(2, num_threads=2, seed=0)
    y = MemoryDataLayer(net, "x", (16, 8, 8))
    for i in range(2):
        y = nets.bottleneck(stdlib, f"b{i}", net, y, 8, 1)
    net.init()
    image = model_image(net)
    names = {s.name for s in image.slots}
    assert {b.name for b in net.program.test_values} <= names and "b0_conv1.value" in names
    assert image.arena_bytes < sum(s.nbytes for s in image.slots)
    model = tmp_path / "model"
    export(net, model)
    x = np.random.default_rng(3).standard_normal((5, 16, 8, 8)).astype(np.float32)
    expected = net.predict(x)
    got = _predict_in_c(program, model, x, expected[0].size).reshape(expected.shape)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
