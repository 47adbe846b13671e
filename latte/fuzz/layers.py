"""Stdlib layers the random nets add on top of a case's generated ensembles.

Each entry of :data:`LAYERS` is a :class:`Layer`: ``fits(src)`` says whether it can read
``src``; ``build(rng, net, name, src, pool)`` adds it (``pool``: every ensemble of the case
so far, for layers with a second input) and returns the new ensemble. The generator draws
these from a stream of its own (see :func:`latte.fuzz.nets.build_case`), so adding an entry
here leaves every earlier case's generated layers as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


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
    return items[int(rng.integers(len(items)))]


LAYERS: list[Layer] = []
