"""Element-wise activations, applied in place (ActivationEnsemble, paper section 3.2).

``backward`` turns the gradient w.r.t. the activation's output into the gradient w.r.t.
its input, in the shared gradient buffer.
"""

from __future__ import annotations

import math

from latte.lang import ActivationEnsemble, Neuron


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


def ReLULayer(name: str, net, input_ens) -> ActivationEnsemble:
    """``max(x, 0)`` in place over ``input_ens``."""
    return ActivationEnsemble(net, name, ReLUNeuron, input_ens)


def TanhLayer(name: str, net, input_ens) -> ActivationEnsemble:
    """``tanh(x)`` in place over ``input_ens``."""
    return ActivationEnsemble(net, name, TanhNeuron, input_ens)


def SigmoidLayer(name: str, net, input_ens) -> ActivationEnsemble:
    """``1 / (1 + exp(-x))`` in place over ``input_ens``."""
    return ActivationEnsemble(net, name, SigmoidNeuron, input_ens)
