"""Max, mean and global average pooling: each output neuron reads a window of one input
channel.

Channel ``c`` of the output reads channel ``c`` of the input only (the mapping's first entry
is an int, not a range), windows of ``kh x kw`` at a stride, and padding outside the input.
"""

from __future__ import annotations

import numpy as np

from latte.errors import ShapeError
from latte.lang import Batch, Ensemble, Field, Neuron, add_connections
from latte.stdlib.convolution import output_size, pair
from latte.stdlib.init import shared_scalar

# what max pooling reads outside the input: below every finite float32, so never the max
MAX_PADDING = float(np.finfo(np.float32).min)


class MaxNeuron(Neuron):
    """The maximum of the window; the arg-max (first one on ties) is kept per batch item, and
    backward routes the gradient to it alone."""

    argmax: Batch

    def forward(self):
        best = self.inputs[0][0]
        arg = 0
        for i in range(len(self.inputs[0])):
            if self.inputs[0][i] > best:
                best = self.inputs[0][i]
                arg = i
        self.value = best
        self.argmax = arg

    def backward(self):
        for i in range(len(self.inputs[0])):   # branch-free: vectorizes, and a first
            self.grad_inputs[0][i] += self.grad * (i == self.argmax)   # writer may store


class MeanNeuron(Neuron):
    """The window's sum times ``scale`` (one over the window size, padding included)."""

    scale: Field

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.inputs[0][i]
        self.value = self.value * self.scale

    def backward(self):
        for i in range(len(self.inputs[0])):
            self.grad_inputs[0][i] += self.grad * self.scale


def _pool(name: str, net, input_ens, kernel, stride, pad, neuron: type, padding: float,
          fields) -> Ensemble:
    kh, kw = pair(kernel, "kernel", 1)
    sy, sx = pair(kernel if stride is None else stride, "stride", 1)
    py, px = pair(pad, "pad", 0)
    if py >= kh or px >= kw:   # else a window could lie wholly in the padding
        raise ShapeError(f"layer {name!r}: pad {pad} must be smaller than the kernel {kernel}")
    out_h, out_w = output_size(name, input_ens, (kh, kw), (sy, sx), (py, px))
    shape = (input_ens.shape[0], out_h, out_w)
    pool = Ensemble(net, name, neuron, shape, **fields(shape, kh * kw))
    add_connections(net, input_ens, pool, lambda c, y, x: (
        c, range(sy * y - py, sy * y - py + kh), range(sx * x - px, sx * x - px + kw)),
        padding=padding if py or px else None)
    return pool


def MaxPoolingLayer(name: str, net, input_ens, kernel, stride=None, pad=0) -> Ensemble:
    """Maximum over ``kernel`` windows (int or ``(kh, kw)``) of each channel of a ``(C, H, W)``
    input; ``stride`` defaults to the kernel. Padding never wins the max."""
    return _pool(name, net, input_ens, kernel, stride, pad, MaxNeuron, MAX_PADDING,
                 lambda shape, n: {"argmax": np.zeros(shape, np.float32)})


def MeanPoolingLayer(name: str, net, input_ens, kernel, stride=None, pad=0, *,
                     count_include_pad: bool = True) -> Ensemble:
    """Mean over ``kernel`` windows of each channel of a ``(C, H, W)`` input; ``stride``
    defaults to the kernel. Padding reads as zero and counts in the divisor ``kh*kw``;
    with ``count_include_pad=False`` the divisor is the number of input values in the
    window (PyTorch's ``AvgPool2d`` option of that name)."""
    if count_include_pad:
        return _pool(name, net, input_ens, kernel, stride, pad, MeanNeuron, 0.0,
                     lambda shape, n: {"scale": shared_scalar(1.0 / n)})
    (kh, kw), (py, px) = pair(kernel, "kernel", 1), pair(pad, "pad", 0)
    sy, sx = pair(kernel if stride is None else stride, "stride", 1)

    def inside(n: int, out: int, k: int, s: int, p: int) -> np.ndarray:   # per output row/col
        lo = np.arange(out) * s - p
        return np.minimum(lo + k, n) - np.maximum(lo, 0)

    def counts(shape, n):
        rows = inside(input_ens.shape[1], shape[1], kh, sy, py)
        cols = inside(input_ens.shape[2], shape[2], kw, sx, px)
        return {"scale": (1.0 / np.outer(rows, cols), lambda c, y, x: (y, x))}
    return _pool(name, net, input_ens, kernel, stride, pad, MeanNeuron, 0.0, counts)


def GlobalAveragePoolingLayer(name: str, net, input_ens) -> Ensemble:
    """The mean of each channel of a ``(C, H, W)`` input: output ``(C,)``."""
    if len(input_ens.shape) != 3:
        raise ShapeError(f"layer {name!r}: global average pooling needs a (C, H, W) input, "
                         f"{input_ens.name!r} has shape {input_ens.shape}")
    c, h, w = input_ens.shape
    gap = Ensemble(net, name, MeanNeuron, (c,), scale=shared_scalar(1.0 / (h * w)))
    add_connections(net, input_ens, gap, lambda c: (c, range(h), range(w)))
    return gap
