"""One SGD training step of LeNet at batch 64 on 28x28x1 images: latte vs PyTorch eager.

    python benchmarks/lenet.py [--threads 1 2] [--repeat 50] [--quick] [--stock-malloc]

LeNet as in Caffe's MNIST example: conv 20 5x5, max-pool 2, conv 50 5x5, max-pool 2,
fc 500, ReLU, fc 10, softmax loss. A step is forward + backward + SGD update (momentum 0.9,
weight decay 5e-4). PyTorch runs eagerly in NCHW and in channels_last. Each (framework,
threads) runs in its own worker process; the table gives medians and torch/latte (above 1:
latte is faster). Workers keep freed memory ("warm malloc", see
``harness.KEEP_FREED_MEMORY``) unless ``--stock-malloc``.

Latte's per-layer thread scaling comes from a second, profiled copy of the net
(``Net(profile=True)``: one native segment per ensemble, each timed): mean ms per step per
ensemble at each thread count and the speedup. PyTorch gets no per-layer breakdown (its
backward ops do not map back to modules without heavier machinery).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    OtherLoad,
    latte_profile,
    malloc_note,
    median_ms,
    openblas_core,
    run_frameworks,
    scaling_table,
    serve_torch_or_latte,
    sgd_step,
    table,
    torch_sgd_timing,
    worker_args,
)

BATCH = 64
FRAMEWORKS = ("latte", "torch", "torch-cl")


def _data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((BATCH * 4, 1, 28, 28)).astype(np.float32),
            rng.integers(0, 10, BATCH * 4))


def latte_lenet(threads: int, profile: bool = False, batch: int = BATCH, init: bool = True):
    """LeNet in latte at the default opt level, compiled unless ``init`` is False."""
    from latte import Net
    from latte.stdlib import (
        ArrayDataLayer,
        ConvolutionLayer,
        FullyConnectedLayer,
        MaxPoolingLayer,
        ReLULayer,
        SoftmaxLossLayer,
    )

    net = Net(batch, num_threads=threads, seed=0, profile=profile)
    data, label = ArrayDataLayer(net, _data(), shuffle=False)
    conv1 = ConvolutionLayer("conv1", net, data, 20, 5)
    pool1 = MaxPoolingLayer("pool1", net, conv1, 2)
    conv2 = ConvolutionLayer("conv2", net, pool1, 50, 5)
    pool2 = MaxPoolingLayer("pool2", net, conv2, 2)
    ip1 = FullyConnectedLayer("ip1", net, pool2, 500)
    relu1 = ReLULayer("relu1", net, ip1)
    ip2 = FullyConnectedLayer("ip2", net, relu1, 10)
    SoftmaxLossLayer("loss", net, ip2, label)
    if init:
        net.init()
    return net


def latte_worker(threads: int, repeat: int, warmup: int) -> dict:
    net = latte_lenet(threads)
    ms = median_ms(sgd_step(net), warmup=warmup, repeat=repeat)
    del net
    net = latte_lenet(threads, profile=True)
    layers = latte_profile(net, sgd_step(net), warmup, repeat)
    return {"step": ms, "layers": layers, "note": f"OpenBLAS {openblas_core()}"}


def torch_worker(threads: int, repeat: int, warmup: int, channels_last: bool) -> dict:
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    x, y = (torch.from_numpy(a) for a in _data())
    model = nn.Sequential(nn.Conv2d(1, 20, 5), nn.MaxPool2d(2), nn.Conv2d(20, 50, 5),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(800, 500), nn.ReLU(),
                          nn.Linear(500, 10))
    return torch_sgd_timing(model, x[:BATCH].contiguous(), y[:BATCH], channels_last, warmup, repeat)


def main() -> None:
    args = worker_args(repeat=50)
    if serve_torch_or_latte(args, latte_worker, torch_worker):
        return
    rows, profiles, load = [], {}, OtherLoad()
    for threads, res in run_frameworks(__file__, args, FRAMEWORKS).items():
        latte_ms = res["latte"]["step"] if res["latte"] else None
        if res["latte"]:
            profiles[threads] = res["latte"]["layers"]
        for fw, r in res.items():
            if r is None:
                rows.append([fw, threads, "-", "-", "-", "not available"])
                continue
            ratio = f"{r['step'] / latte_ms:.2f}" if latte_ms and fw != "latte" else ""
            rows.append([fw, threads, f"{r['step']:.2f}", f"{BATCH / r['step'] * 1e3:,.0f}",
                         ratio, r["note"]])
    print(f"LeNet, batch {BATCH}, 28x28x1, one SGD step (fwd+bwd+update), "
          f"median of {args.repeat}, {malloc_note(args)}")
    print(table(rows, ["framework", "threads", "step ms", "img/s", "torch/latte", "notes"]))
    if profiles:
        print(f"\nlatte per layer (profiled net, mean ms per step over {args.repeat} steps)")
        print(scaling_table(profiles))
    print(f"\n{load.note()}")


if __name__ == "__main__":
    main()
