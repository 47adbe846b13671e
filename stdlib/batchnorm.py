"""Batch normalization (Ioffe & Szegedy), PyTorch's ``BatchNorm1d/2d``, built from five ensembles.

For an input ``x`` of shape ``(C, *S)`` (``S``: none, ``(L,)`` or ``(H, W)``) and a batch
of ``N`` valid items, ``BatchNormLayer("bn", ...)`` adds, in this order:

- ``bn_part_mean`` (C,), compiled: per item, the mean of channel ``c`` over ``S``;
- ``bn_mean`` (C,), a host step: ``mu[c]``, the mean of the valid items' partial means,
  written into every item's row (its backward is the transpose: a sum over items / N);
- ``bn_part_var`` (C,), compiled: per item, the mean of ``(x - mu[c])**2`` over ``S``
  (two passes, so float32 does not cancel ``E[x^2] - E[x]^2``);
- ``bn_inv_std`` (C,), a host step: ``1 / sqrt(var[c] + eps)`` from the valid items;
- ``bn`` (the input's shape), compiled: ``scale[c] * (x - mu[c]) * inv_std[c] + shift[c]``.

Back-propagation through the whole graph is then the exact batch-norm gradient. The host
steps only touch ``(batch, C)`` arrays; everything of the input's size is compiled code.

In training the host steps update ``net.state["bn.running_mean"]`` and
``net.state["bn.running_var"]`` as PyTorch does (``momentum``; the running variance is
the unbiased one); in ``Phase.TEST`` they output the running statistics instead. Under
MPI the statistics are each rank's own (as PyTorch without ``SyncBatchNorm``), and so are
the running statistics; ``net.save`` writes the saving rank's.
"""

from __future__ import annotations

import numpy as np

from latte.errors import ShapeError
from latte.lang import Ensemble, Field, Neuron, NormalizationEnsemble, Param, Phase, add_connections
from latte.stdlib.init import shared_scalar
from latte.stdlib.pooling import MeanNeuron


class SquaredDeviationNeuron(Neuron):
    """``scale * sum((inputs[0][i] - inputs[1][0])**2)``: the mean squared deviation of a
    window from a given mean (``scale``: one over the window size)."""

    scale: Field

    def forward(self):
        for i in range(len(self.inputs[0])):
            d = self.inputs[0][i] - self.inputs[1][0]
            self.value += d * d
        self.value = self.value * self.scale

    def backward(self):
        for i in range(len(self.inputs[0])):
            self.grad_inputs[0][i] += 2.0 * self.grad * self.scale * (self.inputs[0][i] - self.inputs[1][0])
        for i in range(len(self.inputs[0])):
            self.grad_inputs[1][0] -= 2.0 * self.grad * self.scale * (self.inputs[0][i] - self.inputs[1][0])


class BatchNormNeuron(Neuron):
    """``scale * (x - mean) * inv_std + shift``; ``inputs``: ``x``, ``mean``, ``inv_std``."""

    scale: Param
    shift: Param

    def forward(self):
        self.value = self.scale * (self.inputs[0][0] - self.inputs[1][0]) * self.inputs[2][0] + self.shift

    def backward(self):
        g = self.grad * self.scale
        self.grad_inputs[0][0] += g * self.inputs[2][0]
        self.grad_inputs[1][0] -= g * self.inputs[2][0]
        self.grad_inputs[2][0] += g * (self.inputs[0][0] - self.inputs[1][0])
        self.grad_scale[0] += self.grad * (self.inputs[0][0] - self.inputs[1][0]) * self.inputs[2][0]
        self.grad_shift[0] += self.grad


class _BatchStatistic(NormalizationEnsemble):
    """A per-channel statistic over the valid batch items of a ``(batch, C)`` input,
    broadcast to every item's row; in ``Phase.TEST`` the running statistic's value instead.
    The running statistic is ``net.state[key]``; the reference interpreter's copies get
    their own (``copy.copy``), so running it leaves the net's untouched."""

    def __init__(self, net, name: str, part, key: str, init: float, momentum: float):
        super().__init__(net, name, [part], part.shape)
        self.key, self.momentum = key, momentum
        self.state[key] = np.full(part.shape, init, np.float32)

    def __copy__(self):
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.state = {k: v.copy() for k, v in self.state.items()}
        return twin

    def reads_inputs(self, phase: Phase) -> bool:
        return phase is not Phase.TEST

    def _update(self, batch_stat: np.ndarray) -> None:
        running = self.state[self.key]
        running[...] = (1.0 - self.momentum) * running + self.momentum * batch_stat


