"""The model zoo on the CPU: latte against PyTorch eager (NCHW and channels_last) and
onnxruntime.

    python benchmarks/zoo.py [--nets alexnet vgg16 resnet18 resnet50] [--size 224]
                             [--modes inference training] [--threads 1 2] [--repeat 10]
                             [--quick] [--stock-malloc] [--layers]

Per net (``latte.zoo``, 1000 classes, float32): inference at batch 1 (a test-phase forward;
onnxruntime runs the PyTorch twin exported to ONNX in a temporary folder) and one SGD
training step at batch 16 (forward, softmax loss, backward, update with momentum; dropout
as the net has it), at each thread count. Every (net, mode, framework, threads) runs in a
worker process of its own, so the peak memory column is that worker's peak resident set
(the interpreter and the framework's libraries included). The table gives median
milliseconds, GFLOP/s (multiply-adds of convolutions and FC layers counted twice; a
training step as three forwards) and other/latte (above 1: latte is faster). A latte worker
first runs once on an empty compile cache (cold ``net.init()``), then again on the filled
one (warm), and is timed in that second run. Validate at small settings, e.g.
``--size 128 --nets alexnet --repeat 2 --threads 1``. ``--layers`` times latte with one
native segment per ensemble (or fused group), and prints each one's milliseconds, GFLOP/s and
share of the machine's peak (``latte run --profile``'s table); in inference, onnxruntime's
own profile per node after it; then, per stage of the net (ResNet's ``layer1`` to
``layer4``, VGG's ``conv1`` ...), latte's forward and backward milliseconds beside each
PyTorch framework's, timed in PyTorch's profiler (each twin step's call, and the autograd
nodes its operations made). ``--frameworks`` picks the peers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    KEEP_FREED_MEMORY,
    OtherLoad,
    emit,
    machine,
    median_ms,
    run_worker,
    table,
)

NETS = ("alexnet", "vgg16", "resnet18", "resnet50")
FRAMEWORKS = ("latte", "torch", "torch-cl", "onnxruntime")
MODES = {"inference": 1, "training": 16}    # mode: batch size
CLASSES = 1000


# ------------------------------------------------------------------ the nets
def latte_net(name: str, size: int, batch: int, training: bool, threads: int,
              profile: bool = False):
    """The zoo net in latte, compiled (``init_s``: the time ``net.init()`` took)."""
    from latte import Net  # noqa: PLC0415
    from latte.stdlib import MemoryDataLayer, SoftmaxLossLayer  # noqa: PLC0415
    from latte.zoo import NETS as ZOO  # noqa: PLC0415

    net = Net(batch, num_threads=threads, seed=0, profile=profile)
    data = MemoryDataLayer(net, "data", (3, size, size))
    data.needs_grad = False   # an image, as in torch: no input gradient
    logits = ZOO[name](net, data, CLASSES)
    if training:
        label = MemoryDataLayer(net, "label", (1,))
        SoftmaxLossLayer("loss", net, logits, label)
    start = time.perf_counter()
    net.init()
    init_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    net.value(data)[...] = rng.standard_normal(net.value(data).shape)
    if training:
        net.value(label)[:, 0] = rng.integers(0, CLASSES, batch)
    return net, init_s


def torch_twin(name: str, size: int):
    """The zoo net's PyTorch twin (float32, PyTorch's own initialization)."""
    import torch  # noqa: PLC0415

    from latte.zoo import NETS as ZOO  # noqa: PLC0415
    from latte.zoo import torch_twin as lib  # noqa: PLC0415

    torch.manual_seed(0)
    twin = lib.TwinNet((3, size, size))
    twin.output = ZOO[name](twin, twin.input, CLASSES, lib=lib)
    return twin


def gflop(name: str, size: int) -> float:
    """GFLOP of one sample's forward: 2 x the multiply-adds of every convolution and FC."""
    from torch import nn  # noqa: PLC0415

    twin, total = torch_twin(name, size), 0
    for node, _, _ in twin.steps:
        layer = twin.layers[node.name] if node.name in twin.layers else None
        if isinstance(layer, nn.Conv2d):
            kh, kw = layer.kernel_size
            total += 2 * node.size * layer.in_channels // layer.groups * kh * kw
        elif isinstance(layer, nn.Sequential) and isinstance(layer[1], nn.Linear):
            total += 2 * layer[1].in_features * layer[1].out_features
    return total / 1e9


