"""Cross-layer fusion: latte at opt level 2 (unfused) and 3 (fused) against PyTorch and
onnxruntime, and a BrainSlug-style stack of pooling layers.

    python benchmarks/fusion.py [--threads 1 2] [--repeat 20] [--quick] [--stock-malloc]

Three benchmarks, one table each, medians measured in the same run:

- ``vgg_micro``: forward of VGG's first layers at batch 16 on 3x224x224 images: conv 3->64
  3x3 pad 1, ReLU, max-pool 2 (the Latte paper's microbenchmark);
- ``vgg_block1``: VGG's whole first block at batch 4 on 224x224: conv 3->64, ReLU, conv
  64->64, ReLU, max-pool 2 (3x3 convolutions, pad 1), forward and forward + backward
  (gradients of the weights and biases; the image needs none). onnxruntime runs inference
  only;
- ``stack``: N x (max-pool 3x3 stride 1 pad 1, ReLU) on a (16, 64, 56, 56) input for N in
  1, 2, 5, 10, 20, 40 (BrainSlug's synthetic benchmark), forward, latte opt level 3 against
  latte opt level 2 only: the same generated code, fused or not.

Frameworks: ``latte-o2`` and ``latte-o3`` (``Net(opt_level=...)``), PyTorch eager in NCHW
(``torch``) and channels_last (``torch-cl``), and onnxruntime (``ort``: the PyTorch module
exported with ``torch.onnx.export``, ``intra_op_num_threads`` = the thread count, all graph
optimizations, so its own conv + ReLU fusion). ``fwd`` is inference: latte's
``net.forward(Phase.TEST)`` (fused groups keep intermediates in line buffers, max pooling
stores no arg-max), PyTorch under ``torch.inference_mode()``, onnxruntime; ``train fwd`` is
latte's training forward (every value and arg-max kept for backward); forward + backward is
a training pass in both. For ``vgg_block1`` a figure-13 table follows: the same forward and
forward + backward at each opt level 0-3, each level against the one before. latte's
backward starts from the zeroed gradient of the last layer, PyTorch's from a random one
(the same dense loops either way). Inputs are written once, outside the timed region.

Each (benchmark, framework, threads) runs in its own worker process (see ``harness.py``);
workers keep freed memory (``harness.KEEP_FREED_MEMORY``) unless ``--stock-malloc``. Ratios
are ``time / time of latte-o3``: above 1, fused latte is faster. The forward + backward
timings of ``vgg_block1`` take ``--repeat`` / 2 repetitions, the stack ``--repeat`` / 2
(each stack worker compiles up to 40 layers). The notes give latte's fused groups.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    OtherLoad,
    emit,
    fwd_bwd,
    malloc_note,
    median_ms,
    openblas_core,
    run_worker,
    table,
    torch_note,
    worker_args,
    worker_env,
    worker_options,
)

FRAMEWORKS = ("latte-o2", "latte-o3", "torch", "torch-cl", "ort")
DEPTHS = (1, 2, 5, 10, 20, 40)
# benchmark: (batch, (channels, height, width), convolutions' output channels, backward too?)
BLOCKS = {"vgg_micro": (16, (3, 224, 224), (64,), False),
          "vgg_block1": (4, (3, 224, 224), (64, 64), True)}
STACK = (16, (64, 56, 56))


def _halved(repeat: int, warmup: int) -> tuple[int, int]:
    """Repetitions and warm-up calls of the slower measurements (forward + backward, the
    stack): half of ``--repeat`` and ``--warmup``, at least 3 and 1."""
    return max(3, repeat // 2), max(1, warmup // 2)


def _input(batch: int, shape) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((batch, *shape)).astype(np.float32)


def _flops(bench: str) -> float:
    """Multiply-adds x 2 of the block's convolutions, forward."""
    batch, (c, h, w), filters, _ = BLOCKS[bench]
    total = 0
    for f in filters:
        total += 2 * batch * f * h * w * c * 9
        c = f
    return total


# ---------------------------------------------------------------- workers
def _latte_net(bench: str, opt_level: int, threads: int, depth: int = 0):
    from latte import Net
    from latte.stdlib import ConvolutionLayer, MaxPoolingLayer, MemoryDataLayer, ReLULayer

    batch, shape = STACK if bench == "stack" else BLOCKS[bench][:2]
    net = Net(batch, opt_level=opt_level, num_threads=threads, seed=0)
    data = MemoryDataLayer(net, "data", shape)
    data.needs_grad = False   # an image, as in torch: no input gradient
    ens = data
    if bench == "stack":
        for i in range(depth):
            ens = MaxPoolingLayer(f"pool{i}", net, ens, 3, stride=1, pad=1)
            ens = ReLULayer(f"relu{i}", net, ens)
    else:
        for i, filters in enumerate(BLOCKS[bench][2], start=1):
            ens = ConvolutionLayer(f"conv1_{i}", net, ens, filters, 3, pad=1)
            ens = ReLULayer(f"relu1_{i}", net, ens)
        MaxPoolingLayer("pool1", net, ens, 2)
    net.init()
    net.value(data)[...] = _input(batch, shape)
    return net


