"""The disk cache of compiled objects cannot poison itself: a damaged entry (truncated,
altered, empty, foreign, made for another key) is reported, deleted and rebuilt, in a new
process, with the same results as a fresh compile; entries hold only the optimized module's
object; two processes filling one cache at once leave valid entries."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
import pytest
from helpers import assert_scaled_close, fill, fill_labels, set_biases

from latte import Net
from latte.compiler import cache, codegen, jit, pipeline, schedule
from latte.compiler.fingerprint import fingerprint, kernel_buffers, shape
from latte.compiler.ir import (
    Affine,
    Assign,
    Axis,
    BinOp,
    Block,
    Buffer,
    Const,
    Gemm,
    Kernel,
    Load,
    Loc,
    Loop,
    LoopKind,
    Ref,
    walk,
)
from latte.compiler.jit import target
from latte.compiler.passes.parallel import parallel
from latte.compiler.pipeline import llvm_ir
from latte.compiler.program import Segment
from latte.errors import CompileError
from latte.stdlib import FullyConnectedLayer, MemoryDataLayer, ReLULayer, SoftmaxLossLayer

WORKER = Path(__file__).with_name("net_worker.py")
NETS = ["mlp", "mlp2"]

# y[i] = 2 * x[i] + 1 over n floats: O3 vectorizes the loop, so its object differs
SCALE = """
define void @scale(float* %x, float* %y, i64 %n) {
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%j, %loop]
  %p = getelementptr float, float* %x, i64 %i
  %v = load float, float* %p
  %w = fmul float %v, 2.0
  %z = fadd float %w, 1.0
  %q = getelementptr float, float* %y, i64 %i
  store float %z, float* %q
  %j = add i64 %i, 1
  %c = icmp slt i64 %j, %n
  br i1 %c, label %loop, label %exit
exit:
  ret void
}
"""


def _start(folder: Path) -> subprocess.Popen:
    env = dict(os.environ, LATTE_CACHE_DIR=str(folder))
    return subprocess.Popen([sys.executable, str(WORKER), *NETS], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    """The worker's reports by net name, and its stderr; it must exit 0."""
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return {r["net"]: r for r in map(json.loads, out.splitlines()) if r}, err


