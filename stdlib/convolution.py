"""2-D convolution: WeightedNeurons that share one filter per output channel (paper figure 5).

A convolution is the fully connected neuron with a different mapping: output neuron
``(o, y, x)`` reads a ``channels x kh x kw`` window of the input, and the filter of channel
``o`` is shared along ``y`` and ``x`` by an index map.
"""

from __future__ import annotations

import numpy as np

from latte.errors import ShapeError
from latte.lang import Ensemble, add_connections
from latte.stdlib.fully_connected import WeightedNeuron
from latte.stdlib.init import xavier


def pair(value, what: str, low: int) -> tuple[int, int]:
    """``value`` as a ``(height, width)`` pair of ints ``>= low`` (an int applies to both)."""
    try:
        out = (int(value), int(value)) if np.ndim(value) == 0 else tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ShapeError(f"{what} must be an int or a pair of ints, got {value!r}") from None
    if len(out) != 2 or any(v < low for v in out):
        raise ShapeError(f"{what} must be an int or a pair of ints >= {low}, got {value!r}")
    return out


def output_size(name: str, input_ens, kernel, stride, pad) -> tuple[int, int]:
    """Output height and width by the floor rule ``(in + 2*pad - kernel) // stride + 1``."""
    if len(input_ens.shape) != 3:
        raise ShapeError(f"layer {name!r}: input {input_ens.name!r} must be (channels, height, "
                         f"width), got shape {input_ens.shape}")
    out = tuple((n + 2 * p - k) // s + 1
                for n, k, s, p in zip(input_ens.shape[1:], kernel, stride, pad))
    if min(out) < 1:
        raise ShapeError(f"layer {name!r}: a {kernel[0]}x{kernel[1]} window with pad {pad} does "
                         f"not fit the {input_ens.shape[1]}x{input_ens.shape[2]} input "
                         f"{input_ens.name!r}")
    return out


def ConvolutionLayer(name: str, net, input_ens, n_filters: int, kernel, stride=1,
                     pad=0) -> Ensemble:
    """``n_filters`` filters of size ``kernel`` (an int or ``(kh, kw)``) over a ``(C, H, W)``
    input; the output is ``(n_filters, out_h, out_w)``.

    ``stride`` and ``pad`` are ints or ``(y, x)`` pairs; padding reads as zero. Weights are
    ``(n_filters, C*kh*kw)`` (Xavier), biases ``(n_filters, 1)`` zeros.
    """
    (kh, kw), (sy, sx), (py, px) = (pair(kernel, "kernel", 1), pair(stride, "stride", 1),
                                    pair(pad, "pad", 0))
    out_h, out_w = output_size(name, input_ens, (kh, kw), (sy, sx), (py, px))
    channels = input_ens.shape[0]
    fan_in = channels * kh * kw
    weights = xavier((int(n_filters), fan_in), fan_in=fan_in)
    bias = np.zeros((int(n_filters), 1), np.float32)
    conv = Ensemble(net, name, WeightedNeuron, (int(n_filters), out_h, out_w),
                    weights=(weights, lambda o, y, x: o), bias=(bias, lambda o, y, x: o))
    add_connections(net, input_ens, conv, lambda o, y, x: (
        range(channels), range(sy * y - py, sy * y - py + kh), range(sx * x - px, sx * x - px + kw)),
        padding=0.0 if py or px else None)
    return conv
