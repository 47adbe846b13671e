"""A subprocess for the determinism and cache tests: builds nets, compiles them, trains two
steps and prints one JSON line per net.

    python tests/net_worker.py NET [NET ...] [--junk N]

Each line holds the net's cache key, the sha256 of its LLVM IR (None when the code came from
the cache), the sha256 of its loop IR, whether the code came from the cache and the program
was a stored one, its fused
groups and a sha256 of the loss, parameters and gradients after two SGD steps. ``--junk N``
allocates N objects first, so that objects land at other addresses than in another run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np


def lenet():
    """Caffe's LeNet at batch 4."""
    from latte.stdlib import ConvolutionLayer, FullyConnectedLayer, MaxPoolingLayer, ReLULayer

    net, data, label = _net(4, (1, 28, 28))
    p1 = MaxPoolingLayer("pool1", net, ConvolutionLayer("conv1", net, data, 20, 5), 2)
    p2 = MaxPoolingLayer("pool2", net, ConvolutionLayer("conv2", net, p1, 50, 5), 2)
    r1 = ReLULayer("relu1", net, FullyConnectedLayer("ip1", net, p2, 500))
    return _loss(net, FullyConnectedLayer("ip2", net, r1, 10), label)


def vgg_block():
    """A VGG block (conv, ReLU, conv, ReLU, max-pool) fused at opt level 3, then a classifier."""
    from latte.stdlib import ConvolutionLayer, FullyConnectedLayer, MaxPoolingLayer, ReLULayer

    net, data, label = _net(2, (3, 32, 32))
    r1 = ReLULayer("relu1", net, ConvolutionLayer("conv1", net, data, 16, 3, pad=1))
    r2 = ReLULayer("relu2", net, ConvolutionLayer("conv2", net, r1, 16, 3, pad=1))
    pool = MaxPoolingLayer("pool", net, r2, 2)
    return _loss(net, FullyConnectedLayer("ip", net, pool, 10), label)


def mlp(hidden: int = 9):
    """Two fully connected layers: a small net that compiles fast."""
    from latte.stdlib import FullyConnectedLayer, ReLULayer

    net, data, label = _net(3, (12,))
    r = ReLULayer("relu", net, FullyConnectedLayer("ip1", net, data, hidden))
    return _loss(net, FullyConnectedLayer("ip2", net, r, 5), label)


def _net(batch: int, shape: tuple[int, ...]):
    from latte import Net
    from latte.stdlib import ArrayDataLayer

    net = Net(batch, num_threads=2, seed=0, opt_level=3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * batch, *shape)).astype(np.float32)
    data, label = ArrayDataLayer(net, (x, rng.integers(0, 5, 2 * batch)), shuffle=False)
    return net, data, label


def _loss(net, top, label):
    from latte.stdlib import SoftmaxLossLayer

    SoftmaxLossLayer("loss", net, top, label)
    return net


NETS = {"lenet": lenet, "vgg_block": vgg_block, "mlp": mlp, "mlp2": lambda: mlp(17)}


def report(net) -> dict:
    from latte.compiler import format_ir

    net.init()
    program, lib = net.program, net.program.library
    loop_ir = "\n".join(format_ir(k) for s in program.segments() for k in s.kernels)
    h = hashlib.sha256()
    for _ in range(2):
        net.forward()
        net.backward()
        h.update(np.float64(net.loss).tobytes())
        for p in net.params:
            h.update(p.value.tobytes())
            h.update(p.grad.tobytes())
        net.update(0.01, 0.9, 0.0005)
    return {"key": lib.key, "llvm_ir": lib.ir_digest, "from_cache": lib.from_cache,
            "stored": program.stored,
            "loop_ir": hashlib.sha256(loop_ir.encode()).hexdigest(), "groups": len(program.groups),
            "results": h.hexdigest()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("nets", nargs="+", choices=list(NETS))
    ap.add_argument("--junk", type=int, default=0)
    args = ap.parse_args()
    junk = [object() for _ in range(args.junk)]
    for name in args.nets:
        print(json.dumps({"net": name, **report(NETS[name]())}), flush=True)
    del junk


if __name__ == "__main__":
    sys.exit(main())
