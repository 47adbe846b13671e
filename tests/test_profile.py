"""``Net(profile=True)``: per-ensemble time, without changing what the net computes; the
operations the compiler counts per ensemble (exact for FC and convolution layers and a time
loop) and the machine's peak, measured once per machine and cached."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import vector_registers
from test_recurrence import N_IN, N, elman

from latte import Net, Phase
from latte.compiler import machine
from latte.compiler.machine import Peak
from latte.runtime.profile import Profile
from latte.stdlib import (
    ArrayDataLayer,
    ConvolutionLayer,
    FullyConnectedLayer,
    MemoryDataLayer,
    ReLULayer,
    SoftmaxLossLayer,
)

FAKE = Peak(cpu="Test CPU 9000", llvm_cpu="testcpu", vector_bits=256, blas="OpenBLAS test",
            gflops=50.0)


def _mlp(profile: bool, opt_level: int = 3) -> Net:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 12)).astype(np.float32)
    y = rng.integers(0, 3, 64)
    net = Net(16, num_threads=1, seed=0, opt_level=opt_level, profile=profile)
    data, label = ArrayDataLayer(net, (X, y), test=(X[:16], y[:16]), shuffle=False)
    h = ReLULayer("relu", net, FullyConnectedLayer("ip1", net, data, 10))
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("ip2", net, h, 3), label)
    net.init()
    return net


def _train(net: Net, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        net.forward()
        net.backward()
        net.update(0.1, 0.9, 0.001)
        losses.append(net.loss)
    return losses


@pytest.mark.parametrize("opt_level", [0, 3])
def test_profiling_changes_no_result(opt_level):
    plain, profiled = _mlp(False, opt_level), _mlp(True, opt_level)
    assert plain.profile is None and isinstance(profiled.profile, Profile)
    np.testing.assert_allclose(_train(profiled, 4), _train(plain, 4), rtol=1e-5)
    for a, b in zip(plain.params, profiled.params):
        np.testing.assert_allclose(a.value, b.value, rtol=1e-5, atol=1e-6)


def test_profile_times_each_ensemble_per_phase():
    net = _mlp(True)
    _train(net, 2)
    net.profile.reset()
    _train(net, 3)
    net.forward(Phase.TEST)
    prof = net.profile
    assert prof.calls == {"forward": 3, "backward": 3, "update": 3, "test": 1}
    ms = prof.ms_per_call()
    assert list(ms) == ["(data)", "ip1", "relu", "ip2", "loss", "(zero_grads)", "(sgd_update)"]
    for name in ("ip1", "relu", "ip2", "loss"):
        assert ms[name]["forward"] > 0 and ms[name]["backward"] > 0 and ms[name]["test"] > 0
    assert ms["(sgd_update)"]["update"] > 0 and ms["(sgd_update)"]["forward"] == 0
    assert prof.total_ms() == pytest.approx(sum(sum(c[p] for p in ("forward", "backward",
                                                                     "update"))
                                                for c in ms.values()))
    table = prof.format(FAKE)
    assert "3 iterations" in table and "test-phase forward (1 call)" in table
    assert all(f"  {name} " in table for name in ms)


def test_a_fused_group_is_one_row():
    from latte.stdlib import ConvolutionLayer, MaxPoolingLayer

    rng = np.random.default_rng(0)
    net = Net(4, num_threads=1, seed=0, profile=True)   # opt level 3: cross-layer fusion
    data, label = ArrayDataLayer(net, (rng.standard_normal((8, 3, 16, 16)).astype(np.float32),
                                       rng.integers(0, 3, 8)))
    conv = ConvolutionLayer("conv", net, data, 4, 3, pad=1)
    pool = MaxPoolingLayer("pool", net, ReLULayer("relu", net, conv), 2)
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, pool, 3), label)
    net.init()
    _train(net, 2)
    names = [g.name for g in net.program.groups]
    assert names   # else the checks below hold vacuously
    ms = net.profile.ms_per_call()
    for group in names:   # one kernel runs every member: the row names them all
        assert ms[group]["forward"] > 0 and ms[group]["backward"] > 0
    fused = {member for group in names for member in group.split("+")}
    assert {"conv", "relu", "pool", "fc"} <= fused | set(ms)
    assert not fused & set(ms)


# ---------------------------------------------------------------- operations per ensemble

def _flops(net: Net, row: str) -> dict[str, int]:
    return {p: net.profile.flops[row][p] for p in ("forward", "backward", "test")}


@pytest.mark.parametrize("opt_level", [0, 3])
def test_flops_of_a_fully_connected_layer(opt_level):
    b, i, o = 16, 64, 32   # large enough for GEMMs at level 3
    net = Net(b, num_threads=1, opt_level=opt_level, profile=True)
    FullyConnectedLayer("fc", net, MemoryDataLayer(net, "data", (i,)), o)
    net.init()
    mac = 2 * b * i * o   # per product; the bias adds once per output
    assert _flops(net, "fc") == {"forward": mac + b * o, "backward": 2 * mac + b * o,
                                 "test": mac + b * o}


def _in_bounds(size: int, kernel: int, stride: int, pad: int) -> int:
    """(output, kernel offset) pairs of one dimension that read inside the image."""
    out = (size + 2 * pad - kernel) // stride + 1
    pos = np.arange(out)[:, None] * stride + np.arange(kernel)[None, :] - pad
    return int(((pos >= 0) & (pos < size)).sum())


@pytest.mark.parametrize("opt_level,pad,stride", [(0, 0, 1), (3, 0, 1), (3, 1, 1), (3, 1, 2)])
def test_flops_of_a_convolution(monkeypatch, opt_level, pad, stride):
    monkeypatch.setenv("LATTE_WINOGRAD", "0")   # the direct method's count (4 items' tiles
    b, c, size, n, k = 4, 3, 10, 8, 3              # would share Winograd's products)
    net = Net(b, num_threads=1, opt_level=opt_level, profile=True)
    ConvolutionLayer("conv", net, MemoryDataLayer(net, "data", (c, size, size)), n, k,
                     stride=stride, pad=pad)
    net.init()
    out = (size + 2 * pad - k) // stride + 1
    mac = 2 * b * n * out * out * c * k * k   # the textbook count: padding included
    bias = b * n * out * out
    # level 3 multiplies gathered (zero-padded) columns, and the input gradient's columns
    # are scattered back: one add per column entry that lands inside the image
    scatter = b * c * _in_bounds(size, k, stride, pad) ** 2 if opt_level else 0
    assert _flops(net, "conv") == {"forward": mac + bias, "backward": 2 * mac + bias + scatter,
                                   "test": mac + bias}


@pytest.mark.parametrize("opt_level", [0, 3])
def test_flops_of_a_time_loop_count_every_step(opt_level):
    def build(steps: int, batch: int) -> Net:
        net = Net(batch, time_steps=steps, opt_level=opt_level, num_threads=1, profile=True)
        elman(net, np.random.default_rng(0))
        net.init()
        return net

    short, long = build(2, 3), build(4, 3)
    assert any(type(s).__name__ == "TimeSteps" for s in long.program.forward)
    # per step and item, each of N cells: N_IN + N multiply-adds, a bias add and a tanh
    per_item = N * (2 * N_IN + 2 * N + 2)
    assert _flops(short, "h")["forward"] == 2 * 3 * per_item
    assert _flops(long, "h")["forward"] == 4 * 3 * per_item
    assert _flops(long, "h")["backward"] == 2 * _flops(short, "h")["backward"] > 0


# ---------------------------------------------------------------- the table and the peak

def _columns(table: str, title: str) -> dict[str, list[str]]:
    """The rows (name -> cells) of the table under the line starting with ``title``."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = {}
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        name, *cells = line.split()
        rows[name] = cells
    return rows


