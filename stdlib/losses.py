"""Softmax cross-entropy loss and accuracy: normalization ensembles over whole arrays."""

from __future__ import annotations

import numpy as np

from latte.errors import ShapeError
from latte.lang import NormalizationEnsemble
from latte.runtime import distributed


def _labels(label: np.ndarray, n_classes: int, who: str, valid: int) -> np.ndarray:
    idx = label.reshape(label.shape[0], -1)[:valid, 0].astype(np.int64)
    bad = (idx < 0) | (idx >= n_classes)
    if bad.any():
        i = int(np.argmax(bad))
        raise ShapeError(f"{who}: label {label.reshape(-1)[i]:g} of batch item {i} is not a class "
                         f"index in [0, {n_classes})")
    return idx


class SoftmaxLoss(NormalizationEnsemble):
    """Mean cross-entropy of ``softmax(input)`` against integer labels."""

    is_loss = True

    def __init__(self, name: str, net, input_ens, label):
        if label.size != 1:
            raise ShapeError(f"loss {name!r}: label ensemble {label.name!r} must have shape (1,)")
        super().__init__(net, name, [input_ens, label], (1,))
        self.prob = None
        self.counts = np.zeros(2)   # (correct arg-max predictions, items), all ranks
        self.scale = 1.0   # 1 / number of items the loss averages over (all ranks)

    def forward(self, inputs, value, valid):
        x = inputs[0].reshape(inputs[0].shape[0], -1)[:valid].astype(np.float64)
        idx = _labels(inputs[1], x.shape[1], f"loss {self.name!r}", valid)
        x = x - x.max(axis=1, keepdims=True)
        logsum = np.log(np.exp(x).sum(axis=1))
        nll = logsum - x[np.arange(valid), idx]
        self.prob = np.exp(x - logsum[:, None])
        value[...] = 0.0
        value[:valid, 0] = nll
        hits = (x.argmax(axis=1) == idx).sum()
        total = self.reduce(np.array([nll.sum(), valid, hits], np.float64))
        self.counts = total[[2, 1]]
        self.scale = 1.0 / max(1.0, total[1])
        self.loss = float(total[0] * self.scale)

    def reduce(self, sums: np.ndarray) -> np.ndarray:
        """Sum ``sums`` over data-parallel ranks (identity on one process)."""
        return distributed.allreduce_sum(sums)

    def backward(self, inputs, grad_inputs, value, grad, valid):
        idx = _labels(inputs[1], self.prob.shape[1], f"loss {self.name!r}", valid)
        g = self.prob.copy()
        g[np.arange(valid), idx] -= 1.0
        gi = grad_inputs[0].reshape(grad_inputs[0].shape[0], -1)
        gi[:valid] += (g * self.scale).astype(np.float32)


class Accuracy(NormalizationEnsemble):
    """Fraction of batch items whose arg-max matches the label; ``value`` is 1 per hit.

    ``counts`` (hits, items) and ``accuracy`` cover the batch of every rank under MPI.
    """

    def __init__(self, name: str, net, input_ens, label):
        super().__init__(net, name, [input_ens, label], (1,))
        self.accuracy = 0.0
        self.counts = np.zeros(2)

    def forward(self, inputs, value, valid):
        x = inputs[0].reshape(inputs[0].shape[0], -1)[:valid]
        idx = _labels(inputs[1], x.shape[1], f"accuracy {self.name!r}", valid)
        hit = (x.argmax(axis=1) == idx).astype(np.float32)
        value[...] = 0.0
        value[:valid, 0] = hit
        self.counts = distributed.allreduce_sum(np.array([hit.sum(), valid], np.float64))
        self.accuracy = float(self.counts[0] / max(1.0, self.counts[1]))


def SoftmaxLossLayer(name: str, net, input_ens, label) -> SoftmaxLoss:
    return SoftmaxLoss(name, net, input_ens, label)


def AccuracyLayer(name: str, net, input_ens, label) -> Accuracy:
    return Accuracy(name, net, input_ens, label)
