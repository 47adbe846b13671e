"""Element-wise activations, applied in place (ActivationEnsemble, paper section 3.2).

``backward`` turns the gradient w.r.t. the activation's output into the gradient w.r.t.
its input, in the shared gradient buffer, from the output value alone. PReLU is the
exception: its slope's gradient needs the input, so it is an ensemble of its own.
"""

from __future__ import annotations

import math

import numpy as np

from latte.lang import ActivationEnsemble, Ensemble, Field, Neuron, Param, add_connections
from latte.stdlib.init import shared_scalar


class ReLUNeuron(Neuron):
    def forward(self):
        self.value = max(self.value, 0.0)

    def backward(self):
        if self.value <= 0.0:
            self.grad = 0.0


class TanhNeuron(Neuron):
    def forward(self):
        self.value = math.tanh(self.value)

    def backward(self):
        self.grad = self.grad * (1.0 - self.value * self.value)


class SigmoidNeuron(Neuron):
    def forward(self):
        self.value = 1.0 / (1.0 + math.exp(-self.value))

    def backward(self):
        self.grad = self.grad * self.value * (1.0 - self.value)


class LeakyReLUNeuron(Neuron):
    """``x`` where positive, else ``slope * x``; backward reads the sign of the output, which
    is the input's for ``slope >= 0``."""

    slope: Field

    def forward(self):
        if self.value <= 0.0:
            self.value = self.value * self.slope

    def backward(self):
        if self.value <= 0.0:
            self.grad = self.grad * self.slope


class ELUNeuron(Neuron):
    """``x`` where positive, else ``alpha * (exp(x) - 1)``; for ``x <= 0`` the derivative
    ``alpha * exp(x)`` is ``value + alpha``, so backward needs the output alone."""

    alpha: Field

    def forward(self):
        if self.value <= 0.0:
            self.value = self.alpha * (math.exp(self.value) - 1.0)

    def backward(self):
        if self.value <= 0.0:
            self.grad = self.grad * (self.value + self.alpha)


class PReLUNeuron(Neuron):
    """Leaky ReLU with a learned slope (one per channel, shared through the index map)."""

    slope: Param

    def forward(self):
        x = self.inputs[0][0]
        self.value = x if x > 0.0 else self.slope * x

    def backward(self):
        x = self.inputs[0][0]
        if x > 0.0:
            self.grad_inputs[0][0] += self.grad
        else:
            self.grad_inputs[0][0] += self.grad * self.slope
            self.grad_slope += self.grad * x


def ReLULayer(name: str, net, input_ens) -> ActivationEnsemble:
    """``max(x, 0)`` in place over ``input_ens``."""
    return ActivationEnsemble(net, name, ReLUNeuron, input_ens)


def TanhLayer(name: str, net, input_ens) -> ActivationEnsemble:
    """``tanh(x)`` in place over ``input_ens``."""
    return ActivationEnsemble(net, name, TanhNeuron, input_ens)


def SigmoidLayer(name: str, net, input_ens) -> ActivationEnsemble:
    """``1 / (1 + exp(-x))`` in place over ``input_ens``."""
    return ActivationEnsemble(net, name, SigmoidNeuron, input_ens)


def LeakyReLULayer(name: str, net, input_ens, slope: float = 0.01) -> ActivationEnsemble:
    """``x if x > 0 else slope * x`` in place over ``input_ens``; ``slope >= 0`` (in place,
    backward recovers the input's sign from the output, as PyTorch's in-place LeakyReLU)."""
    if not slope >= 0.0:
        raise ValueError(f"layer {name!r}: an in-place leaky ReLU needs slope >= 0, got {slope}")
    return ActivationEnsemble(net, name, LeakyReLUNeuron, input_ens, slope=shared_scalar(slope))


def ELULayer(name: str, net, input_ens, alpha: float = 1.0) -> ActivationEnsemble:
    """``x if x > 0 else alpha * (exp(x) - 1)`` in place over ``input_ens``; ``alpha >= 0``."""
    if not alpha >= 0.0:
        raise ValueError(f"layer {name!r}: an in-place ELU needs alpha >= 0, got {alpha}")
    return ActivationEnsemble(net, name, ELUNeuron, input_ens, alpha=shared_scalar(alpha))


def PReLULayer(name: str, net, input_ens) -> Ensemble:
    """``x if x > 0 else a[c] * x`` with a learnable slope per channel ``c`` (the first sample
    dimension), parameter ``"{name}.slope"`` of shape ``(C,)`` starting at 0.25, as PyTorch's
    ``PReLU(C)``. Not in place: the slope's gradient reads the input."""
    slope = np.full(input_ens.shape[0], 0.25, np.float32)
    prelu = Ensemble(net, name, PReLUNeuron, input_ens.shape, slope=(slope, lambda c, *rest: c))
    add_connections(net, input_ens, prelu, lambda *index: index)
    return prelu
