"""One SGD training step of an MLP 784-1024-1024-10 at batch 128: latte vs PyTorch eager.

    python benchmarks/mlp.py [--threads 1 2]

Prints the median step time (forward+backward+update), forward+backward alone, GFLOP/s,
and the ratio to PyTorch, each framework in its own worker process.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    emit,
    fwd_bwd,
    malloc_note,
    median_ms,
    openblas_core,
    run_worker,
    sgd_step,
    table,
    worker_args,
    worker_env,
    worker_options,
)

BATCH, SIZES = 128, (784, 1024, 1024, 10)
# forward GEMMs, weight-gradient GEMMs, input-gradient GEMMs of layers 2 and 3
FLOPS = 2 * BATCH * (2 * sum(a * b for a, b in zip(SIZES, SIZES[1:])) + sum(
    a * b for a, b in zip(SIZES[1:-1], SIZES[2:])))


def _data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((BATCH * 8, SIZES[0])).astype(np.float32),
            rng.integers(0, SIZES[-1], BATCH * 8))


def latte_mlp(batch: int, threads: int):
    """The benchmark MLP in latte, compiled."""
    from latte import Net
    from latte.stdlib import ArrayDataLayer, FullyConnectedLayer, ReLULayer, SoftmaxLossLayer

    net = Net(batch, num_threads=threads, seed=0)
    data, label = ArrayDataLayer(net, _data(), shuffle=False)
    h = data
    for i, n in enumerate(SIZES[1:]):
        h = FullyConnectedLayer(f"ip{i}", net, h, n)
        if i < len(SIZES) - 2:
            h = ReLULayer(f"relu{i}", net, h)
    SoftmaxLossLayer("loss", net, h, label)
    net.init()
    return net


def latte_worker(threads: int, repeat: int, warmup: int) -> dict:
    net = latte_mlp(BATCH, threads)
    return {"step": median_ms(sgd_step(net), warmup=warmup, repeat=repeat),
            "fwd_bwd": median_ms(fwd_bwd(net), warmup=warmup, repeat=repeat),
            "note": f"OpenBLAS {openblas_core()}"}


def torch_worker(threads: int, repeat: int, warmup: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    x, y = (torch.from_numpy(a) for a in _data())
    layers = []
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=0.0005)
    loss_fn = torch.nn.CrossEntropyLoss()
    xb, yb = x[:BATCH], y[:BATCH]

    def torch_fwd_bwd():
        opt.zero_grad()
        loss_fn(model(xb), yb).backward()

    def step():
        torch_fwd_bwd()
        opt.step()

    return {"step": median_ms(step, warmup=warmup, repeat=repeat),
            "fwd_bwd": median_ms(torch_fwd_bwd, warmup=warmup, repeat=repeat),
            "note": f"torch {torch.__version__}"}


def main() -> None:
    args = worker_args()
    if args.worker:
        fn = {"latte": latte_worker, "torch": torch_worker}[args.worker]
        emit(fn(args.threads[0], args.repeat, args.warmup))
        return
    rows = []
    for threads in args.threads:
        res = {fw: run_worker(__file__, fw, threads, worker_options(args), worker_env(args))
               for fw in ("latte", "torch")}
        for fw, r in res.items():
            if r is None:
                rows.append([fw, threads, "-", "-", "-", "-", "not available"])
                continue
            ratio = (f"{res['torch']['step'] / r['step']:.2f}x"
                     if res.get("torch") and fw == "latte" else "")
            rows.append([fw, threads, f"{r['step']:.2f}", f"{r['fwd_bwd']:.2f}",
                         f"{FLOPS / r['step'] / 1e6:.0f}", ratio, r["note"]])
    print(f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, one SGD step, median of {args.repeat}, "
          f"{malloc_note(args)}")
    print(table(rows, ["framework", "threads", "step ms", "fwd+bwd ms", "GFLOP/s",
                       "torch/latte", "notes"]))


if __name__ == "__main__":
    main()
