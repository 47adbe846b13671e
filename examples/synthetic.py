"""Synthetic images, command-line options and the training run shared by the model-zoo
examples.

The images are learnable: each class has a fixed random template, and a sample is its
class's template plus as much Gaussian noise.
``python examples/NET.py --size 224`` trains at ImageNet's size; under ``latte run`` (which
runs the script without its own arguments) the defaults apply.
"""

from __future__ import annotations

import argparse

import numpy as np

from latte import Net
from latte.solvers import SGD, LRPolicy, MomPolicy, SolverParameters, solve
from latte.stdlib import AccuracyLayer, ArrayDataLayer, SoftmaxLossLayer

CLASSES = 10


def options(doc: str, size: int, batch: int = 16) -> argparse.Namespace:
    """The example's options: ``--size`` (input height and width), ``--batch`` and
    ``--batches`` (training batches per epoch; the test set is a quarter of that)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=size, help=f"input size (default {size})")
    parser.add_argument("--batch", type=int, default=batch, help=f"batch size (default {batch})")
    parser.add_argument("--batches", type=int, default=8, help="training batches per epoch")
    return parser.parse_args()


def synthetic_split(opts: argparse.Namespace, channels: int = 3, seed: int = 0):
    """``(X_train, y_train), (X_test, y_test)``: float32 images ``(n, channels, size,
    size)`` of :data:`CLASSES` classes, ``opts.batches`` batches to train on."""
    rng = np.random.default_rng(seed)
    templates = rng.standard_normal((CLASSES, channels, opts.size, opts.size), np.float32)

    def draw(n: int):
        y = rng.integers(0, CLASSES, n)
        noise = rng.standard_normal((n, channels, opts.size, opts.size), np.float32)
        return templates[y] + noise, y

    n_train = opts.batch * opts.batches
    return draw(n_train), draw(max(opts.batch, n_train // 4))


def report(history) -> str:
    """The last line an example prints: losses and test accuracy."""
    first, last = history.train_loss[0], history.train_loss[-1]
    return (f"train loss {first:.3f} -> {last:.3f}, test accuracy: "
            f"{history.test_accuracy[-1]:.4f} after {len(history.test_accuracy)} epochs")


def train(doc: str, build, size: int, lr: float) -> None:
    """Train ``build(net, data, CLASSES)`` (a :mod:`latte.zoo` net returning its logits) on
    synthetic images of ``size`` x ``size`` (``--size`` overrides it) with SGD, momentum 0.9
    and rate ``lr``, for two epochs (``latte run --max-epoch N`` overrides them); print the
    report."""
    opts = options(doc, size)
    train_set, test = synthetic_split(opts)
    net = Net(opts.batch, seed=0)
    data, label = ArrayDataLayer(net, train_set, test=test, shuffle=True)
    logits = build(net, data, CLASSES)
    SoftmaxLossLayer("loss", net, logits, label)
    AccuracyLayer("accuracy", net, logits, label)
    params = SolverParameters(lr_policy=LRPolicy.Fixed(lr), mom_policy=MomPolicy.Fixed(0.9),
                              max_epoch=2, regu_coef=0.0005)
    print(report(solve(SGD(params), net)))