def _entries(folder: Path, reports: dict) -> dict[str, bytes]:
    return {net: (folder / f"{r['key']}.o").read_bytes() for net, r in reports.items()}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A cold compile of the nets into an empty cache: reports and entries."""
    folder = tmp_path_factory.mktemp("fresh")
    reports, err = _finish(_start(folder))
    assert "damaged" not in err
    return reports, _entries(folder, reports)


# ---------------------------------------------------------------- entries, in process

def test_entries_that_fail_their_check_are_rejected():
    key, other, obj = "0" * 32, "1" * 32, b"\x7fELF object code" * 100
    entry = cache.pack(key, obj)
    assert cache.unpack(key, entry) == obj
    flipped = bytearray(entry)
    flipped[-7] ^= 0x20
    for bad in (entry[:-1], entry[:40], b"", bytes(flipped), obj, cache.pack(other, obj),
                entry + b"\0"):
        with pytest.raises(ValueError):
            cache.unpack(key, bad)


def test_a_damaged_entry_is_reported_once_and_deleted(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    key = "2" * 32
    path = cache.entry_path(key)
    path.write_bytes(cache.pack(key, b"object")[:-2])
    with pytest.warns(RuntimeWarning, match=str(path)):
        assert cache.load(key) is None
    assert not path.exists()
    cache.store(key, b"object")
    assert cache.load(key) == b"object"


def test_a_failed_write_leaves_the_old_entry_and_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    key = "3" * 32
    cache.store(key, b"old")

    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    cache.store(key, b"new")
    assert cache.load(key) == b"old"
    assert [p.name for p in tmp_path.iterdir()] == [f"{key}.o"]


def _object(ir_text: str, optimize: bool) -> bytes:
    """The object the target compiles from ``ir_text`` (after O3 when ``optimize``)."""
    t = target()
    module = llvm.parse_assembly(ir_text)
    module.triple, module.data_layout = t.machine.triple, str(t.machine.target_data)
    if optimize:
        t.optimize(module)
    return t.machine.emit_object(module)


def test_the_cached_object_is_the_optimized_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    lib = target().compile(SCALE)
    assert not lib.from_cache and lib.address("scale")
    stored = cache.load(lib.key)
    assert jit._split(stored) == [_object(SCALE, optimize=True)]
    assert jit._split(stored) != [_object(SCALE, optimize=False)]
    again = target().compile(SCALE)
    assert again.from_cache and again.address("scale")
    assert cache.load(lib.key) == stored     # a hit writes nothing


def _program(value: float = 1.0, kind: LoopKind = LoopKind.SERIAL, loc=None, name: str = "x"):
    buf = Buffer(("x", "value"), name, (8,))
    store = Assign(Ref(buf, (Affine.of("i"),), (8,)), Const(value), loc=loc)
    kernel = Kernel("k", Block((Loop("i", 0, 8, Block((store,)), kind),)))
    return [Segment("fwd0", (kernel,))], {buf: 0}


def test_the_fingerprint_covers_what_codegen_reads():
    base = fingerprint(*_program(), threads=1)
    assert fingerprint(*_program(loc=Loc("net.py", 3)), threads=1) == base   # not codegen's
    for other in (_program(2.0), _program(kind=LoopKind.PARALLEL), _program(name="y")):
        assert fingerprint(*other, threads=1) != base
    assert fingerprint(*_program(), threads=2) != base
    segments, index = _program()
    assert fingerprint(segments, {b: 1 for b in index}, threads=1) != base
    with pytest.raises(TypeError):
        fingerprint([Segment("fwd0", (object(),))], index, threads=1)


# ---------------------------------------------------------------- damaged entries, new process

def _truncate(entries: dict[str, Path]):
    p = entries["mlp"]
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(entries: dict[str, Path]):
    p = entries["mlp"]
    data = bytearray(p.read_bytes())
    data[len(data) * 2 // 3] ^= 0xFF
    p.write_bytes(bytes(data))


def _empty(entries: dict[str, Path]):
    entries["mlp"].write_bytes(b"")


def _foreign(entries: dict[str, Path]):
    """A raw object without header, as the first cache format wrote."""
    p = entries["mlp"]
    p.write_bytes(cache.unpack(p.stem, p.read_bytes()))


def _swap(entries: dict[str, Path]):
    a, b = entries["mlp"], entries["mlp2"]
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)


@pytest.mark.parametrize("damage", [_truncate, _flip, _empty, _foreign, _swap],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_entry_is_rebuilt_in_a_new_process(tmp_path, fresh, damage):
    reports, entries = fresh
    paths = {net: tmp_path / f"{reports[net]['key']}.o" for net in NETS}
    for net in NETS:
        paths[net].write_bytes(entries[net])
    damage(paths)
    damaged = [net for net in NETS if paths[net].read_bytes() != entries[net]]
    again, err = _finish(_start(tmp_path))
    for net in NETS:
        assert again[net]["results"] == reports[net]["results"], net
        assert again[net]["from_cache"] == (net not in damaged), net
        assert paths[net].read_bytes() == entries[net], f"{net}: entry not rebuilt as fresh"
    assert err.count("damaged cache entry") == len(damaged), err
    for net in damaged:
        assert str(paths[net]) in err


def test_two_processes_fill_one_cache_at_once(tmp_path, fresh):
    reports, entries = fresh
    procs = [_start(tmp_path), _start(tmp_path)]
    for proc in procs:
        got, err = _finish(proc)
        assert "damaged" not in err
        assert {n: r["results"] for n, r in got.items()} == {n: r["results"] for n, r in reports.items()}
    assert _entries(tmp_path, reports) == entries
    names = {p.name for p in tmp_path.iterdir()}   # the nets' and their updates' objects,
    assert all(n.endswith((".o", ".program")) for n in names), names   # stored programs and
    # no temporary file
    assert {f"{r['key']}.o" for r in reports.values()} <= names
    got, err = _finish(_start(tmp_path))
    assert all(r["from_cache"] for r in got.values()) and "damaged" not in err


# ---------------------------------------------------------------- compile time

def _kernel_functions(ir_text: str) -> list[str]:
    """The names of the kernel functions ``ir_text`` defines (not their parallel bodies)."""
    names = re.findall(r'^define internal void @"?(k\d+_[\w.]*)', ir_text, re.MULTILINE)
    return [n for n in names if not re.search(r"_par\d+(_omp)?$", n)]


def _scale_kernel(name: str, x: Buffer, y: Buffer, axis: str, value: float = 2.0) -> Kernel:
    """``y[i] = value * x[i] + 1`` over 8 floats (``axis`` only names the loop)."""
    body = Assign(Ref(y, (Affine.of("i"),), (8,)),
                  BinOp("+", BinOp("*", Const(value), Load(Ref(x, (Affine.of("i"),), (8,)))),
                        Const(1.0)))
    return Kernel(name, Block((Loop("i", 0, 8, Block((body,)), axis=Axis(None, 0, axis)),)))


def test_identical_kernels_share_one_function_and_compute_their_own_buffers(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    bufs = [Buffer((f"e{i}", "value"), f"e{i}", (8,)) for i in range(6)]
    index = {b: i for i, b in enumerate(bufs)}
    segments = [Segment("first", (_scale_kernel("a", bufs[0], bufs[1], "a"),)),
                Segment("second", (_scale_kernel("b", bufs[2], bufs[3], "b"),)),
                Segment("third", (_scale_kernel("c", bufs[4], bufs[5], "c", value=3.0),))]
    ir_text = llvm_ir(segments, index, threads=1)[0]()
    assert len(_kernel_functions(ir_text)) == 2   # "third" multiplies by 3
    arrays = [np.arange(8, dtype=np.float32) + 10 * i for i in range(6)]
    table = (ctypes.c_void_p * 6)(*(a.ctypes.data for a in arrays))
    lib = target().compile(ir_text)
    for seg in ("first", "second", "third"):
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lib.address(seg))(ctypes.addressof(table))
    for src, dst, value in ((0, 1, 2.0), (2, 3, 2.0), (4, 5, 3.0)):
        np.testing.assert_array_equal(arrays[dst], value * arrays[src] + 1)


def _repeated(level: int, threads: int = 2):
    """fc0..fc3 (24 -> 24) with ReLUs, identical layers, then 5 logits and a softmax loss;
    compiled, with random inputs, labels and biases, forward and backward run."""
    net = Net(4, num_threads=threads, opt_level=level, seed=1)
    x = top = MemoryDataLayer(net, "x", (24,))
    label = MemoryDataLayer(net, "label", (1,))
    for i in range(4):
        top = ReLULayer(f"relu{i}", net, FullyConnectedLayer(f"fc{i}", net, top, 24))
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("out", net, top, 5), label)
    net.init()
    rng = np.random.default_rng(0)
    fill(net, x, rng)
    fill_labels(net, label, 5, rng)
    set_biases(net, rng)
    net.forward()
    net.backward()
    return net, top


def test_repeated_layers_compile_once_and_match_level_0(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    results = {}
    for level in (0, 3):
        net, top = _repeated(level)
        results[level] = [net.value(top).copy()] + [p.grad.copy() for p in net.params]
        program = net.program
        index = {b: i for i, b in enumerate(program.buffers.buffers.values())}
        segments = program.segments()
        ir_text = llvm_ir(segments, index, program.buffers.threads)[0]()
        kernels = [k for s in segments for k in s.kernels if k.body.stmts]
        # fc1..fc3 repeat fc2's forward and backward, relu1..relu3 relu0's (or fused)
        assert len(_kernel_functions(ir_text)) <= len(kernels) - 4
    for got, want in zip(results[3], results[0]):
        assert_scaled_close(got, want, 1e-5, "opt 3 against opt 0")


def test_a_hit_skips_verifying_what_a_miss_verified(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LATTE_VERIFY", raising=False)
    monkeypatch.setenv("LATTE_COMPILE_JOBS", "1")   # the verifier in this process, counted
    calls = []
    monkeypatch.setattr(pipeline, "verify_kernel", lambda k: calls.append(k))
    miss, _ = _repeated(3)
    missed, calls[:] = list(calls), []
    hit, _ = _repeated(3)
    assert not miss.program.library.from_cache and hit.program.library.from_cache
    final = [k for s in miss.program.segments() for k in s.kernels]

    def alike(k):
        return shape(k, False), tuple((b.shape, b.size) for b in kernel_buffers(k))
    # a miss verifies each kind of kernel it compiles, and one of kernels alike (fc1..fc3
    # repeat fc2's) alone
    assert {alike(k) for k in final} <= {alike(k) for k in missed}
    assert not {id(k) for k in final} <= {id(k) for k in missed}
    assert len(calls) < len(missed)   # a hit verifies the synthesized kernels alone


def test_segments_cut_into_pieces_train_as_whole_ones(tmp_path, monkeypatch):
    """Segments cut into pieces (each kernel its own, ``PIECE_COST`` at 1), which the two
    modules share out, train bit for bit as the whole segments."""
    monkeypatch.setenv("LATTE_COMPILE_JOBS", "2")
    results, whole = {}, schedule.PIECE_COST
    for cost in (whole, 1):
        monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path / str(cost)))   # code of its own
        monkeypatch.setattr(schedule, "PIECE_COST", cost)
        net, top = _repeated(3)
        results[cost] = _outputs(net, top)
    segments = net.program.segments()
    assert all(len(s.kernels) == 1 for s in segments) and "bwd1__p1" in {s.name for s in segments}
    for got, want in zip(results[1], results[whole]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_kernels_failing_the_verifier_as_they_compile_stop_init_and_no_code_is_kept(
        tmp_path, monkeypatch, jobs):
    """The final kernels are verified while their code compiles (in a forked child with two
    jobs): a failure raises the verifier's error here, and their object code is not cached;
    the program stored meanwhile fails the same way when a later init loads it."""
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LATTE_VERIFY", raising=False)
    monkeypatch.setenv("LATTE_COMPILE_JOBS", jobs)
    verify = pipeline.verify_kernel

    def refuse_gemms(kernel):   # GEMMs exist only after matching: the final kernels fail
        if any(isinstance(n, Gemm) for n in walk(kernel.body)):
            raise CompileError(f"{kernel.name}: refused")
    monkeypatch.setattr(pipeline, "verify_kernel", refuse_gemms)
    for _ in range(2):
        with pytest.raises(CompileError, match="refused"):
            _repeated(3)
    monkeypatch.setattr(pipeline, "verify_kernel", verify)
    net, _ = _repeated(3)
    assert net.program.stored and not net.program.library.from_cache


def _outputs(net, top) -> list[np.ndarray]:
    return [net.value(top).copy()] + [p.grad.copy() for p in net.params]


def test_a_program_compiles_as_one_module_per_job_with_the_same_results(tmp_path, monkeypatch):
    """LATTE_COMPILE_JOBS=2: two modules compiled side by side (one in a forked child), one
    cache entry holding both objects; the results are those of one module, bit for bit."""
    results = {}
    for jobs in (1, 2):
        monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path / str(jobs)))
        monkeypatch.setenv("LATTE_COMPILE_JOBS", str(jobs))
        net, top = _repeated(3)
        assert len(net.program.library.engines) == jobs
        results[jobs] = _outputs(net, top)
        again, top = _repeated(3)
        assert again.program.library.from_cache and len(again.program.library.engines) == jobs
        for got, want in zip(_outputs(again, top), results[jobs]):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(results[2], results[1]):
        np.testing.assert_array_equal(got, want)


def test_the_unroll_threshold_keys_the_cache_and_leaves_results_alone(tmp_path, monkeypatch):
    """LATTE_UNROLL_THRESHOLD changes the code LLVM makes: its own cache entry, the same
    results up to rounding (unrolled sums vectorize in another order); a bad value is
    named."""
    monkeypatch.setenv("LATTE_CACHE_DIR", str(tmp_path))
    results, keys = {}, {}
    for threshold in ("0", "300"):
        monkeypatch.setenv("LATTE_UNROLL_THRESHOLD", threshold)
        net, top = _repeated(3)
        assert not net.program.library.from_cache
        results[threshold], keys[threshold] = _outputs(net, top), net.program.library.key
    assert keys["0"] != keys["300"]
    for got, want in zip(results["0"], results["300"]):
        assert_scaled_close(got, want, 1e-5, "unroll threshold 0 against 300")
    monkeypatch.setenv("LATTE_UNROLL_THRESHOLD", "-1")
    with pytest.raises(ValueError, match="LATTE_UNROLL_THRESHOLD='-1'"):
        jit.unroll_threshold()


def test_split_balances_modules_and_keeps_shared_kernels_together():
    bufs = [Buffer((f"e{i}", "value"), f"e{i}", (8,)) for i in range(8)]
    big = [_scale_kernel(f"b{i}", bufs[i], bufs[i + 1], f"b{i}", value=float(i)) for i in range(3)]
    same = [_scale_kernel(f"s{i}", bufs[i], bufs[i + 1], f"s{i}", value=9.0) for i in range(4)]
    segments = [Segment("big", tuple(big)), Segment("same0", (same[0], same[1])),
                Segment("same1", (same[2],)), Segment("same2", (same[3],))]
    groups = codegen.split(segments, 2)
    assert sorted(s.name for g in groups for s in g) == sorted(s.name for s in segments)
    # the three segments of one kernel shape cost one compile, in one module
    assert [[s.name for s in g] for g in groups] == [["big"], ["same0", "same1", "same2"]]
    assert codegen.split(segments, 1) == [segments]
    assert len(codegen.split(segments, 8)) == 2   # never more modules than kernel shapes need


def test_a_failed_compile_child_is_redone_in_the_parent():
    parent = os.getpid()
    child = jit._Child(lambda: b"object" if os.getpid() == parent else 1 // 0)
    assert child.result() == b"object"
    child.cancel()
    assert not Path(child.path).exists()


def test_a_parallel_loop_receives_only_the_buffers_it_touches():
    """A kernel zeroing many buffers in parallel loops (ResNet-50's gradient zeroing) passed
    every buffer to every loop's outlined body: 11 MB of LLVM IR, half of the compile."""
    bufs = [Buffer((f"e{i}", "grad"), f"e{i}", (8,)) for i in range(6)]
    loops = tuple(parallel(Loop("i", 0, 8, Block((Assign(Ref(b, (Affine.of("i"),), (8,)),
                                                         Const(0.0)),))), 1) for b in bufs)
    ir_text = llvm_ir([Segment("zero", (Kernel("zero", Block(loops)),))],
                      {b: i for i, b in enumerate(bufs)}, threads=2)[0]()
    bodies = re.findall(r'^define internal void @"?k\d+_zero_par\d+"?\((.*)\)$', ir_text, re.MULTILINE)
    assert len(bodies) == len(bufs)
    assert all(args.count("float*") == 1 for args in bodies)
