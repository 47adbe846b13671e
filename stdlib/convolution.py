"""2-D convolution: WeightedNeurons that share one filter per output channel (paper figure 5).

A convolution is the fully connected neuron with a different mapping: output neuron
``(o, y, x)`` reads a ``C/groups x kh x kw`` window of the input (rows and columns
``dilation`` apart), and the filter of channel ``o`` is shared along ``y`` and ``x`` by an
index map. With ``groups = g`` output channel ``o`` reads the input channels of its group
``o // (n_filters/g)``: a floor division the mapping analysis fits as quasi-affine, and
synthesis strip-mines ``o`` into (group, filter in group) so that each group is one GEMM.
"""

from __future__ import annotations

import numpy as np

from latte.errors import ShapeError
from latte.lang import Ensemble, Neuron, Param, add_connections
from latte.stdlib.fully_connected import WeightedNeuron
from latte.stdlib.init import xavier


class UnbiasedNeuron(Neuron):
    """``value = weights . inputs[0]`` (a layer with ``bias=False``: no bias parameter)."""

    weights: Param

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.weights[i] * self.inputs[0][i]

    def backward(self):
        for i in range(len(self.inputs[0])):
            self.grad_inputs[0][i] += self.weights[i] * self.grad
        for i in range(len(self.inputs[0])):
            self.grad_weights[i] += self.inputs[0][i] * self.grad


def pair(value, what: str, low: int) -> tuple[int, int]:
    """``value`` as a ``(height, width)`` pair of ints ``>= low`` (an int applies to both)."""
    try:
        out = (int(value), int(value)) if np.ndim(value) == 0 else tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ShapeError(f"{what} must be an int or a pair of ints, got {value!r}") from None
    if len(out) != 2 or any(v < low for v in out):
        raise ShapeError(f"{what} must be an int or a pair of ints >= {low}, got {value!r}")
    return out


def output_size(name: str, input_ens, kernel, stride, pad, dilation=(1, 1)) -> tuple[int, int]:
    """Output height and width by the floor rule ``(in + 2*pad - span) // stride + 1``, where a
    kernel ``k`` with dilation ``d`` spans ``d*(k-1)+1``."""
    if len(input_ens.shape) != 3:
        raise ShapeError(f"layer {name!r}: input {input_ens.name!r} must be (channels, height, "
                         f"width), got shape {input_ens.shape}")
    span = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation))
    out = tuple((n + 2 * p - k) // s + 1
                for n, k, s, p in zip(input_ens.shape[1:], span, stride, pad))
    if min(out) < 1:
        raise ShapeError(f"layer {name!r}: a {span[0]}x{span[1]} window with pad {pad} does "
                         f"not fit the {input_ens.shape[1]}x{input_ens.shape[2]} input "
                         f"{input_ens.name!r}")
    return out


def ConvolutionLayer(name: str, net, input_ens, n_filters: int, kernel, stride=1, pad=0, *,
                     dilation=1, groups: int = 1, bias: bool = True) -> Ensemble:
    """``n_filters`` filters of size ``kernel`` (an int or ``(kh, kw)``) over a ``(C, H, W)``
    input; the output is ``(n_filters, out_h, out_w)``.

    ``stride``, ``pad`` and ``dilation`` are ints or ``(y, x)`` pairs; padding reads as zero.
    With ``groups = g`` (dividing both ``C`` and ``n_filters``) filter ``o`` sees the ``C/g``
    channels of group ``o // (n_filters/g)``. Weights are ``(n_filters, C/g*kh*kw)``
    (Xavier; PyTorch's ``(n_filters, C/g, kh, kw)`` flattened), biases ``(n_filters, 1)``
    zeros; ``bias=False`` gives no bias parameter at all.
    """
    (kh, kw), (sy, sx), (py, px), (dy, dx) = (
        pair(kernel, "kernel", 1), pair(stride, "stride", 1), pair(pad, "pad", 0),
        pair(dilation, "dilation", 1))
    out_h, out_w = output_size(name, input_ens, (kh, kw), (sy, sx), (py, px), (dy, dx))
    channels, n_filters, groups = input_ens.shape[0], int(n_filters), int(groups)
    if groups < 1 or channels % groups or n_filters % groups:
        raise ShapeError(f"layer {name!r}: groups={groups} must divide both the input's "
                         f"{channels} channels ({input_ens.name!r}) and the {n_filters} filters")
    cpg, opg = channels // groups, n_filters // groups   # channels, filters per group
    fan_in = cpg * kh * kw
    fields = {"weights": (xavier((n_filters, fan_in), fan_in=fan_in), lambda o, y, x: o)}
    if bias:
        fields["bias"] = (np.zeros((n_filters, 1), np.float32), lambda o, y, x: o)
    conv = Ensemble(net, name, WeightedNeuron if bias else UnbiasedNeuron,
                    (n_filters, out_h, out_w), **fields)
    add_connections(net, input_ens, conv, lambda o, y, x: (
        range(o // opg * cpg, o // opg * cpg + cpg),
        range(sy * y - py, sy * y - py + dy * (kh - 1) + 1, dy),
        range(sx * x - px, sx * x - px + dx * (kw - 1) + 1, dx)),
        padding=0.0 if py or px else None)
    return conv