def _groups(net) -> str:
    groups = [g.name for g in getattr(net.program, "groups", [])]
    if not groups:
        return "no fused groups"
    if len(groups) > 2:
        return f"{len(groups)} fused groups: {groups[0]}, ..."
    return "fused: " + ", ".join(groups)


def latte_worker(bench: str, opt_level: int, threads: int, repeat: int, warmup: int,
                 depth: int = 0) -> dict:
    from latte import Phase

    net = _latte_net(bench, opt_level, threads, depth)
    if opt_level == 0:   # plain loops: seconds per pass
        repeat, warmup = 1, 0
    out = {"fwd": median_ms(lambda: net.forward(Phase.TEST), warmup=warmup, repeat=repeat),
           "groups": len(getattr(net.program, "groups", [])),
           "note": f"OpenBLAS {openblas_core()}; {_groups(net)}"}
    if bench != "stack":
        out["train_fwd"] = median_ms(net.forward, warmup=warmup, repeat=repeat)
    if bench != "stack" and BLOCKS[bench][3]:
        half_repeat, half_warmup = _halved(repeat, warmup) if opt_level else (1, 0)
        out["fwd_bwd"] = median_ms(fwd_bwd(net), warmup=half_warmup, repeat=half_repeat)
    return out


def _torch_block(bench: str):
    from torch import nn

    _, (c, _, _), filters, _ = BLOCKS[bench]
    layers = []
    for f in filters:
        layers += [nn.Conv2d(c, f, 3, padding=1), nn.ReLU(inplace=True)]
        c = f
    return nn.Sequential(*layers, nn.MaxPool2d(2))


def torch_worker(bench: str, threads: int, repeat: int, warmup: int, channels_last: bool) -> dict:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    batch, shape, filters, backward = BLOCKS[bench]
    model = _torch_block(bench)
    x = torch.from_numpy(_input(batch, shape))
    grad = torch.randn(batch, filters[-1], shape[1] // 2, shape[2] // 2)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
        grad = grad.to(memory_format=torch.channels_last)

    def fwd():
        with torch.inference_mode():
            return model(x)

    def torch_fwd_bwd():
        model.zero_grad(set_to_none=False)
        model(x).backward(grad)

    out = {"fwd": median_ms(fwd, warmup=warmup, repeat=repeat), "note": torch_note(channels_last)}
    if backward:
        half_repeat, half_warmup = _halved(repeat, warmup)
        out["fwd_bwd"] = median_ms(torch_fwd_bwd, warmup=half_warmup, repeat=half_repeat)
    return out


def ort_worker(bench: str, threads: int, repeat: int, warmup: int) -> dict:
    import io

    import onnxruntime as ort
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    batch, shape, _, _ = BLOCKS[bench]
    model = _torch_block(bench).eval()
    x = _input(batch, shape)
    onnx = io.BytesIO()
    with warnings.catch_warnings():   # the TorchScript exporter is deprecated, not gone
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(x),), onnx, input_names=["x"],
                          output_names=["y"], dynamo=False)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(onnx.getvalue(), opts, providers=["CPUExecutionProvider"])
    return {"fwd": median_ms(lambda: session.run(None, {"x": x}), warmup=warmup, repeat=repeat),
            "note": f"onnxruntime {ort.__version__}: {_optimized_graph(onnx.getvalue(), threads)}"}


def _optimized_graph(model: bytes, threads: int) -> str:
    """The ops onnxruntime runs after its graph optimizations (its layout change, fusions)."""
    import tempfile

    import onnxruntime as ort
    try:
        import onnx
    except ImportError:
        return "optimized graph unknown (no onnx package)"
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3   # not the warning that the saved graph is machine specific
    with tempfile.TemporaryDirectory() as tmp:
        opts.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        nodes = onnx.load(opts.optimized_model_filepath).graph.node
    ops = []
    for n in nodes:
        act = [a.s.decode() for a in n.attribute if a.name == "activation"]
        prefix = "nchwc." if n.domain == "com.microsoft.nchwc" else ""
        ops.append(prefix + n.op_type + "".join(f"+{a}" for a in act))
    return ", ".join(ops)


def run_one(name: str, threads: int, repeat: int, warmup: int) -> dict:
    bench, fw, *rest = name.split("/")
    if fw.startswith("latte-o"):
        return latte_worker(bench, int(fw[-1]), threads, repeat, warmup,
                            int(rest[0]) if rest else 0)
    if fw == "ort":
        return ort_worker(bench, threads, repeat, warmup)
    return torch_worker(bench, threads, repeat, warmup, fw == "torch-cl")


# ---------------------------------------------------------------- driver
def _ms(r: dict | None, key: str) -> str:
    return f"{r[key]:.2f}" if r and key in r else "-"


def _ratio(r: dict | None, base: dict | None, key: str) -> str:
    if not r or not base or key not in r or key not in base:
        return ""
    return f"{r[key] / base[key]:.2f}"


