"""VGG's first block at batch 16: conv 3->64 3x3 pad 1, ReLU, max-pool 2 on 224x224 images.

    python benchmarks/vgg_micro.py [--threads 1 2] [--repeat 20] [--quick] [--stock-malloc]

Forward, and forward + backward (gradients of the conv weights and bias; the input needs
none), latte vs PyTorch eager in NCHW and channels_last. Both are training-mode passes: the
forward keeps what backward needs (pooling arg-max). There is no loss: latte's backward
starts from the zeroed gradient of the pooled output, PyTorch's from a random one (the work
is the same dense loops either way). The input is written once, outside the timed region.
Each (framework, threads) runs in its own worker process; the table gives medians and
torch/latte (above 1: latte is faster). Workers keep freed memory ("warm malloc", see
``harness.KEEP_FREED_MEMORY``): with stock glibc malloc PyTorch page-faults its ~0.7 GB of
activations in again on every call, which in a VM can cost more than the convolution.

Latte's per-layer thread scaling comes from a second, profiled copy of the net
(``Net(profile=True)``): mean ms per forward+backward per ensemble and the speedup. PyTorch
gets no per-layer breakdown.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    OtherLoad,
    fwd_bwd,
    latte_profile,
    malloc_note,
    median_ms,
    openblas_core,
    run_frameworks,
    scaling_table,
    serve_torch_or_latte,
    table,
    torch_note,
    worker_args,
)

BATCH, CHANNELS, SIZE, FILTERS = 16, 3, 224, 64
FRAMEWORKS = ("latte", "torch", "torch-cl")
FLOPS = 2 * BATCH * FILTERS * SIZE * SIZE * CHANNELS * 3 * 3   # the conv's multiply-adds


def _input() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(
        (BATCH, CHANNELS, SIZE, SIZE)).astype(np.float32)


def latte_block(threads: int, profile: bool = False):
    """The block in latte, compiled at the default opt level, its input written."""
    from latte import Net
    from latte.stdlib import ConvolutionLayer, MaxPoolingLayer, MemoryDataLayer, ReLULayer

    net = Net(BATCH, num_threads=threads, seed=0, profile=profile)
    data = MemoryDataLayer(net, "data", (CHANNELS, SIZE, SIZE))
    data.needs_grad = False   # an image, as in torch: no input gradient
    conv = ConvolutionLayer("conv1_1", net, data, FILTERS, 3, pad=1)
    relu = ReLULayer("relu1_1", net, conv)
    MaxPoolingLayer("pool1", net, relu, 2)
    net.init()
    net.value(data)[...] = _input()
    return net


def latte_worker(threads: int, repeat: int, warmup: int) -> dict:
    net = latte_block(threads)
    out = {"fwd": median_ms(net.forward, warmup=warmup, repeat=repeat),
           "fwd_bwd": median_ms(fwd_bwd(net), warmup=warmup, repeat=repeat)}
    del net
    net = latte_block(threads, profile=True)
    out["layers"] = latte_profile(net, fwd_bwd(net), warmup, repeat)
    return out | {"note": f"OpenBLAS {openblas_core()}"}


def torch_worker(threads: int, repeat: int, warmup: int, channels_last: bool) -> dict:
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = nn.Sequential(nn.Conv2d(CHANNELS, FILTERS, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2))
    x = torch.from_numpy(_input())
    grad = torch.randn(BATCH, FILTERS, SIZE // 2, SIZE // 2)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
        grad = grad.to(memory_format=torch.channels_last)

    def fwd():
        return model(x)

    def torch_fwd_bwd():
        model.zero_grad(set_to_none=False)
        model(x).backward(grad)

    return {"fwd": median_ms(fwd, warmup=warmup, repeat=repeat),
            "fwd_bwd": median_ms(torch_fwd_bwd, warmup=warmup, repeat=repeat),
            "note": torch_note(channels_last)}


def main() -> None:
    args = worker_args(repeat=20)
    if serve_torch_or_latte(args, latte_worker, torch_worker):
        return
    rows, profiles, load = [], {}, OtherLoad()
    for threads, res in run_frameworks(__file__, args, FRAMEWORKS).items():
        base = res["latte"]
        if base:
            profiles[threads] = base["layers"]
        for fw, r in res.items():
            if r is None:
                rows.append([fw, threads, "-", "-", "-", "-", "-", "not available"])
                continue
            ratios = [f"{r[k] / base[k]:.2f}" if base and fw != "latte" else ""
                      for k in ("fwd", "fwd_bwd")]
            rows.append([fw, threads, f"{r['fwd']:.2f}", ratios[0], f"{r['fwd_bwd']:.2f}",
                         ratios[1], f"{FLOPS / r['fwd'] / 1e6:.0f}", r["note"]])
    print(f"VGG block: conv {CHANNELS}->{FILTERS} 3x3 pad 1, ReLU, max-pool 2 on {SIZE}x{SIZE}, "
          f"batch {BATCH}, median of {args.repeat}, {malloc_note(args)}")
    print(table(rows, ["framework", "threads", "fwd ms", "torch/latte", "fwd+bwd ms",
                       "torch/latte", "fwd GFLOP/s", "notes"]))
    if profiles:
        print(f"\nlatte per layer (profiled net, mean ms per fwd+bwd over {args.repeat} runs)")
        print(scaling_table(profiles))
    print(f"\n{load.note()}")


if __name__ == "__main__":
    main()