# ------------------------------------------------------------------ workers
def latte_worker(args) -> dict:
    training = args.mode == "training"
    net, init_s = latte_net(args.net, args.size, MODES[args.mode], training, args.threads[0],
                            profile=args.layers)
    if args.compile_only:
        return {"init_s": init_s}
    from latte import Phase  # noqa: PLC0415
    from latte.compiler.machine import peak  # noqa: PLC0415

    def step():
        net.forward()
        net.backward()
        net.update(0.01, 0.9, 0.0005)

    fn = step if training else (lambda: net.forward(Phase.TEST))
    if args.layers:   # one native segment per ensemble (or fused group), each timed
        for _ in range(args.warmup):
            fn()
        net.profile.reset()
        ms = median_ms(fn, 0, args.repeat)
        return {"ms": ms, "init_s": init_s, "layers": net.profile.format(peak()),
                "rows": net.profile.ms_per_call()}
    return {"ms": median_ms(fn, args.warmup, args.repeat), "init_s": init_s,
            "from_cache": bool(net.program.library.from_cache)}


def torch_worker(args) -> dict:
    import torch  # noqa: PLC0415

    torch.set_num_threads(args.threads[0])
    batch, twin = MODES[args.mode], torch_twin(args.net, args.size)
    x = torch.randn(batch, 3, args.size, args.size)
    if args.worker == "torch-cl":
        twin, x = twin.to(memory_format=torch.channels_last), x.to(
            memory_format=torch.channels_last)
    if args.mode == "inference":
        twin.eval()

        def fn():
            with torch.inference_mode():
                twin(x)
    else:
        y = torch.randint(0, CLASSES, (batch,))
        opt = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9, weight_decay=0.0005)

        def fn():
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(twin.train()(x), y).backward()
            opt.step()
    out = {"ms": median_ms(fn, args.warmup, args.repeat), "note": f"torch {torch.__version__}"}
    if args.layers:
        out["rows"] = torch_rows(twin, fn, args.repeat)
    return out


def torch_rows(twin, fn, runs: int) -> dict[str, dict[str, float]]:
    """Per step of the twin (named as latte's ensembles), its forward and backward
    milliseconds per call of ``fn`` over ``runs`` calls in PyTorch's profiler: a step's
    forward is its call, its backward the autograd nodes its operations made (matched by
    sequence number); ``(other)`` is the rest (the loss, zeroing, the update)."""
    import types  # noqa: PLC0415

    from torch.profiler import profile, record_function  # noqa: PLC0415

    def traced(self, x):
        values = {self.input.name: x}
        for node, step, inputs in self.steps:
            with record_function(f"step:{node.name}"):
                values[node.name] = (step or self.layers[node.name])(
                    *(values[i.name] for i in inputs))
        return values[self.output.name]

    twin.forward = types.MethodType(traced, twin)
    start = time.perf_counter()
    with profile() as prof:
        for _ in range(runs):
            fn()
    total_us = (time.perf_counter() - start) * 1e6
    rows: dict[str, dict[str, float]] = {}
    owner: dict[int, str] = {}   # an operation's sequence number -> its step
    events = prof.events()
    for e in events:
        if e.name.startswith("step:"):
            row = rows.setdefault(e.name[5:], {"forward": 0.0, "backward": 0.0})
            row["forward"] += e.cpu_time_total
            todo = list(e.cpu_children)
            while todo:
                op = todo.pop()
                if op.sequence_nr >= 0:
                    owner[op.sequence_nr] = e.name[5:]
                todo += op.cpu_children
    for e in events:
        if e.name.startswith("autograd::engine::evaluate_function:") and e.sequence_nr in owner:
            rows[owner[e.sequence_nr]]["backward"] += e.cpu_time_total
    counted = sum(r["forward"] + r["backward"] for r in rows.values())
    rows["(other)"] = {"forward": 0.0, "backward": max(total_us - counted, 0.0)}
    return {name: {k: us / runs / 1e3 for k, us in row.items()} for name, row in rows.items()}


