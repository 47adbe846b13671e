"""Stdlib layers the random nets add on top of a case's generated ensembles.

Each entry of :data:`LAYERS` is a :class:`Layer`: ``fits(src)`` says whether it can read
``src``; ``build(rng, net, name, src, pool)`` adds it (``pool``: every ensemble of the case
so far, for layers with a second input) and returns the new ensemble. The generator draws
these from a stream of its own (see :func:`latte.fuzz.nets.build_case`), so adding an entry
here leaves every earlier case's generated layers as they were.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np

from latte import stdlib
from latte.lang import DataEnsemble, Ensemble, add_connections
from latte.stdlib import (
    AddLayer,
    ConcatLayer,
    ELULayer,
    EuclideanLossLayer,
    FullyConnectedLayer,
    GlobalAveragePoolingLayer,
    GRULayer,
    LeakyReLULayer,
    LRNLayer,
    LSTMLayer,
    MeanPoolingLayer,
    MulLayer,
    PReLULayer,
    ReLULayer,
    RNNLayer,
    SigmoidCrossEntropyLossLayer,
    SigmoidLayer,
    SoftmaxLayer,
    TanhLayer,
)
from latte.stdlib.batchnorm import BatchNormLayer
from latte.stdlib.convolution import ConvolutionLayer, UnbiasedNeuron
from latte.zoo.nets import basic_block, bottleneck


@dataclass(frozen=True)
class Layer:
    name: str
    fits: Callable[[object], bool]
    build: Callable[..., object]


def image(src) -> bool:
    """A ``(C, H, W)`` ensemble with ``H, W >= 2``."""
    return len(src.shape) == 3 and min(src.shape[1:]) >= 2


def same_shape(pool: list, src) -> list:
    """The ensembles of ``pool`` shaped like ``src`` (``src`` included)."""
    return [e for e in pool if e.shape == src.shape]


def pick(rng: np.random.Generator, items: list):
    """One of ``items``, drawn from ``rng``."""
    return items[int(rng.integers(len(items)))]


LAYERS: list[Layer] = []


def _activation(rng, net, name, src, pool):
    """An in-place activation on any computed ensemble: one already read, or itself an
    activation, gets a copy to work on."""
    return pick(rng, [ReLULayer, TanhLayer, SigmoidLayer])(name, net, src)


LAYERS.append(Layer("act", lambda src: not isinstance(src, DataEnsemble), _activation))


# ---- element-wise, pooling, normalization and joining layers (issue 11, item 1)
def _leaky_or_elu(rng, net, name, src, pool):
    if rng.random() < 0.5:
        return LeakyReLULayer(name, net, src, slope=float(rng.choice([0.0, 0.01, 0.3])))
    return ELULayer(name, net, src, alpha=float(rng.choice([0.0, 0.5, 1.0])))


def _lrn(rng, net, name, src, pool):
    return LRNLayer(name, net, src, size=int(rng.integers(1, 6)), alpha=float(rng.choice([1e-4, 0.5])),
                    beta=float(rng.choice([0.5, 0.75, 1.5])), k=float(rng.choice([1.0, 2.0])))


def _join(rng, net, name, src, pool):
    return (AddLayer if rng.random() < 0.5 else MulLayer)(name, net, src, pick(rng, same_shape(pool, src)))


def _concat(rng, net, name, src, pool):
    """``src`` and one or two ensembles of ``pool`` that differ from it only along an axis."""
    axis = int(rng.integers(len(src.shape)))
    fits = [e for e in pool if len(e.shape) == len(src.shape)
            and all(a == b for j, (a, b) in enumerate(zip(e.shape, src.shape)) if j != axis)]
    parts = [src] + [pick(rng, fits) for _ in range(int(rng.integers(1, 3)))]
    return ConcatLayer(name, net, [parts[i] for i in rng.permutation(len(parts))], axis=axis)


def _branches(rng, net, name, src, pool):
    """Two or three fresh branches over ``src`` joined along the first axis, as in an
    inception block: convolutions that keep an image's size (or FC layers), some under an
    in-place activation; read by the concat alone, so it is zero-copy from opt level 1
    (:mod:`latte.compiler.joins`)."""
    branches = []
    for k in range(int(rng.integers(2, 4))):
        width = int(rng.integers(1, 5))
        if image(src):
            size = int(rng.choice([1, 3]))
            branch = ConvolutionLayer(f"{name}b{k}", net, src, width, size, pad=size // 2)
        else:
            branch = FullyConnectedLayer(f"{name}b{k}", net, src, width)
        if rng.random() < 0.5:
            branch = pick(rng, [ReLULayer, TanhLayer, SigmoidLayer])(f"{name}a{k}", net, branch)
        branches.append(branch)
    return ConcatLayer(name, net, branches)


LAYERS.extend([
    Layer("leakyelu", lambda src: not isinstance(src, DataEnsemble), _leaky_or_elu),
    Layer("prelu", lambda src: True, lambda rng, net, name, src, pool: PReLULayer(name, net, src)),
    Layer("gap", lambda src: len(src.shape) == 3, lambda rng, net, name, src, pool:
          GlobalAveragePoolingLayer(name, net, src)),
    Layer("softmax", lambda src: True, lambda rng, net, name, src, pool: SoftmaxLayer(name, net, src)),
    Layer("lrn", lambda src: True, _lrn),
    Layer("join", lambda src: True, _join),
    Layer("concat", lambda src: True, _concat),
])
LAYERS.append(Layer("branches", lambda src: True, _branches))


# ---- batch normalization (issue 11, item 1)
def _batchnorm(rng, net, name, src, pool):
    # eps well above float32 rounding: a channel nearly constant over the batch (after a
    # ReLU) would otherwise come out as rounding noise times 1/sqrt(eps)
    return BatchNormLayer(name, net, src, eps=float(rng.choice([1e-2, 1e-1])),
                          momentum=float(rng.choice([0.1, 0.5])))


# training needs two values per channel: a batch of one (C,) vector has one
LAYERS.append(Layer("batchnorm", lambda src: src.size // src.shape[0] * src.net.batch_size >= 2,
                    _batchnorm))


# ---- convolution (groups, dilation, bias=False) and floor-division mappings (issue 11, item 1)
def _conv(rng, net, name, src, pool):
    """A convolution with a random group count dividing the channels (depthwise included),
    dilation, stride, padding, non-square kernels, with or without bias."""
    c, h, w = src.shape
    groups = pick(rng, [g for g in range(1, c + 1) if c % g == 0])
    pad = tuple(int(rng.integers(0, 2)) for _ in range(2))
    dilation = tuple(int(rng.integers(1, 3)) for _ in range(2))
    kernel = tuple(min(int(rng.integers(1, 4)), (n + 2 * p - 1) // d + 1)
                   for n, p, d in zip((h, w), pad, dilation))   # the dilated window fits
    return ConvolutionLayer(name, net, src, groups * int(rng.integers(1, 3)), kernel,
                            stride=tuple(int(rng.integers(1, 3)) for _ in range(2)), pad=pad,
                            dilation=dilation, groups=groups, bias=bool(rng.random() < 0.5))


def _quotient(rng, net, name, src, pool):
    """Neurons reading ``y // q`` of the source along each dimension (nearest upsampling by
    ``q``), one dimension possibly through a padded window around it: quasi-affine mappings,
    which synthesis strip-mines."""
    qs = [int(rng.integers(1, 3)) for _ in src.shape]
    qs[int(rng.integers(len(qs)))] = 2
    shape = tuple(n * q for n, q in zip(src.shape, qs))
    window = int(rng.integers(-1, len(qs)))   # -1: no window

    def mapping(*y):
        return tuple(range(y[i] // q - 1, y[i] // q + 2) if i == window else y[i] // q
                     for i, q in enumerate(qs))

    weights = (0.5 * rng.standard_normal((*shape, 1 if window < 0 else 3))).astype(np.float32)
    ens = Ensemble(net, name, UnbiasedNeuron, shape, weights=weights)
    add_connections(net, src, ens, mapping, padding=None if window < 0 else 0.0)
    return ens


LAYERS.extend([
    Layer("conv", image, _conv),
    Layer("quotient", lambda src: src.size <= 256, _quotient),
])


# ---- 3x3 stride-1 convolutions Winograd takes at opt level >= 2 (issue 13): enough input
# channels (a 1x1 convolution widens the source first) and output tiles (a wide image)
def _winograd(rng, net, name, src, pool):
    wide = ConvolutionLayer(f"{name}w", net, src, int(rng.integers(8, 11)), 1)
    return ConvolutionLayer(name, net, wide, int(rng.integers(1, 4)), 3,
                            pad=int(rng.integers(0, 2)), bias=bool(rng.random() < 0.5))


LAYERS.append(Layer("winograd", lambda src: image(src) and src.shape[1] >= 4
                    and src.shape[2] >= 64, _winograd))


# ---- losses against a target ensemble (issue 11, item 1): the target is a computed
# ensemble (its gradient is checked too); the cross-entropy's goes through a sigmoid
def _target_loss(rng, net, name, src, pool):
    others = [e for e in same_shape(pool, src) if e is not src] or [src]
    target = pick(rng, others)
    if rng.random() < 0.5 or isinstance(target, DataEnsemble):
        return EuclideanLossLayer(name, net, src, target)
    return SigmoidCrossEntropyLossLayer(name, net, src, SigmoidLayer(f"{name}t", net, target))


LAYERS.append(Layer("targetloss", lambda src: True, _target_loss))


# ---- mean pooling with the padding left out of the divisor (ONNX's AveragePool, issue 14)
def _mean_pool_exclusive(rng, net, name, src, pool):
    k = int(rng.integers(2, min(*src.shape[1:], 3) + 1))   # image(): H, W >= 2
    return MeanPoolingLayer(name, net, src, k, int(rng.integers(1, 3)), int(rng.integers(1, k)),
                            count_include_pad=False)


LAYERS.append(Layer("meanpool_exclusive", image, _mean_pool_exclusive))


# ---- recurrent layers (issue 12, item 4): in nets with time steps, on any ensemble (the
# embedding reads ids, which random data is not: latte.fuzz.nets adds it with an input of ids)
def _recurrent(rng, net, name, src, pool):
    layer = pick(rng, [RNNLayer, LSTMLayer, GRULayer])
    hidden = int(rng.integers(1, 5))
    # half of them wide enough that a step's products are GEMMs (weights packed at level
    # 2+), drawn from a stream of the layer's own: the case's other draws stay as they were
    own = np.random.default_rng([zlib.crc32(name.encode()), 12])
    if own.random() < 0.5:
        hidden += int(own.integers(16, 37))
    return layer(name, net, src, hidden)


LAYERS.append(Layer("recurrent", lambda src: src.net.time_steps > 1 and src.size <= 16, _recurrent))


# ---- residual blocks (issue 13): in the test forward their batch norm + add + ReLU tails
# fuse with the convolutions, or run as a group of their own, each batch norm's output read
# back at once from a local (:func:`latte.compiler.passes.localize.keep_in_locals`)
def _residual(rng, net, name, src, pool):
    block = pick(rng, [basic_block, bottleneck])
    width = int(rng.integers(1, 3)) if block is bottleneck else int(rng.integers(1, 5))

    def batchnorm(bn_name, bn_net, bn_src):   # the zoo's eps of 1e-5 is too small here
        return _batchnorm(rng, bn_net, bn_name, bn_src, pool)
    lib = SimpleNamespace(**{**vars(stdlib), "BatchNormLayer": batchnorm})
    return block(lib, name, net, src, width, int(rng.integers(1, 3)))


LAYERS.append(Layer("residual", lambda src: image(src) and min(src.shape[1:]) >= 2, _residual))


# ---- a 1x1 convolution, its batch norm, perhaps a residual added, a ReLU (issue 13): the
# test forward's product runs the tail as it stores its tiles
# (:mod:`latte.compiler.passes.epilogue`), a C that nothing else reads not stored; a 1x1
# convolution widens the source first (products too small stay loops)
def _conv_tail(rng, net, name, src, pool):
    width = int(rng.integers(12, 17))
    wide = ConvolutionLayer(f"{name}w", net, src, width, 1)
    out = _batchnorm(rng, net, f"{name}n", ConvolutionLayer(
        f"{name}c", net, wide, width, 1, bias=bool(rng.random() < 0.5)), pool)
    if rng.random() < 0.5:
        out = AddLayer(f"{name}a", net, out, wide)
    return ReLULayer(name, net, out)


LAYERS.append(Layer("conv_tail", image, _conv_tail))
