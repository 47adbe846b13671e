"""One SGD training step of Latte.jl's CIFAR-10 VGG ("vgg_mini") at batch 64 on 32x32x3
images: latte vs PyTorch eager.

    python benchmarks/vgg_mini.py [--threads 1 2] [--repeat 10] [--quick] [--stock-malloc]

The net of Latte.jl's ``examples/cifar10/vgg-mini.jl``: 3x3 convolutions with padding 1,
each followed by a ReLU, in blocks of 64, 64 | 128, 128 | 256 x 4 filters with a 2x2 max
pooling after each block, then fully connected layers of 1024, 1024 and 10 (ReLUs between)
and a softmax loss. A step is forward + backward + SGD update (momentum 0.9, weight decay
5e-4). PyTorch runs eagerly in NCHW and in channels_last; each (framework, threads) runs in
its own worker process, and the table gives medians and torch/latte (above 1: latte is
faster). Workers keep freed memory ("warm malloc", see ``harness.KEEP_FREED_MEMORY``)
unless ``--stock-malloc``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    OtherLoad,
    malloc_note,
    median_ms,
    openblas_core,
    run_frameworks,
    serve_torch_or_latte,
    sgd_step,
    table,
    torch_sgd_timing,
    worker_args,
)

BATCH, CLASSES = 64, 10
BLOCKS = ((64, 64), (128, 128), (256, 256, 256, 256))
FC = (1024, 1024)
FRAMEWORKS = ("latte", "torch", "torch-cl")


def _flops() -> float:
    """Multiply-adds x 2 of a training step: forward, and backward twice over (input and
    weight gradients; the first convolution has no input gradient)."""
    fwd, size, channels, first = 0.0, 32, 3, 0.0
    for block in BLOCKS:
        for filters in block:
            layer = 2 * size * size * channels * filters * 9
            first = first or layer
            fwd, channels = fwd + layer, filters
        size //= 2
    widths = (channels * size * size, *FC, CLASSES)
    fwd += sum(2 * a * b for a, b in zip(widths, widths[1:]))
    return BATCH * (3 * fwd - first)


def _data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((BATCH * 2, 3, 32, 32)).astype(np.float32),
            rng.integers(0, CLASSES, BATCH * 2))


def latte_vgg_mini(threads: int):
    """vgg_mini in latte at the default opt level, compiled."""
    from latte import Net
    from latte.stdlib import (
        ArrayDataLayer,
        ConvolutionLayer,
        FullyConnectedLayer,
        MaxPoolingLayer,
        ReLULayer,
        SoftmaxLossLayer,
    )

    net = Net(BATCH, num_threads=threads, seed=0)
    data, label = ArrayDataLayer(net, _data(), shuffle=False)
    top = data
    for b, block in enumerate(BLOCKS, 1):
        for i, filters in enumerate(block, 1):
            conv = ConvolutionLayer(f"conv{b}_{i}", net, top, filters, 3, pad=1)
            top = ReLULayer(f"relu{b}_{i}", net, conv)
        top = MaxPoolingLayer(f"pool{b}", net, top, 2)
    for i, width in enumerate(FC, 4):
        top = ReLULayer(f"relu{i}", net, FullyConnectedLayer(f"fc{i}", net, top, width))
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc6", net, top, CLASSES), label)
    net.init()
    return net


def latte_worker(threads: int, repeat: int, warmup: int) -> dict:
    net = latte_vgg_mini(threads)
    return {"step": median_ms(sgd_step(net), warmup=warmup, repeat=repeat),
            "note": f"OpenBLAS {openblas_core()}"}


def torch_worker(threads: int, repeat: int, warmup: int, channels_last: bool) -> dict:
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    x, y = (torch.from_numpy(a) for a in _data())
    layers, channels = [], 3
    for block in BLOCKS:
        for filters in block:
            layers += [nn.Conv2d(channels, filters, 3, padding=1), nn.ReLU()]
            channels = filters
        layers.append(nn.MaxPool2d(2))
    widths = (channels * 4 * 4, *FC)
    layers.append(nn.Flatten())
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(widths[-1], CLASSES))
    return torch_sgd_timing(model, x[:BATCH].contiguous(), y[:BATCH], channels_last, warmup, repeat)


def main() -> None:
    args = worker_args(repeat=10)
    if serve_torch_or_latte(args, latte_worker, torch_worker):
        return
    rows, load, flops = [], OtherLoad(), _flops()
    for threads, res in run_frameworks(__file__, args, FRAMEWORKS).items():
        latte_ms = res["latte"]["step"] if res["latte"] else None
        for fw, r in res.items():
            if r is None:
                rows.append([fw, threads, "-", "-", "-", "-", "not available"])
                continue
            ratio = f"{r['step'] / latte_ms:.2f}" if latte_ms and fw != "latte" else ""
            rows.append([fw, threads, f"{r['step']:.1f}", f"{BATCH / r['step'] * 1e3:,.0f}",
                         f"{flops / r['step'] / 1e6:.0f}", ratio, r["note"]])
    print(f"vgg_mini (Latte.jl's CIFAR-10 VGG), batch {BATCH}, 32x32x3, one SGD step "
          f"(fwd+bwd+update), median of {args.repeat}, {malloc_note(args)}")
    print(table(rows, ["framework", "threads", "step ms", "img/s", "GFLOP/s", "torch/latte",
                       "notes"]))
    print(f"\n{load.note()}")


if __name__ == "__main__":
    main()
