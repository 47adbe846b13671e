"""The random generator that parameter initializers and data shuffling draw from.

``Net(seed=...)`` reseeds it, so a seed fixes initialization, shuffling and dropout masks.
"""

from __future__ import annotations

import numpy as np

_rng = np.random.default_rng()


def seed(value: int | None) -> np.random.Generator:
    """Reseed (``None``: fresh entropy) and return the generator."""
    global _rng
    _rng = np.random.default_rng(value)
    return _rng


def generator() -> np.random.Generator:
    return _rng
