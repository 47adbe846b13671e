"""Zero-copy joins: a GoogLeNet inception block with its concat copied and not.

    python benchmarks/concat.py [--threads 1 2] [--repeat 30] [--quick]

GoogLeNet's block 3a (Szegedy et al.) on a batch of 8 (192, 28, 28) inputs: 1x1 (64); 1x1
(96) then 3x3 (128); 1x1 (16) then 5x5 (32); 3x3 max pool then 1x1 (32), each convolution
under a ReLU, the four branches joined along the channels (256), then the 1x1 convolution (128) of
block 3b's first branch reading the join. Two nets, the same but for the join, at opt level
3, in one worker process per thread count, timed in turn (a call of one, a call of the
other), so that other processes' load falls on both alike:

- ``zero-copy``: ``ConcatLayer``, which the compiler makes zero-copy (the branches compute
  into the join's buffer, the join runs no code: ``latte.compiler.joins``);
- ``copy``: the same ``ConcatLayer`` compiled with ``LATTE_JOINS=0``, which keeps every
  join a copy, forward and backward, as every concat was before joins were zero-copy.

``fwd`` is the test forward (``net.forward(Phase.TEST)``), ``fwd+bwd`` a training pass
(backward from the zeroed gradient of the last layer), medians in ms; ``join ms`` is the
time of the concat's own kernels in the copy net's training pass (``Net(profile=True)``,
forward + backward).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    OtherLoad,
    emit,
    fwd_bwd,
    latte_profile,
    machine,
    malloc_note,
    run_worker,
    table,
    worker_args,
    worker_env,
    worker_options,
)

BATCH, SHAPE = 8, (192, 28, 28)
WIDTHS = (64, 96, 128, 16, 32, 32)   # GoogLeNet's 3a: 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj
NEXT = 128                           # 3b's 1x1 branch


def latte_net(variant: str, threads: int, batch: int, profile: bool = False):
    from latte import Net
    from latte.stdlib import ConcatLayer, ConvolutionLayer, MaxPoolingLayer, MemoryDataLayer, ReLULayer

    net = Net(batch, opt_level=3, num_threads=threads, seed=0, profile=profile)
    data = MemoryDataLayer(net, "data", SHAPE)
    data.needs_grad = False

    def conv(name, x, n, k):
        return ReLULayer(f"{name}_relu", net, ConvolutionLayer(name, net, x, n, k, pad=k // 2))

    n1, r3, n3, r5, n5, pp = WIDTHS
    branches = [conv("1x1", data, n1, 1), conv("3x3", conv("3x3_reduce", data, r3, 1), n3, 3),
                conv("5x5", conv("5x5_reduce", data, r5, 1), n5, 5),
                conv("pool_proj", MaxPoolingLayer("pool", net, data, 3, 1, 1), pp, 1)]
    conv("next_1x1", ConcatLayer("output", net, branches), NEXT, 1)
    os.environ["LATTE_JOINS"] = "1" if variant == "zero-copy" else "0"
    try:
        net.init()
    finally:
        del os.environ["LATTE_JOINS"]
    net.value(data)[...] = np.random.default_rng(0).standard_normal((batch, *SHAPE))
    return net


def _alternating(fns: dict, warmup: int, repeat: int) -> dict[str, float]:
    """Median ms of each of ``fns``, timed in turn (one call of each per round), so that
    other processes' load falls on all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def latte_worker(threads: int, repeat: int, warmup: int) -> dict:
    from latte import Phase

    nets = {v: latte_net(v, threads, BATCH) for v in ("copy", "zero-copy")}
    joins = nets["zero-copy"].program.joins
    out = {f"{v} fwd": ms for v, ms in _alternating(
        {v: (lambda n=n: n.forward(Phase.TEST)) for v, n in nets.items()}, warmup, repeat).items()}
    out |= {f"{v} fwd_bwd": ms for v, ms in _alternating(
        {v: fwd_bwd(n) for v, n in nets.items()}, warmup, repeat).items()}
    timed = latte_net("copy", threads, BATCH, profile=True)
    out["join"] = sum(latte_profile(timed, fwd_bwd(timed), warmup, repeat).get("output", {}).values())
    out["note"] = "zero-copy" if len(joins) == 1 and joins[0].why_not is None else "copied"
    return out


def main() -> None:
    args = worker_args()
    if args.worker:
        emit(latte_worker(args.threads[0], args.repeat, args.warmup))
        return
    load = OtherLoad()
    rows = []
    for threads in args.threads:
        r = run_worker(__file__, "latte", threads, worker_options(args), env=worker_env(args))
        if r is None:
            continue
        rows.append([str(threads), f"{r['copy fwd']:.2f}", f"{r['zero-copy fwd']:.2f}",
                     f"{r['copy fwd'] / r['zero-copy fwd']:.2f}x", f"{r['copy fwd_bwd']:.2f}",
                     f"{r['zero-copy fwd_bwd']:.2f}", f"{r['copy fwd_bwd'] / r['zero-copy fwd_bwd']:.2f}x",
                     f"{r['join']:.2f}", r["note"]])
    print(f"inception block 3a + 3b's 1x1, batch {BATCH}, opt level 3; {machine()}; "
          f"{malloc_note(args)}; median of {args.repeat}")
    print(table(rows, ["threads", "copy fwd", "zero-copy fwd", "speedup", "copy fwd+bwd",
                       "zero-copy fwd+bwd", "speedup", "join ms (copy)", "zero-copy net"]))
    print(load.note())


if __name__ == "__main__":
    main()