def block_table(bench: str, args, env: dict) -> str:
    backward = BLOCKS[bench][3]
    rows, by_threads = [], {}
    for threads in args.threads:
        res = by_threads[threads] = {
            fw: run_worker(__file__, f"{bench}/{fw}", threads, worker_options(args), env)
            for fw in FRAMEWORKS}
        base = res["latte-o3"]
        for fw, r in res.items():
            if r is None:
                rows.append([fw, threads, "-", "", "-", "-"] + (["-", ""] if backward else [])
                            + ["not available"])
                continue
            row = [fw, threads, _ms(r, "fwd"), _ratio(r, base, "fwd"),
                   f"{_flops(bench) / r['fwd'] / 1e6:.0f}", _ms(r, "train_fwd")]
            if backward:
                row += [_ms(r, "fwd_bwd"), _ratio(r, base, "fwd_bwd")]
            rows.append(row + [r["note"]])
    batch, (c, h, w), filters, _ = BLOCKS[bench]
    convs = ", ".join(f"conv {a}->{b} 3x3 pad 1, ReLU"
                      for a, b in zip((c, *filters[:-1]), filters))
    head = (f"{bench}: {convs}, max-pool 2 on {h}x{w}, batch {batch}; median of {args.repeat} "
            f"(fwd)" + (f" and {_halved(args.repeat, args.warmup)[0]} (fwd+bwd)" if backward else "")
            + f", {malloc_note(args)}")
    header = ["framework", "threads", "fwd ms", "/latte-o3", "conv GFLOP/s", "train fwd ms"]
    if backward:
        header += ["fwd+bwd ms", "/latte-o3"]
    return head + "\n" + table(rows, header + ["notes"]), by_threads[max(args.threads)]


STEPS = (  # the Latte paper's figure 13: each opt level adds optimizations to the one before
    ("latte-o0", "plain loops from the neuron code, one thread"),
    ("latte-o1", "+ loop distribution, im2col data copy, GEMMs, zero-init folding"),
    ("latte-o2", "+ row-plane tiling, parallel batch x tiles"),
    ("latte-o3", "+ cross-layer fusion; inference: line buffers, no arg-max stores"),
)


def breakdown_table(bench: str, args, env: dict, measured: dict) -> str:
    """Forward (inference) and forward + backward per opt level at the largest thread count,
    each against the one before (level 0 runs one thread; level 1 runs threads only inside
    OpenBLAS's sgemm calls; latte's own parallel loops come with level 2); ``measured``
    holds the block table's runs of levels 2 and 3."""
    threads = max(args.threads)
    rows, prev = [], None
    for fw, what in STEPS:
        r = measured.get(fw) or run_worker(__file__, f"{bench}/{fw}", threads,
                                           worker_options(args), env)
        row = [fw, what]
        for key in ("fwd", "train_fwd", "fwd_bwd"):
            row += [_ms(r, key), _ratio(prev, r, key)]
        rows.append(row)
        prev = r
    header = ["level", "adds", "fwd ms", "speedup", "train fwd ms", "speedup", "fwd+bwd ms",
              "speedup"]
    return (f"{bench} by opt level (figure 13), {threads} threads (level 1: inside OpenBLAS "
            f"only); level 0 runs once\n" + table(rows, header))


def stack_table(args, env: dict) -> str:
    repeat, warmup = _halved(args.repeat, args.warmup)
    rows, notes = [], set()
    for depth in DEPTHS:
        row, groups = [depth], "-"
        for threads in args.threads:
            res = {opt: run_worker(__file__, f"stack/latte-o{opt}/{depth}", threads,
                                   ["--repeat", str(repeat), "--warmup", str(warmup)], env)
                   for opt in (2, 3)}
            o2, o3 = res[2], res[3]
            row += [_ms(o2, "fwd"), _ms(o3, "fwd"), _ratio(o2, o3, "fwd")]
            if o3:
                groups = f"{o3['groups']} group(s) over {2 * depth} layers"
                notes.add(o3["note"].split("; ")[0])
        rows.append(row + [groups])
    header = ["N"]
    for threads in args.threads:
        header += [f"o2 ms x{threads}", f"o3 ms x{threads}", f"o2/o3 x{threads}"]
    batch, (c, h, w) = STACK
    head = (f"stack: N x (max-pool 3x3 stride 1 pad 1, ReLU) on ({batch}, {c}, {h}, {w}), "
            f"forward, median of {repeat}; {', '.join(sorted(notes))}")
    return head + "\n" + table(rows, header + ["fused groups at o3"])


def main() -> None:
    args = worker_args(repeat=20)
    if args.worker:
        emit(run_one(args.worker, args.threads[0], args.repeat, args.warmup))
        return
    env, load = worker_env(args), OtherLoad()
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}, "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')}\n", flush=True)
    for bench in BLOCKS:
        text, measured = block_table(bench, args, env)
        print(text + "\n", flush=True)
        if BLOCKS[bench][3]:
            print(breakdown_table(bench, args, env, measured) + "\n", flush=True)
    print(stack_table(args, env))
    print(f"\n{load.note()}")


if __name__ == "__main__":
    main()
