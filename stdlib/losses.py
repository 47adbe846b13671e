"""Losses (softmax cross-entropy, Euclidean, sigmoid cross-entropy) and accuracy:
normalization ensembles over whole arrays.

A loss averages over the real items of the batch (``valid``; a partial last batch has
fewer) of every rank under MPI. A loss reading a data layer's labels has the data source
check them when it is built (:meth:`~latte.stdlib.sources.ArraySource.check_labels`), so a
bad label anywhere in the train or test set stops the script before training.
"""

from __future__ import annotations

import numpy as np

from latte.errors import ShapeError
from latte.lang import DataEnsemble, NormalizationEnsemble
from latte.runtime import distributed

ROUNDING = 16 * float(np.finfo(np.float32).eps)   # how far rounding may carry a computed target


def _check_source(label, who: str, **accepts) -> None:
    """Have ``label``'s data source check every label it holds (when it can)."""
    check = getattr(getattr(label, "source", None), "check_labels", None)
    if check is not None:
        check(label, who, **accepts)


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
        _check_source(label, f"loss {name!r}", classes=input_ens.size)
        self.prob = None
        self.counts = np.zeros(2)   # (correct arg-max predictions, items), all ranks
        self.scale = 1.0   # 1 / number of items the loss averages over (all ranks)

    def forward(self, inputs, value, valid):
        x = inputs[0].reshape(inputs[0].shape[0], -1)[:valid]
        idx = _labels(inputs[1], x.shape[1], f"loss {self.name!r}", valid)
        rows, best = np.arange(valid), x.argmax(axis=1)
        z = x.astype(np.float64)
        with np.errstate(invalid="ignore"):   # inf - inf: the NaN loss check names it
            z -= x[rows, best][:, None]   # exact in float64
        nll = -z[rows, idx]
        self.prob = np.exp(z, out=z)   # in place: the probabilities are its rows over their sums
        total = self.prob.sum(axis=1)
        self.prob /= total[:, None]
        nll += np.log(total)
        value[...] = 0.0
        value[:valid, 0] = nll
        hits = (best == idx).sum()
        total = self.reduce(np.array([nll.sum(), valid, hits], np.float64))
        self.counts = total[[2, 1]]
        self.scale = 1.0 / max(1.0, total[1])
        self.loss = float(total[0] * self.scale)

    def reduce(self, sums: np.ndarray) -> np.ndarray:
        """Sum ``sums`` over data-parallel ranks (identity on one process)."""
        return distributed.allreduce_sum(sums)

    def backward(self, inputs, grad_inputs, value, grad, valid):
        idx = _labels(inputs[1], self.prob.shape[1], f"loss {self.name!r}", valid)
        g = self.prob * self.scale
        g[np.arange(valid), idx] -= self.scale
        gi = grad_inputs[0].reshape(grad_inputs[0].shape[0], -1)
        gi[:valid] += g.astype(np.float32)


class Accuracy(NormalizationEnsemble):
    """Fraction of batch items whose arg-max matches the label; ``value`` is 1 per hit.

    ``counts`` (hits, items) and ``accuracy`` cover the batch of every rank under MPI.
    """

    def __init__(self, name: str, net, input_ens, label):
        super().__init__(net, name, [input_ens, label], (1,))
        _check_source(label, f"accuracy {name!r}", classes=input_ens.size)
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


