"""scikit-learn's handwritten digits (1797 8x8 images, bundled with scikit-learn), shared by
the digit examples."""

from collections.abc import Callable

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def digits_split(prepare: Callable[[np.ndarray], np.ndarray]):
    """``(X_train, y_train), (X_test, y_test)``: the digits in a fixed, stratified 80/20
    split, their images mapped by ``prepare`` from ``(n, 8, 8)`` pixels in 0..16 to the
    ``(n, channels, height, width)`` float32 array a net reads."""
    digits = load_digits()
    X = prepare(digits.images)
    y = digits.target.astype(np.int64)
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2, random_state=0,
                                                        stratify=y)
    return (X_train, y_train), (X_test, y_test)