def test_the_table_gives_gflops_and_share_of_peak():
    net = _mlp(True)
    _train(net, 3)
    net.forward(Phase.TEST)
    prof = net.profile
    table = prof.format(FAKE)
    assert table.splitlines()[0] == ("machine: Test CPU 9000 (testcpu, 256-bit vectors); peak: "
                                     "sgemm on one core 50.0 GFLOP/s x 1 thread = 50.0 GFLOP/s")
    train = _columns(table, "per ensemble, ms per training iteration")
    assert train["ensemble"] == ["forward", "backward", "total", "share", "GFLOP/s", "%",
                                 "peak"]
    for name in ("ip1", "ip2"):   # forward and backward operations over their time
        rate = prof.gflops(name, ("forward", "backward"))
        assert rate > 0
        assert float(train[name][4]) == pytest.approx(rate, abs=0.006)
        assert float(train[name][5].rstrip("%")) == pytest.approx(100 * rate / 50.0, abs=0.06)
    assert train["(data)"][4:] == ["-", "-"] and train["(sgd_update)"][4:] == ["-", "-"]
    ms = prof.ms_per_call()
    flops = sum(prof.flops[r]["forward"] + prof.flops[r]["backward"] for r in prof.flops)
    total_ms = sum(c[p] for c in ms.values() for p in ("forward", "backward", "update"))
    assert float(train["total"][4]) == pytest.approx(flops / total_ms / 1e6, abs=0.006)
    test = _columns(table, "per ensemble, ms per test-phase forward")
    assert test["ensemble"] == ["test", "share", "GFLOP/s", "%", "peak"]
    assert float(test["ip1"][2]) == pytest.approx(prof.gflops("ip1", ("test",)), abs=0.006)


