"""One training step of a character-level recurrent language model: latte vs PyTorch eager.

    python benchmarks/lstm.py [--threads 1 2] [--cells lstm gru] [--rounds 3] [--profile]

Embedding (vocabulary 128, width 128), one recurrent layer (hidden 512: LSTM, or GRU),
a linear layer per step, softmax loss; batch 32, T = 50. A step is forward, back-propagation
through time and an SGD update (momentum 0.9). Each framework and thread count runs in its
own worker process, the frameworks in turns over ``--rounds`` rounds; medians and the ratio
side by side, and the range of the rounds' ratios. ``--profile`` adds latte's time per
ensemble (``Net(profile=True)``, forward and backward).
"""

from __future__ import annotations

import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    OtherLoad,
    emit,
    latte_profile,
    machine,
    malloc_note,
    median_ms,
    run_worker,
    sgd_step,
    table,
    worker_env,
    worker_options,
)

VOCAB, WIDTH, HIDDEN, BATCH, STEPS = 128, 128, 512, 32, 50
GATES = {"lstm": 4, "gru": 3}


def gflop(cell: str) -> float:
    """Multiply-adds of the projections and the output layer, x2 for flops, x3 for a
    training step (forward, input gradients, weight gradients)."""
    g = GATES[cell]
    per_item = g * HIDDEN * (WIDTH + HIDDEN) + HIDDEN * VOCAB
    return 3 * 2 * per_item * BATCH * STEPS / 1e9


def _data():
    rng = np.random.default_rng(0)
    return rng.integers(0, VOCAB, (STEPS, BATCH)), rng.integers(0, VOCAB, (STEPS, BATCH))


def latte_net(cell: str, threads: int, profile: bool = False):
    from latte import Net
    from latte.stdlib import (
        EmbeddingLayer,
        FullyConnectedLayer,
        GRULayer,
        LSTMLayer,
        MemoryDataLayer,
        SoftmaxLossLayer,
    )

    net = Net(BATCH, time_steps=STEPS, num_threads=threads, seed=0, profile=profile)
    ids = MemoryDataLayer(net, "ids", (1,))
    label = MemoryDataLayer(net, "label", (1,))
    emb = EmbeddingLayer("emb", net, ids, VOCAB, WIDTH)
    h = {"lstm": LSTMLayer, "gru": GRULayer}[cell](cell, net, emb, HIDDEN)
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("out", net, h, VOCAB), label)
    net.init()
    x, y = _data()
    net.value(ids)[..., 0] = x
    net.value(label)[..., 0] = y
    return net


def latte_worker(cell: str, threads: int, repeat: int, warmup: int, profile: bool) -> dict:
    if profile:
        net = latte_net(cell, threads, profile=True)
        return {"profile": latte_profile(net, sgd_step(net), warmup, repeat)}
    net = latte_net(cell, threads)
    return {"step": median_ms(sgd_step(net), warmup=warmup, repeat=repeat)}


def torch_worker(cell: str, threads: int, repeat: int, warmup: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    rnn = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[cell](WIDTH, HIDDEN)
    model = torch.nn.ModuleList([torch.nn.Embedding(VOCAB, WIDTH), rnn, torch.nn.Linear(HIDDEN, VOCAB)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=0.0005)
    x, y = (torch.from_numpy(a) for a in _data())

    def step():
        opt.zero_grad()
        hs, _ = model[1](model[0](x))
        torch.nn.functional.cross_entropy(model[2](hs).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()

    return {"step": median_ms(step, warmup=warmup, repeat=repeat)}


def _args():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default=None, help="internal: run one measurement")
    ap.add_argument("--cell", default="lstm", choices=list(GATES), help="internal")
    ap.add_argument("--cells", nargs="*", default=list(GATES), choices=list(GATES))
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3,
                    help="worker runs per framework, taken in turns (the table: their median)")
    ap.add_argument("--profile", action="store_true", help="latte's time per ensemble")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 repetitions")
    ap.add_argument("--stock-malloc", action="store_true",
                    help="leave glibc malloc as it is (see harness.KEEP_FREED_MEMORY)")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.warmup, args.rounds = 2, 1, 1
    return args


def _rounds(args, cell: str, threads: int) -> tuple[dict, list[float]]:
    """Each framework's median step over ``args.rounds`` worker runs, taken in turns (latte
    first in even rounds, PyTorch in odd ones, so a drift of the machine's speed weighs on
    both alike), and each round's ratio PyTorch / latte."""
    times: dict[str, list[float]] = {"latte": [], "torch": []}
    ratios = []
    for r in range(args.rounds):
        order = ("latte", "torch") if r % 2 == 0 else ("torch", "latte")
        res = {fw: run_worker(__file__, fw, threads, worker_options(args) + ["--cell", cell],
                              worker_env(args)) for fw in order}
        for fw, out in res.items():
            if out:
                times[fw].append(out["step"])
        if res["latte"] and res["torch"]:
            ratios.append(res["torch"]["step"] / res["latte"]["step"])
    return {fw: statistics.median(t) if t else None for fw, t in times.items()}, ratios


def _profile_table(profile: dict) -> str:
    rows = [[name, f"{ph.get('forward', 0.0):.2f}", f"{ph.get('backward', 0.0):.2f}"]
            for name, ph in profile.items() if ph.get("forward") or ph.get("backward")]
    rows.append(["total", f"{sum(float(r[1]) for r in rows):.2f}",
                 f"{sum(float(r[2]) for r in rows):.2f}"])
    return table(rows, ["ensemble", "forward ms", "backward ms"])


def main() -> None:
    args = _args()
    if args.worker:
        threads = args.threads[0]
        if args.worker == "latte":
            emit(latte_worker(args.cell, threads, args.repeat, args.warmup, args.profile))
        else:
            emit(torch_worker(args.cell, threads, args.repeat, args.warmup))
        return
    load, rows, profiles = OtherLoad(), [], []
    for cell in args.cells:
        for threads in args.threads:
            ms, ratios = _rounds(args, cell, threads)
            ratio = f"{ms['torch'] / ms['latte']:.2f}x" if ms["latte"] and ms["torch"] else "-"
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
            rows.append([cell, threads] + [f"{ms[fw]:.1f}" if ms[fw] else "failed"
                                           for fw in ("latte", "torch")]
                        + [f"{gflop(cell) / ms['latte'] * 1e3:.1f}" if ms["latte"] else "-", ratio,
                           spread])
            if args.profile:
                r = run_worker(__file__, "latte", threads,
                               worker_options(args) + ["--cell", cell, "--profile"], worker_env(args))
                if r:
                    profiles.append((cell, threads, r["profile"]))
    print(f"Embedding {VOCAB}x{WIDTH} + 1-layer RNN (hidden {HIDDEN}) + linear, batch {BATCH}, "
          f"T = {STEPS}, one SGD step; median of {args.repeat} after {args.warmup} warm-up in "
          f"each of {args.rounds} rounds per framework, then the median over the rounds; "
          f"{machine()}; {malloc_note(args)}")
    print(table(rows, ["cell", "threads", "latte ms", "torch ms", "latte GFLOP/s", "torch/latte",
                       "per round"]))
    for cell, threads, profile in profiles:
        print(f"\nlatte {cell}, {threads} thread(s), per ensemble (ms per step):")
        print(_profile_table(profile))
    print(load.note())


if __name__ == "__main__":
    main()
