"""Per-batch data transforms: normalization, random crops with padding, mirroring.

``ArrayDataLayer(net, train, test, transform=Transform(Normalize(mean, std),
RandomCrop(28, pad=2), Mirror()))`` applies the steps in order to every batch it loads, on
its background thread. A step is any object with

- ``shape(sample_shape) -> sample_shape``: the shape of a sample after the step (raises
  :class:`~latte.errors.ShapeError` when it cannot apply), and
- ``__call__(x, rng) -> x``: the step over a float32 batch ``x`` of shape
  ``(n, *sample_shape)``; ``rng`` is a numpy Generator for a training batch and None for a
  test batch (random steps then act deterministically: a centred crop, no mirror).

The data source seeds one generator per training batch from its own stream (itself seeded
from the net's seed and, under MPI, the rank), so a batch's transform does not depend on
timing or on whether the background thread runs. The last two sample dimensions are the
image's height and width; the first is its channel.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from latte.errors import ShapeError


class Normalize:
    """``(x - mean[c]) / std[c]`` per channel ``c`` (the first sample dimension), in training
    and test. ``mean`` and ``std`` are scalars or one value per channel."""

    def __init__(self, mean=0.0, std=1.0):
        self.mean = np.atleast_1d(np.asarray(mean, np.float32))
        self.std = np.atleast_1d(np.asarray(std, np.float32))
        if self.mean.ndim != 1 or self.std.ndim != 1:
            raise ShapeError("Normalize: mean and std must be scalars or one value per channel")
        if not (np.all(np.isfinite(self.std)) and np.all(self.std > 0)):
            raise ValueError(f"Normalize: std must be positive, got {self.std}")

    def shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        for what, v in (("mean", self.mean), ("std", self.std)):
            if v.size not in (1, sample_shape[0]):
                raise ShapeError(f"Normalize: {what} has {v.size} values, the samples "
                                 f"{sample_shape} have {sample_shape[0]} channels")
        return sample_shape

    def __call__(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        per_channel = (1, -1) + (1,) * (x.ndim - 2)
        return (x - self.mean.reshape(per_channel)) / self.std.reshape(per_channel)


class RandomCrop:
    """Pad height and width by ``pad`` zeros on each side, then crop ``size`` (an int or an
    ``(h, w)`` pair; default: the unpadded size) at an offset drawn per sample in training
    (uniform over every position, height offsets first, then width) and at the centre in
    test. After :class:`Normalize`, the zeros are the channel means."""

    def __init__(self, size: int | tuple[int, int] | None = None, pad: int = 0):
        self.size = None if size is None else (size, size) if isinstance(size, int) else tuple(size)
        self.pad = int(pad)
        if self.pad < 0 or (self.size is not None and (len(self.size) != 2 or min(self.size) < 1)):
            raise ValueError(f"RandomCrop: bad size {size!r} or pad {pad!r}")

    def shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(sample_shape) < 2:
            raise ShapeError(f"RandomCrop: samples {sample_shape} have no height and width")
        h, w = self.size or sample_shape[-2:]
        if h > sample_shape[-2] + 2 * self.pad or w > sample_shape[-1] + 2 * self.pad:
            raise ShapeError(f"RandomCrop: a {h}x{w} crop does not fit samples {sample_shape} "
                             f"padded by {self.pad}")
        return (*sample_shape[:-2], h, w)

    def __call__(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        h, w = self.size or x.shape[-2:]
        p = self.pad
        if p:
            x = np.pad(x, [(0, 0)] * (x.ndim - 2) + [(p, p), (p, p)])
        free_h, free_w = x.shape[-2] - h, x.shape[-1] - w
        n = len(x)
        if rng is None:
            oy, ox = np.full(n, free_h // 2), np.full(n, free_w // 2)
        else:
            oy, ox = rng.integers(0, free_h + 1, n), rng.integers(0, free_w + 1, n)
        windows = sliding_window_view(x, (h, w), axis=(-2, -1))   # (n, ..., H', W', h, w)
        lead = (slice(None),) * (x.ndim - 3)   # the channel (and any other) dimensions
        # the batch index and the offsets are split by the slices: numpy puts their
        # broadcast dimension first, giving (n, ..., h, w)
        return np.ascontiguousarray(windows[(np.arange(n), *lead, oy, ox)])


class Mirror:
    """Flip the width of each training sample with probability 1/2 (one draw per sample);
    the identity in test."""

    def shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        return sample_shape

    def __call__(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        if rng is None:
            return x
        flip = rng.random(len(x)) < 0.5
        x = x.copy()
        x[flip] = x[flip][..., ::-1]
        return x


class Transform:
    """Steps applied in order (see the module docstring for what a step is)."""

    def __init__(self, *steps):
        self.steps = steps

    def shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        for step in self.steps:
            sample_shape = tuple(step.shape(tuple(sample_shape)))
        return sample_shape

    def __call__(self, x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        for step in self.steps:
            x = step(x, rng)
        return np.asarray(x, np.float32)