class BatchMean(_BatchStatistic):
    """``mu[c]``: the mean of the items' partial means (each over the same count)."""

    def forward(self, inputs, value, valid):
        if self.phase is Phase.TEST:
            value[...] = self.state[self.key]
            return
        mu = inputs[0][:valid].astype(np.float64).mean(axis=0)
        self._update(mu)
        value[...] = mu

    def backward(self, inputs, grad_inputs, value, grad, valid):
        grad_inputs[0][:valid] += (grad[:valid].astype(np.float64).sum(axis=0) / valid).astype(np.float32)


class BatchInvStd(_BatchStatistic):
    """``1 / sqrt(var[c] + eps)`` from the items' partial variances; the running variance
    is updated with the unbiased variance (``count / (count - 1)``, ``count`` the valid
    items times the values per channel of one item)."""

    def __init__(self, net, name: str, part, key: str, momentum: float, eps: float, per_item: int):
        super().__init__(net, name, part, key, 1.0, momentum)
        self.eps, self.per_item = eps, per_item
        self.inv_std = np.ones(part.shape)

    def forward(self, inputs, value, valid):
        if self.phase is Phase.TEST:
            value[...] = 1.0 / np.sqrt(self.state[self.key].astype(np.float64) + self.eps)
            return
        count = valid * self.per_item
        if count < 2:
            raise ShapeError(f"batch norm {self.key.rsplit('.', 1)[0]!r}: training needs more "
                             f"than one value per channel, got {count} (batch of {valid} "
                             f"item(s) of {self.per_item})")
        var = inputs[0][:valid].astype(np.float64).mean(axis=0)
        self._update(var * count / (count - 1))
        self.inv_std = 1.0 / np.sqrt(var + self.eps)
        value[...] = self.inv_std

    def backward(self, inputs, grad_inputs, value, grad, valid):
        # d inv_std / d var = -inv_std**3 / 2; var is the mean of the valid items' parts
        dvar = grad[:valid].astype(np.float64).sum(axis=0) * (-0.5 * self.inv_std ** 3)
        grad_inputs[0][:valid] += (dvar / valid).astype(np.float32)


def BatchNormLayer(name: str, net, input_ens, *, eps: float = 1e-5, momentum: float = 0.1) -> Ensemble:
    """Normalize each channel (the first sample dimension) of ``input_ens`` over the batch
    and the other dimensions, then ``scale * x_hat + shift``: PyTorch's ``BatchNorm1d``
    (``(C,)`` or ``(C, L)`` inputs) and ``BatchNorm2d`` (``(C, H, W)``).

    Parameters ``"{name}.scale"`` (ones) and ``"{name}.shift"`` (zeros), ``(C, 1)``;
    running statistics ``net.state["{name}.running_mean"]`` (zeros) and
    ``["{name}.running_var"]`` (ones), ``(C,)``, updated by each training forward as
    ``(1 - momentum) * running + momentum * batch`` and used in ``Phase.TEST``. Only the
    valid items of a partial batch count. Under MPI each rank normalizes with its own
    batch's statistics. Returns the output ensemble, named ``name``.
    """
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"batch norm {name!r}: momentum must be in [0, 1], got {momentum}")
    if not eps > 0.0:
        raise ValueError(f"batch norm {name!r}: eps must be positive, got {eps}")
    channels, rest = input_ens.shape[0], input_ens.shape[1:]
    per_item = int(np.prod(rest, dtype=np.int64))
    inv = {"scale": shared_scalar(1.0 / per_item)}

    def window(c):   # channel c of one item, whole
        return (c, *(range(d) for d in rest))

    def per_channel(c, *_):
        return c

    def channel(c, *_):
        return (c,)

    part_mean = Ensemble(net, f"{name}_part_mean", MeanNeuron, (channels,), **inv)
    add_connections(net, input_ens, part_mean, window)
    mean = BatchMean(net, f"{name}_mean", part_mean, f"{name}.running_mean", 0.0, momentum)
    part_var = Ensemble(net, f"{name}_part_var", SquaredDeviationNeuron, (channels,), **inv)
    add_connections(net, input_ens, part_var, window)
    add_connections(net, mean, part_var, channel)
    inv_std = BatchInvStd(net, f"{name}_inv_std", part_var, f"{name}.running_var", momentum, eps,
                          per_item)

    out = Ensemble(net, name, BatchNormNeuron, input_ens.shape,
                   scale=(np.ones((channels, 1), np.float32), per_channel),
                   shift=(np.zeros((channels, 1), np.float32), per_channel))
    add_connections(net, input_ens, out, lambda *i: i)
    add_connections(net, mean, out, channel)
    add_connections(net, inv_std, out, channel)
    return out
