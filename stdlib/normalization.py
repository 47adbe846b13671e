"""Normalizations across a sample: local response normalization (LRN) and softmax.

Both are neurons and mappings: LRN reads its own input one-to-one and a window of channels
over the same source; softmax is a log-sum-exp ensemble of one neuron per sample reading
the whole input, then an element-wise ``exp(x - lse)``.
"""

from __future__ import annotations

import math

import numpy as np

from latte.lang import Ensemble, Field, Neuron, add_connections
from latte.stdlib.init import shared_scalar


class LRNNeuron(Neuron):
    """``x / (k + scale * sum(window**2)) ** beta``, where ``scale`` is ``alpha / size``.

    ``inputs[0]`` is the neuron's own input, ``inputs[1]`` the channel window (zero padded).
    The power is ``exp(-beta * log(d))``: ``d >= k > 0``.
    """

    scale: Field
    beta: Field
    k: Field

    def forward(self):
        s = 0.0
        for i in range(len(self.inputs[1])):
            s += self.inputs[1][i] * self.inputs[1][i]
        d = self.k + self.scale * s
        self.value = self.inputs[0][0] * math.exp(-self.beta * math.log(d))

    def backward(self):
        # d value / d x_own = d**-beta; d value / d x_j = -2 beta scale value x_j / d
        s = 0.0
        for i in range(len(self.inputs[1])):
            s += self.inputs[1][i] * self.inputs[1][i]
        d = self.k + self.scale * s
        self.grad_inputs[0][0] += self.grad * math.exp(-self.beta * math.log(d))
        g = -2.0 * self.beta * self.scale * self.grad * self.value / d
        for i in range(len(self.inputs[1])):
            self.grad_inputs[1][i] += g * self.inputs[1][i]


class LogSumExpNeuron(Neuron):
    """``log(sum(exp(x)))`` over the whole input, with the maximum subtracted first."""

    def forward(self):
        m = self.inputs[0][0]
        for i in range(len(self.inputs[0])):
            m = max(m, self.inputs[0][i])
        s = 0.0
        for i in range(len(self.inputs[0])):
            s += math.exp(self.inputs[0][i] - m)
        self.value = m + math.log(s)

    def backward(self):
        # the gradient of log-sum-exp is the softmax, whichever maximum was subtracted
        for i in range(len(self.inputs[0])):
            self.grad_inputs[0][i] += self.grad * math.exp(self.inputs[0][i] - self.value)


class SoftmaxNeuron(Neuron):
    """``exp(x - lse)``: ``inputs[0]`` is ``x``, ``inputs[1]`` the sample's log-sum-exp."""

    def forward(self):
        self.value = math.exp(self.inputs[0][0] - self.inputs[1][0])

    def backward(self):
        self.grad_inputs[0][0] += self.grad * self.value
        self.grad_inputs[1][0] += -self.grad * self.value


def LRNLayer(name: str, net, input_ens, size: int = 5, alpha: float = 1e-4, beta: float = 0.75,
             k: float = 1.0) -> Ensemble:
    """Local response normalization across channels (the first sample dimension), PyTorch's
    ``LocalResponseNorm``: ``x_c / (k + alpha / size * sum(x_j**2)) ** beta`` over channels
    ``j`` from ``c - size // 2`` to ``c + (size - 1) // 2``, zero outside the input."""
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"layer {name!r}: size must be a positive int, got {size!r}")
    if not k > 0.0:
        raise ValueError(f"layer {name!r}: k must be positive, got {k}")
    lrn = Ensemble(net, name, LRNNeuron, input_ens.shape, scale=shared_scalar(alpha / size),
                   beta=shared_scalar(beta), k=shared_scalar(k))
    before = size // 2
    add_connections(net, input_ens, lrn, lambda *index: index)
    add_connections(net, input_ens, lrn,
                    lambda c, *rest: (range(c - before, c - before + size), *rest), padding=0.0)
    return lrn


def SoftmaxLayer(name: str, net, input_ens) -> Ensemble:
    """Probabilities over the whole sample: ``exp(x) / sum(exp(x))`` (for inference outputs;
    differentiable as well). Adds a ``"{name}.lse"`` ensemble of shape ``(1,)``."""
    lse = Ensemble(net, f"{name}.lse", LogSumExpNeuron, (1,))
    add_connections(net, input_ens, lse, lambda _: tuple(range(d) for d in input_ens.shape))
    soft = Ensemble(net, name, SoftmaxNeuron, input_ens.shape)
    add_connections(net, input_ens, soft, lambda *index: index)
    add_connections(net, lse, soft, lambda *index: (0,))
    return soft