def test_an_inference_only_profile_has_the_test_table_alone():
    net = _mlp(True)
    net.forward(Phase.TEST)
    table = net.profile.format(FAKE)
    assert "training iteration" not in table
    assert set(_columns(table, "per ensemble, ms per test-phase forward")) >= {"ip1", "total"}


def test_the_peak_at_n_threads_is_n_cores():
    net = Net(4, num_threads=2, profile=True)
    FullyConnectedLayer("fc", net, MemoryDataLayer(net, "data", (8,)), 4)
    net.init()
    net.forward(Phase.TEST)
    table = net.profile.format(FAKE)
    assert "x 2 threads = 100.0 GFLOP/s" in table.splitlines()[0]
    rate = net.profile.gflops("fc", ("test",))
    pct = _columns(table, "per ensemble, ms per test-phase forward")["fc"][3]
    assert float(pct.rstrip("%")) == pytest.approx(100 * rate / 100.0, abs=0.06)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_peak_is_measured_once_and_cached(cache, monkeypatch):
    calls = []

    def fake() -> float:
        calls.append(1)
        return 42.5

    first = machine.peak(fake)
    assert calls == [1] and first.gflops == 42.5 and first.at(3) == pytest.approx(127.5)
    files = list(cache.glob("peak-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["gflops"] == 42.5
    assert machine.peak(fake) == first and calls == [1]   # read back, not measured
    # format() without a peak takes the cached one: nothing is measured
    net = _mlp(True)
    net.forward(Phase.TEST)
    assert "one core 42.5 GFLOP/s" in net.profile.format()
    assert calls == [1]
    # a damaged file is measured again; another BLAS (or CPU) has a file of its own
    files[0].write_text("{not json")
    assert machine.peak(fake).gflops == 42.5 and calls == [1, 1]
    host = machine.host()
    monkeypatch.setattr(machine, "host", lambda: {**host, "blas": "OpenBLAS 9.9"})
    assert machine.peak(lambda: 7.0).gflops == 7.0
    assert len(list(cache.glob("peak-*.json"))) == 2


def test_processes_measuring_at_once_take_the_first_value_written(cache):
    """A process whose measurement ends after another's was written takes that one."""
    def first_elsewhere() -> float:
        machine.measured("speed", lambda: 2.0)   # another process, finishing first
        return 3.0

    assert machine.measured("speed", first_elsewhere) == 2.0
    assert machine.measured("speed", lambda: 5.0) == 2.0   # read back, not measured


def test_measure_sgemm_times_one_thread_and_restores_the_pool():
    from latte.compiler.blas import blas, set_blas_threads

    set_blas_threads(2)
    try:
        rate = machine.measure_sgemm(sizes=(64,), seconds=0.01)
        assert np.isfinite(rate) and rate > 0
        assert blas().scipy_openblas_get_num_threads() == 2
    finally:
        set_blas_threads(1)


def test_host_names_the_cpu_and_vector_width():
    info = machine.host()
    assert info["vector_bits"] in (128, 256, 512) and info["cpu"] and info["llvm_cpu"]
    assert re.match(r"OpenBLAS \d", info["blas"])


@pytest.fixture
def target(monkeypatch):
    """Set ``LATTE_TARGET`` for a test: the target's caches forget it before and after."""
    def use(value: str) -> None:
        monkeypatch.setenv("LATTE_TARGET", value)
        machine.target_cpu.cache_clear()
        machine.vector_registers.cache_clear()
    yield use
    monkeypatch.delenv("LATTE_TARGET", raising=False)
    machine.target_cpu.cache_clear()
    machine.vector_registers.cache_clear()


def test_an_avx2_target_leaves_out_avx512(target):
    import llvmlite.binding as llvm

    if not machine.runs_avx2():
        pytest.skip("the host has no AVX2 and FMA")
    host = llvm.get_host_cpu_features()
    target("avx2")
    name, features = machine.target_cpu()
    assert name == "haswell" and features["avx2"] and features["fma"]
    assert not any(on for f, on in features.items() if f.startswith(("avx512", "evex512", "amx")))
    assert {f for f, on in features.items() if on} <= {f for f, on in host.items() if on}
    assert machine.vector_registers() == (256, 16) and machine.host()["llvm_cpu"] == "haswell"
    target("host")
    assert machine.target_cpu() == (llvm.get_host_cpu_name(), host)
    target("avx3")
    with pytest.raises(ValueError, match="LATTE_TARGET='avx3'"):
        machine.target_cpu()


def test_a_group_fused_in_the_test_forward_alone_is_one_row():
    from latte.stdlib import BatchNormLayer

    net = Net(2, num_threads=1, seed=0, profile=True)
    x = MemoryDataLayer(net, "x", (4, 10, 10))
    conv = ConvolutionLayer("conv", net, x, 6, 3, pad=1, bias=False)
    ReLULayer("relu", net, BatchNormLayer("bn", net, conv))
    net.init()
    assert [g.name for g in net.program.test_groups] == ["conv+bn+relu"]
    net.forward(Phase.TEST)
    ms = net.profile.ms_per_call()
    assert ms["conv+bn+relu"]["test"] > 0 and "conv" not in ms
    mac = 2 * 2 * 6 * 100 * 4 * 9
    assert net.profile.flops["conv+bn+relu"]["test"] > mac


def test_counting_rules_on_hand_built_loops():
    from latte.compiler.flops import kernel_flops
    from latte.compiler.ir import (
        Affine,
        Assign,
        AugAssign,
        BinOp,
        Block,
        Buffer,
        Call,
        Compare,
        Const,
        Gemm,
        If,
        Kernel,
        Load,
        Loop,
        Ref,
        Select,
        Var,
    )

    x, y = Buffer(("x", "value"), "x", (12,)), Buffer(("y", "value"), "y", (12,))
    idx = Buffer(("i", "value"), "i", (12,), dtype="int32")
    i = Affine.of("i")

    def at(buf, e=i):
        return Ref(buf, (e,), (12,))

    def loop(var, n, *body):
        return Loop(var, 0, n, Block(tuple(body)))

    body = (
        # float: a multiply and the += itself; the integer index arithmetic is free
        AugAssign(at(y), "+", BinOp("*", Load(at(x)), Const(2.0))),
        # an integer buffer's arithmetic is free; a call and a float comparison count one
        Assign(at(idx), BinOp("+", Load(at(idx)), Const(1))),
        Assign(at(y), Select(Compare(">", Load(at(x)), Const(0.0)),
                             Call("exp", (Load(at(x)),)), Const(0.0))),
        # integer guards narrow the count exactly: 4 of 12 values of i are i % 3 == 0 and i < 10
        If(Compare("==", BinOp("%", Var("i"), Const(3)), Const(0)),
           Block((If(Compare("<", i, Const(10)), Block((Assign(at(y), BinOp(
               "/", Load(at(y)), Const(3.0))),))),))),
        # a local holding an integer condition stands for it; its else branch is the rest
        Assign(Var("c"), Compare("<", i, Const(5))),
        If(Var("c"), Block((Assign(at(y), BinOp("+", Load(at(y)), Const(1.0))),)),
           Block((Assign(at(y), BinOp("-", BinOp("*", Load(at(y)), Load(at(x))),
                                      Const(1.0))),))),
        # an inner loop shadowing i: its own range (0..1) decides the guard
        loop("i", 2, If(Compare("==", i, Const(0)),
                        Block((Assign(at(y), BinOp("max", Load(at(y)), Const(0.0))),)))),
    )
    kernel = Kernel("k", Block((loop("i", 12, *body),)))
    # per i: 2 + 0 + (1 + 1) + 1 if a third below 10 + (1 if i < 5 else 2) + 1
    expected = sum(2 + 2 + (i % 3 == 0 and i < 10) + (1 if i < 5 else 2) + 1
                   for i in range(12))
    assert kernel_flops(kernel) == expected
    gemm = Gemm(4, 5, 6, x, Affine(), 6, False, x, Affine(), 5, False, y, Affine(), 5)
    gemm_in_loop = Kernel("g", Block((loop("n", 3, gemm),)))
    assert kernel_flops(gemm_in_loop) == 3 * 2 * 4 * 5 * 6


def test_latte_run_profile_prints_an_inference_only_net(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "infer.py"
    script.write_text(
        "import numpy as np\n"
        "from latte import Net, Phase\n"
        "from latte.stdlib import FullyConnectedLayer, MemoryDataLayer\n"
        "net = Net(8, num_threads=1)\n"
        "FullyConnectedLayer('fc', net, MemoryDataLayer(net, 'x', (32,)), 16)\n"
        "net.init()\n"
        "for _ in range(3):\n"
        "    net.forward(Phase.TEST)\n")
    env = {**os.environ, "LATTE_CACHE_DIR": str(tmp_path / "cache")}
    with pytest.MonkeyPatch.context() as mp:   # the peak the command finds in its cache
        mp.setenv("LATTE_CACHE_DIR", env["LATTE_CACHE_DIR"])
        machine.peak(lambda: 12.5)
    out = subprocess.run([sys.executable, "-m", "latte", "run", str(script), "--profile"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sgemm on one core 12.5 GFLOP/s x 1 thread = 12.5 GFLOP/s" in out.stderr
    rows = _columns(out.stderr, "per ensemble, ms per test-phase forward (3 calls)")
    assert float(rows["fc"][2]) > 0 and rows["fc"][3].endswith("%")


def _conv_net() -> Net:
    net = Net(8, num_threads=2, seed=0)
    x, y = MemoryDataLayer(net, "x", (3, 16, 16)), MemoryDataLayer(net, "y", (1,))
    h = ReLULayer("relu", net, ConvolutionLayer("conv", net, x, 8, 3, pad=1))
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, h, 4), y)
    net.init()
    return net


def test_perf_map_names_the_jit_functions_where_they_run(tmp_path, monkeypatch):
    """``LATTE_PERF_MAP=1`` appends every loaded function (segments, and the internal
    functions they call: parallel loops' bodies, the products' micro-kernels) to
    ``/tmp/perf-<pid>.map`` at the address it runs from, for code just compiled and for
    code from the cache alike. The net's product is tiled on any host (an AVX-512 host's
    registers, made one here: AVX2's 16 keep it with BLAS)."""
    vector_registers(monkeypatch, 512, 32)
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LATTE_PERF_MAP", "1")
    path = Path(f"/tmp/perf-{os.getpid()}.map")
    path.unlink(missing_ok=True)
    try:
        nets = [_conv_net(), _conv_net()]
        lines = path.read_text().splitlines()
    finally:
        path.unlink(missing_ok=True)
    assert not nets[0].program.library.from_cache and nets[1].program.library.from_cache
    spans: dict = {}
    for line in lines:
        start, size, name = line.split()
        spans.setdefault(name, []).append((int(start, 16), int(size, 16)))
    for net in nets:
        for seg in net.program.segments():
            assert net.program.library.address(seg.name) in [s for s, _ in spans[seg.name]]
    assert any(re.fullmatch(r"k\d+_conv_relu_forward_par\d+_omp", n) for n in spans)
    assert any(re.fullmatch(r"tiled\d+", n) for n in spans)
    ranges = sorted(r for found in spans.values() for r in found)
    assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:]))   # none overlaps