def ort_worker(args) -> dict | None:
    if args.mode != "inference":
        return None
    import onnxruntime as ort  # noqa: PLC0415
    import torch  # noqa: PLC0415

    twin = torch_twin(args.net, args.size).eval()
    x = torch.randn(1, 3, args.size, args.size)
    folder = tempfile.mkdtemp(prefix="latte-zoo-onnx-")
    try:
        path = os.path.join(folder, f"{args.net}.onnx")
        torch.onnx.export(twin, (x,), path, input_names=["data"], dynamo=False)
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = args.threads[0]
        options.enable_profiling = args.layers
        options.profile_file_prefix = os.path.join(folder, "profile")
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        feed = {"data": x.numpy()}
        out = {"ms": median_ms(lambda: session.run(None, feed), args.warmup, args.repeat),
               "note": f"onnxruntime {ort.__version__}"}
        if args.layers:
            out["layers"] = ort_layers(session.end_profiling())
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def ort_layers(trace: str) -> str:
    """Each node's median time per run in onnxruntime's profile ``trace`` (its JSON events),
    in the order the nodes run, and their total."""
    with open(trace) as f:
        events = [e for e in json.load(f) if e.get("cat") == "Node"
                  and e["name"].endswith("_kernel_time")]
    runs: dict[str, tuple[str, list[int]]] = {}
    for e in events:
        runs.setdefault(e["name"].removesuffix("_kernel_time"),
                        (e["args"].get("op_name", ""), []))[1].append(e["dur"])
    rows = [(name, op, statistics.median(times) / 1e3) for name, (op, times) in runs.items()]
    width = max(len(name) for name, _, _ in rows)
    lines = ["per node, ms per run (median over the runs):",
             f"  {'node':{width}}  {'op':20}  ms"]
    lines += [f"  {name:{width}}  {op:20}  {ms:.3f}" for name, op, ms in rows]
    lines.append(f"  {'total':{width}}  {'':20}  {sum(ms for _, _, ms in rows):.3f}")
    return "\n".join(lines)


def worker(args) -> None:
    run = {"latte": latte_worker, "onnxruntime": ort_worker}.get(args.worker, torch_worker)
    result = run(args)
    if result is not None:
        result["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        emit(result)


# ------------------------------------------------------------------ driver
def run(args, framework: str, net: str, mode: str, threads: int, cache: str,
        compile_only: bool = False) -> dict | None:
    extra = ["--net", net, "--mode", mode, "--size", str(args.size), "--repeat",
             str(args.repeat), "--warmup", str(args.warmup), *(["--layers"] if args.layers else [])]
    env = dict(LATTE_CACHE_DIR=cache, **({} if args.stock_malloc else KEEP_FREED_MEMORY))
    return run_worker(__file__, framework, threads,
                      extra + (["--compile-only"] if compile_only else []), env)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nets", nargs="*", default=list(NETS), choices=NETS)
    ap.add_argument("--size", type=int, default=224, help="input height and width")
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--frameworks", nargs="*", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 repetitions")
    ap.add_argument("--layers", action="store_true",
                    help="latte's time, GFLOP/s and share of the peak per ensemble, "
                         "onnxruntime's time per node (inference), and each stage's time "
                         "in latte and PyTorch")
    ap.add_argument("--stock-malloc", action="store_true",
                    help="leave glibc malloc as it is (see harness.KEEP_FREED_MEMORY)")
    ap.add_argument("--worker", default=None, help="internal: run one measurement")
    ap.add_argument("--net", default=None, help="internal: the worker's net")
    ap.add_argument("--mode", default=None, choices=list(MODES), help="internal")
    ap.add_argument("--compile-only", action="store_true", help="internal")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.warmup = 2, 1
    if args.worker:
        return worker(args)
    if args.layers:
        for net in args.nets:
            for mode in args.modes:
                for threads in args.threads:
                    _layers(args, net, mode, threads)
        return
    load, rows = OtherLoad(), []
    for net in args.nets:
        flop = gflop(net, args.size)
        for mode in args.modes:
            work = flop * MODES[mode] * (3 if mode == "training" else 1)
            for threads in args.threads:
                rows += _rows(args, net, mode, threads, work)
    print(f"latte.zoo nets at {args.size}x{args.size}, {CLASSES} classes, float32; median of "
          f"{args.repeat} after {args.warmup} warm-up; {machine()}; "
          f"{'stock' if args.stock_malloc else 'warm'} malloc")
    print(table(rows, ["net", "mode (batch)", "threads", "framework", "ms", "GFLOP/s",
                       "other/latte", "peak MiB", "compile cold s", "compile warm s", "notes"]))
    print(load.note())