class _TargetLoss(NormalizationEnsemble):
    """A loss of ``input`` against a ``target`` ensemble of the same size, summed over the
    elements and averaged over the batch. Subclasses give the per-element loss and its
    derivatives; the gradient reaches the target too unless it is a data layer's labels.
    ``value`` holds each item's summed loss; an ensemble reading it passes its gradient on."""

    is_loss = True
    bounds: tuple[float, float] | None = None   # the targets the loss accepts

    def __init__(self, name: str, net, input_ens, target):
        if target.size != input_ens.size:
            raise ShapeError(f"loss {name!r}: target {target.name!r} {target.shape} and input "
                             f"{input_ens.name!r} {input_ens.shape} differ in size")
        super().__init__(net, name, [input_ens, target], (1,))
        if self.bounds is not None:
            _check_source(target, f"loss {name!r}", bounds=self.bounds)
        self.to_target = not (isinstance(target, DataEnsemble)
                              and not getattr(target, "needs_grad", False))
        self.scale = 1.0   # 1 / number of items the loss averages over (all ranks)

    def _pair(self, inputs, valid: int, check: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and targets as float64 rows; bounded targets clipped to the bounds, which
        they may pass by float32's rounding (``check``: by no more, else an error)."""
        x, t = (a.reshape(a.shape[0], -1)[:valid].astype(np.float64) for a in inputs)
        if self.bounds is not None:
            lo, hi = self.bounds
            if check:
                bad = (t < lo - ROUNDING * max(1.0, abs(lo))) | (t > hi + ROUNDING * max(1.0, abs(hi)))
                if bad.any():
                    i, j = np.unravel_index(int(np.argmax(bad)), bad.shape)
                    raise ShapeError(f"loss {self.name!r}: target {t[i, j]:.9g} of batch item "
                                     f"{i} is not in [{lo:g}, {hi:g}]")
            t = np.clip(t, lo, hi)
        return x, t

    def forward(self, inputs, value, valid):
        x, t = self._pair(inputs, valid, check=True)
        per_item = self.elementwise(x, t).sum(axis=1)
        value[...] = 0.0
        value[:valid, 0] = per_item
        total = distributed.allreduce_sum(np.array([per_item.sum(), valid], np.float64))
        self.scale = 1.0 / max(1.0, total[1])
        self.loss = float(total[0] * self.scale)

    def backward(self, inputs, grad_inputs, value, grad, valid):
        x, t = self._pair(inputs, valid)
        dx, dt = self.derivatives(x, t)
        per_item = self.scale + grad[:valid].astype(np.float64)   # d (loss + readers) / d value
        for k, d in ((0, dx), (1, dt if self.to_target else None)):
            if d is not None:
                g = grad_inputs[k].reshape(grad_inputs[k].shape[0], -1)
                g[:valid] += (d * per_item).astype(np.float32)

    def elementwise(self, x: np.ndarray, t: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def derivatives(self, x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


class EuclideanLoss(_TargetLoss):
    """``sum((input - target)**2) / (2 * batch)`` (Caffe's EuclideanLoss)."""

    def elementwise(self, x, t):
        return 0.5 * (x - t) ** 2

    def derivatives(self, x, t):
        return x - t, t - x


class SigmoidCrossEntropyLoss(_TargetLoss):
    """The binary cross-entropy of ``sigmoid(input)`` against targets in [0, 1], summed over
    the elements and divided by the batch; computed from the logits as
    ``max(x, 0) - x*t + log(1 + exp(-|x|))``, finite for any ``x``."""

    bounds = (0.0, 1.0)

    def elementwise(self, x, t):
        return np.maximum(x, 0.0) - x * t + np.log1p(np.exp(-np.abs(x)))

    def derivatives(self, x, t):
        sigmoid = np.exp(-np.logaddexp(0.0, -x))
        return sigmoid - t, -x


def EuclideanLossLayer(name: str, net, input_ens, target) -> EuclideanLoss:
    return EuclideanLoss(name, net, input_ens, target)


def SigmoidCrossEntropyLossLayer(name: str, net, input_ens, target) -> SigmoidCrossEntropyLoss:
    return SigmoidCrossEntropyLoss(name, net, input_ens, target)


def SoftmaxLossLayer(name: str, net, input_ens, label) -> SoftmaxLoss:
    return SoftmaxLoss(name, net, input_ens, label)


def AccuracyLayer(name: str, net, input_ens, label) -> Accuracy:
    return Accuracy(name, net, input_ens, label)
