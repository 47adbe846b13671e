"""Fully connected layer: WeightedNeurons reading every source neuron (paper figures 3-4)."""

from __future__ import annotations

import numpy as np

from latte.lang import Ensemble, Neuron, Param, add_connections
from latte.stdlib.init import xavier


class WeightedNeuron(Neuron):
    """``value = weights . inputs[0] + bias``."""

    weights: Param
    bias: Param(lr_mult=2.0, decay_mult=0.0)

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.weights[i] * self.inputs[0][i]
        self.value += self.bias[0]

    def backward(self):
        for i in range(len(self.inputs[0])):
            self.grad_inputs[0][i] += self.weights[i] * self.grad
        for i in range(len(self.inputs[0])):
            self.grad_weights[i] += self.inputs[0][i] * self.grad
        self.grad_bias[0] += self.grad


def FullyConnectedLayer(name: str, net, input_ens, n_outputs: int) -> Ensemble:
    """``n_outputs`` WeightedNeurons, each connected to all of ``input_ens``.

    Weights are ``(n_outputs, input_ens.size)`` (Xavier), biases ``(n_outputs, 1)`` zeros.
    """
    n_in = input_ens.size
    weights = xavier((n_outputs, n_in), fan_in=n_in)
    bias = np.zeros((n_outputs, 1), np.float32)
    fc = Ensemble(net, name, WeightedNeuron, (n_outputs,),
                  weights=(weights, lambda o: o), bias=(bias, lambda o: o))
    add_connections(net, input_ens, fc, lambda o: tuple(range(d) for d in input_ens.shape))
    return fc
