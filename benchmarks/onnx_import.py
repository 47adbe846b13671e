"""ONNX models imported into latte (``latte.onnx.load_onnx``) against onnxruntime on the
same files.

    python benchmarks/onnx_import.py [--models resnet18 vgg_block] [--size 64] [--batches 1 8]
                              [--threads 1 2] [--repeat 10] [--quick]

The models are PyTorch's, exported once to ONNX (eval mode, the exporter's defaults: batch
norm folded into the convolutions) in a temporary folder: ``resnet18`` is the zoo's
ResNet-18 (1000 classes) and ``vgg_block`` two VGG blocks (2 x conv 3x3 64, pool, 2 x conv
3x3 128, pool) and a classifier, both at ``--size`` x ``--size``. Per (model, batch,
threads) one worker process imports the file into latte (opt level 3, a fresh compile
cache: the compile column is a cold ``net.init()``) and times ``net.predict`` on a batch;
another times onnxruntime's ``session.run`` on the same batch (intra-op threads as
latte's). The table gives medians side by side and ort/latte (above 1: latte is faster),
and latte's largest error relative to onnxruntime's output scale.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import (  # noqa: E402
    KEEP_FREED_MEMORY,
    OtherLoad,
    emit,
    machine,
    median_ms,
    run_worker,
    table,
)
from zoo import torch_twin  # noqa: E402

MODELS = ("resnet18", "vgg_block")


def torch_model(name: str, size: int):
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    torch.manual_seed(0)
    if name == "resnet18":
        return torch_twin("resnet18", size).eval()
    conv = lambda cin, cout: [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]  # noqa: E731
    return nn.Sequential(*conv(3, 64), *conv(64, 64), nn.MaxPool2d(2), *conv(64, 128),
                         *conv(128, 128), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(128 * (size // 4) ** 2, 10)).eval()


def export(name: str, size: int, folder: str) -> str:
    import torch  # noqa: PLC0415

    path = os.path.join(folder, f"{name}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch_model(name, size), (torch.randn(1, 3, size, size),), path,
                          input_names=["data"], dynamic_axes={"data": {0: "n"}}, dynamo=False)
    return path


def ort_session(path: str, threads: int):
    import onnxruntime as ort  # noqa: PLC0415

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


# ------------------------------------------------------------------ workers
def worker(args) -> None:
    x = np.random.default_rng(0).standard_normal((args.batch, 3, args.size, args.size))
    x = x.astype(np.float32)
    if args.worker == "onnxruntime":
        import onnxruntime as ort  # noqa: PLC0415

        session = ort_session(args.model, args.threads[0])
        result = {"ms": median_ms(lambda: session.run(None, {"data": x}), args.warmup, args.repeat),
                  "note": f"onnxruntime {ort.__version__}"}
    else:
        from latte.onnx import load_onnx  # noqa: PLC0415

        expected = ort_session(args.model, 1).run(None, {"data": x})[0]   # before latte starts
        start = time.perf_counter()
        net, (data,), (out,) = load_onnx(args.model, args.batch, num_threads=args.threads[0])
        data.needs_grad = False   # inference only
        net.init()
        init_s = time.perf_counter() - start
        err = np.abs(net.predict(x, out) - expected).max() / np.abs(expected).max()
        result = {"ms": median_ms(lambda: net.predict(x, out), args.warmup, args.repeat),
                  "init_s": init_s, "err": float(err)}
    emit(result)


# ------------------------------------------------------------------ driver
def rows_for(args, name: str, path: str, batch: int, threads: int) -> list[str] | None:
    extra = ["--model", path, "--batch", str(batch), "--size", str(args.size),
             "--repeat", str(args.repeat), "--warmup", str(args.warmup)]
    cache = tempfile.mkdtemp(prefix="latte-onnx-bench-")
    try:
        latte = run_worker(__file__, "latte", threads, extra,
                           {"LATTE_CACHE_DIR": cache, **KEEP_FREED_MEMORY})
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    ort = run_worker(__file__, "onnxruntime", threads, extra, KEEP_FREED_MEMORY)
    if latte is None or ort is None:
        return None
    return [name, str(batch), str(threads), f"{latte['ms']:.2f}", f"{ort['ms']:.2f}",
            f"{ort['ms'] / latte['ms']:.2f}", f"{latte['err']:.1e}", f"{latte['init_s']:.1f}",
            ort["note"]]


def main() -> None:
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    ap.add_argument("--size", type=int, default=64, help="input height and width")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 repetitions")
    ap.add_argument("--worker", default=None, help="internal: run one measurement")
    ap.add_argument("--model", default=None, help="internal: the worker's ONNX file")
    ap.add_argument("--batch", type=int, default=1, help="internal: the worker's batch")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.warmup = 2, 1
    if args.worker:
        return worker(args)
    load, rows = OtherLoad(), []
    folder = tempfile.mkdtemp(prefix="latte-onnx-models-")
    try:
        for name in args.models:
            path = export(name, args.size, folder)
            for batch in args.batches:
                for threads in args.threads:
                    row = rows_for(args, name, path, batch, threads)
                    rows += [row] if row else []
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"ONNX models at {args.size}x{args.size}, float32, inference; median of {args.repeat} "
          f"after {args.warmup} warm-up; {machine()}")
    print(table(rows, ["model", "batch", "threads", "latte ms", "onnxruntime ms", "ort/latte",
                       "latte error", "latte compile s", "notes"]))
    print(load.note())


if __name__ == "__main__":
    main()
