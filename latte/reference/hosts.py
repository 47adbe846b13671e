"""Float32 rounding bounds through host steps (normalization ensembles: losses, batch
statistics) for a bounded reference (:mod:`latte.reference.rounding`).

A host step runs the same numpy code in compiled nets as in the reference, in float64 on
float32 inputs, and stores its outputs in float32: it differs from the reference only by
its inputs' rounding, which it carries through, and the rounding of what it stores. A
:class:`Rule` bounds both for one class, as a radius (how far an output may be off either
way) from the radii of its inputs (and, backward, of its own gradient); :func:`register`
adds one (a test's loss, a user's host step). A bounded reference refuses a host step
without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from latte.errors import LatteError
from latte.lang import Phase
from latte.reference.rounding import U
from latte.stdlib.batchnorm import BatchInvStd, BatchMean
from latte.stdlib.losses import Accuracy, EuclideanLoss, SigmoidCrossEntropyLoss, SoftmaxLoss


@dataclass(frozen=True)
class Rule:
    """``forward(norm, inputs, radii, value, valid)``: the bound of the ``value`` its forward
    wrote; ``backward(norm, inputs, radii, grad, grad_radius, valid)``: per input, the bound
    of what its backward added into that input's gradient (None: nothing). Arrays are
    ``(items, *shape)`` as the host step sees them; the first ``valid`` items are real."""

    forward: Callable
    backward: Callable


RULES: dict[type, Rule] = {}


def register(cls: type, forward: Callable, backward: Callable) -> None:
    """Bound the host steps of class ``cls`` (and its subclasses) by these functions."""
    RULES[cls] = Rule(forward, backward)


def _rule(norm) -> Rule:
    for cls in type(norm).__mro__:
        if cls in RULES:
            return RULES[cls]
    raise LatteError(f"host step {norm.name!r} ({type(norm).__name__}): no rule bounds its "
                     "float32 rounding; add one with latte.reference.hosts.register")


def forward_radius(norm, inputs: list, radii: list, value: np.ndarray, valid: int) -> np.ndarray:
    """How far the value ``norm``'s forward wrote may be off, either way."""
    return _rule(norm).forward(norm, inputs, radii, value, valid)


def backward_radii(norm, inputs: list, radii: list, grad: np.ndarray, grad_radius: np.ndarray,
                   valid: int) -> list:
    """Per input, how far what ``norm``'s backward added into its gradient may be off."""
    return _rule(norm).backward(norm, inputs, radii, grad, grad_radius, valid)


def _flat(x: np.ndarray, valid: int) -> np.ndarray:
    return x.reshape(x.shape[0], -1)[:valid]


def _rows(flat: np.ndarray, like: np.ndarray, valid: int) -> np.ndarray:
    """``flat`` (the valid items' rows) as an array shaped ``like``, zero past them."""
    out = np.zeros(like.shape)
    out.reshape(like.shape[0], -1)[:valid] = flat
    return out


