"""Parameter initializers. They draw from the generator ``Net(seed=...)`` seeds."""

from __future__ import annotations

import numpy as np

from latte.random import generator


def xavier(shape, fan_in: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """Uniform in ``[-sqrt(3/fan_in), sqrt(3/fan_in)]`` (Caffe's Xavier filler)."""
    scale = np.sqrt(3.0 / max(1, int(fan_in)))
    return (rng or generator()).uniform(-scale, scale, size=shape).astype(np.float32)


def shared_scalar(value: float) -> tuple[np.ndarray, object]:
    """A ``Field``/``Param`` given as one scalar every neuron of an ensemble shares."""
    return np.full((1, 1), value, np.float32), lambda *index: 0