def _layers(args, net: str, mode: str, threads: int) -> None:
    """``--layers``: latte's profile and onnxruntime's (inference), then each stage's
    forward and backward milliseconds in latte and in each PyTorch framework asked for."""
    rows = {}   # framework -> its rows (latte's ensembles and groups, PyTorch's steps)
    for fw in args.frameworks:
        result = run(args, fw, net, mode, threads, tempfile.gettempdir())
        if result is None:
            continue
        if "rows" in result:
            rows[fw] = result["rows"]
        print(f"{fw} {net}, {mode} (batch {MODES[mode]}), {threads} thread(s), "
              f"{args.size}x{args.size}: {result['ms']:.1f} ms a run"
              + ("" if fw.startswith("torch") else " (profiled)"))
        if "layers" in result:
            print(result["layers"])
    peers = [fw for fw in rows if fw.startswith("torch")]
    if "latte" not in rows or not peers:
        return
    # a fused group's members count in its first one's stage
    fused = {m: g.split("+")[0] for g in rows["latte"] for m in g.split("+")}
    found = {fw: stages(r, fused) for fw, r in rows.items()}
    print(f"per stage, ms per run (PyTorch in its profiler, whose overhead it includes; "
          f"other/latte: forward and backward together); {machine()}")
    lines = []
    for stage in dict.fromkeys([*found["latte"], *(s for fw in peers for s in found[fw])]):
        mine = found["latte"].get(stage)
        line = [stage, *_cells(mine)]
        for fw in peers:
            theirs = found[fw].get(stage)
            ratio = f"{sum(theirs) / sum(mine):.2f}" if mine and theirs and sum(mine) else "-"
            line += [*_cells(theirs), ratio]
        lines.append(line)
    heads = ["stage", "latte fwd", "latte bwd"]
    for fw in peers:
        heads += [f"{fw} fwd", f"{fw} bwd", f"{fw}/latte"]
    print(table(lines, heads))


def stages(rows: dict[str, dict[str, float]],
           fused: dict[str, str]) -> dict[str, tuple[float, float]]:
    """``(forward, backward)`` milliseconds per stage: rows (an ensemble, a fused group
    ``a+b``, a twin's step) summed by their first ensemble's name (through ``fused``: the
    group's first member) up to its first ``_`` (ResNet's ``layer3``, VGG's ``conv4``); a
    test forward counts as forward, runtime rows (``(sgd_update)``) stay their own."""
    out: dict[str, tuple[float, float]] = {}
    for name, ms in rows.items():
        first = name.split("+")[0]
        stage = name if name.startswith("(") else fused.get(first, first).split("_")[0]
        fwd, bwd = out.get(stage, (0.0, 0.0))
        out[stage] = (fwd + ms.get("forward", 0.0) + ms.get("test", 0.0),
                      bwd + ms.get("backward", 0.0) + ms.get("update", 0.0))
    return out


def _cells(ms: tuple[float, float] | None) -> list[str]:
    return [f"{v:.2f}" if ms and v else "-" for v in (ms or (0.0, 0.0))]


def _rows(args, net: str, mode: str, threads: int, work: float) -> list[list[str]]:
    """One row per framework for one (net, mode, threads)."""
    rows, latte_ms = [], None
    for framework in args.frameworks:
        cache = tempfile.mkdtemp(prefix="latte-zoo-")
        try:
            cold = (run(args, framework, net, mode, threads, cache, compile_only=True)
                    if framework == "latte" else None)
            result = run(args, framework, net, mode, threads, cache)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        if result is None:
            continue
        latte_ms = result["ms"] if framework == "latte" else latte_ms
        ratio = f"{result['ms'] / latte_ms:.2f}" if latte_ms and framework != "latte" else "-"
        note = result.get("note", "" if result.get("from_cache", True) else "cache missed")
        rows.append([net, f"{mode} ({MODES[mode]})", str(threads), framework,
                     f"{result['ms']:.1f}", f"{work / result['ms'] * 1e3:.1f}", ratio,
                     f"{result['peak_mib']:.0f}",
                     f"{cold['init_s']:.1f}" if cold else "-",
                     f"{result['init_s']:.2f}" if "init_s" in result else "-", note])
    return rows


if __name__ == "__main__":
    main()