def _stored(r: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``r`` plus the rounding of storing ``out`` in float32."""
    return r + U * np.abs(out)


# ---------------------------------------------------------------- softmax cross-entropy
def _softmax_forward(norm, inputs, radii, value, valid):
    """``lse(x) - x[label]``: lse moves by at most the largest move of x."""
    r, idx = _flat(radii[0], valid), _flat(inputs[1], valid)[:, 0].astype(np.int64)
    nll = r.max(axis=1) + r[np.arange(valid), idx]
    return _stored(_rows(nll[:, None], value, valid), value)


def _softmax_backward(norm, inputs, radii, grad, grad_radius, valid):
    """``scale * (p - onehot)``: ``p_i`` moves by at most ``exp(r_i + L) - 1`` of itself,
    ``L = log sum_j p_j exp(r_j)`` (x_i - lse(x) moves by at most ``r_i + L``)."""
    r, p = _flat(radii[0], valid), norm.prob
    with np.errstate(all="ignore"):
        moved = np.log1p(np.sum(p * np.expm1(r), axis=1, keepdims=True))
        rp = np.nan_to_num(p * np.expm1(r + moved), nan=np.inf)
    g = p.copy()
    g[np.arange(valid), _flat(inputs[1], valid)[:, 0].astype(np.int64)] -= 1.0
    return [_rows(_stored(norm.scale * rp, norm.scale * g), inputs[0], valid), None]


register(SoftmaxLoss, _softmax_forward, _softmax_backward)
register(Accuracy, lambda norm, inputs, radii, value, valid: np.zeros(value.shape),
         lambda *args: [None, None])


# ---------------------------------------------------------------- losses against a target
def _target(norm, inputs, radii, valid):
    (x, t), (rx, rt) = [_flat(a, valid) for a in inputs], [_flat(r, valid) for r in radii]
    return x, t, rx, rt


def _euclid_forward(norm, inputs, radii, value, valid):
    """``sum 0.5 (x - t)^2``, exactly over the intervals."""
    x, t, rx, rt = _target(norm, inputs, radii, valid)
    r = rx + rt
    return _stored(_rows(np.sum(np.abs(x - t) * r + 0.5 * r * r, axis=1)[:, None], value,
                         valid), value)


def _sigmoid_xent_forward(norm, inputs, radii, value, valid):
    """``sum max(x, 0) - x t + log(1 + exp(-|x|))``: slopes ``sigmoid(x) - t`` and ``-x``,
    curvature at most 1/4 in x and 1 across x and t."""
    x, t, rx, rt = _target(norm, inputs, radii, valid)
    slope = np.abs(np.exp(-np.logaddexp(0.0, -x)) - t)
    r = slope * rx + np.abs(x) * rt + rx * rt + 0.125 * rx * rx
    return _stored(_rows(r.sum(axis=1)[:, None], value, valid), value)


def _target_backward(derivative_radii: Callable) -> Callable:
    """A target loss's backward: ``d * (scale + grad)`` per input, ``d`` its derivative,
    whose bound ``derivative_radii(x, t, rx, rt)`` gives (for input and target)."""

    def backward(norm, inputs, radii, grad, grad_radius, valid):
        x, t, rx, rt = _target(norm, inputs, radii, valid)
        per_item = norm.scale + _flat(grad, valid)
        r_item = _flat(grad_radius, valid)
        out = []
        for k, (d, rd) in enumerate(zip(norm.derivatives(x, t), derivative_radii(x, t, rx, rt))):
            if k == 1 and not norm.to_target:
                out.append(None)
                continue
            r = np.abs(per_item) * rd + np.abs(d) * r_item + rd * r_item
            out.append(_rows(_stored(r, d * per_item), inputs[k], valid))
        return out

    return backward


register(EuclideanLoss, _euclid_forward,
         _target_backward(lambda x, t, rx, rt: (rx + rt, rx + rt)))
register(SigmoidCrossEntropyLoss, _sigmoid_xent_forward,
         _target_backward(lambda x, t, rx, rt: (0.25 * rx + rt, rx)))


# ---------------------------------------------------------------- batch statistics
def _mean_forward(norm, inputs, radii, value, valid):
    """The mean of the items' partial means, in every row (the running mean: exact)."""
    if norm.phase is Phase.TEST:
        return _stored(np.zeros(value.shape), value)
    return _stored(np.broadcast_to(radii[0][:valid].mean(axis=0), value.shape), value)


def _mean_backward(norm, inputs, radii, grad, grad_radius, valid):
    """The sum of the rows' gradients over the items, in each valid row."""
    r = np.zeros(inputs[0].shape)
    r[:valid] = _stored(grad_radius[:valid].sum(axis=0) / valid,
                        grad[:valid].sum(axis=0) / valid)
    return [r]


def _inv_std_moved(norm, inputs, radii, valid) -> np.ndarray:
    """How far ``1 / sqrt(var + eps)`` may move with the variance's bound (var: the mean
    of the items' partial variances; largest at the interval's low end)."""
    var = inputs[0][:valid].mean(axis=0)
    low = var + norm.eps - radii[0][:valid].mean(axis=0)
    with np.errstate(divide="ignore"):
        return np.where(low > 0, 1.0 / np.sqrt(np.maximum(low, 1e-300)) - norm.inv_std, np.inf)


def _inv_std_forward(norm, inputs, radii, value, valid):
    if norm.phase is Phase.TEST:
        return _stored(np.zeros(value.shape), value)
    return _stored(np.broadcast_to(_inv_std_moved(norm, inputs, radii, valid), value.shape), value)


def _inv_std_backward(norm, inputs, radii, grad, grad_radius, valid):
    """``sum(grad) * (-inv_std**3 / 2) / valid``, in each valid row."""
    inv, moved = norm.inv_std, _inv_std_moved(norm, inputs, radii, valid)
    total = grad[:valid].sum(axis=0)
    r = (grad_radius[:valid].sum(axis=0) * inv ** 3
         + np.abs(total) * ((inv + moved) ** 3 - inv ** 3)) / (2 * valid)
    out = np.zeros(inputs[0].shape)
    out[:valid] = _stored(r, total * -0.5 * inv ** 3 / valid)
    return [out]


register(BatchMean, _mean_forward, _mean_backward)
register(BatchInvStd, _inv_std_forward, _inv_std_backward)
