"""Data layers: ensembles whose values come from arrays, HDF5 files or the user.

Data layers move data; they compute nothing. A source fills its ensembles before each
forward pass: training batches follow a (seeded) permutation, reshuffled every epoch; test
batches walk the set in order, and the last, partial batch reports how many items are real.
Under MPI with N ranks a global batch is N consecutive batches of the order; rank r loads
the r-th (every rank draws the same permutation from the shared seed).
"""

from __future__ import annotations

import math
import os

import numpy as np

from latte.errors import DataError, ShapeError
from latte.lang import DataEnsemble, Phase
from latte.runtime import distributed


class ArraySource:
    """Feeds a data and a label ensemble from in-memory (or HDF5) arrays."""

    def __init__(self, net, train, test, shuffle: bool, what: str):
        self.sets = {Phase.TRAIN: _check_pair(train, what + " train")}
        if test is not None:
            self.sets[Phase.TEST] = _check_pair(test, what + " test")
        self.shuffle = shuffle
        self.rng = net.rng
        self.cursor = {p: 0 for p in Phase}
        self.order = {p: np.arange(len(s[1])) for p, s in self.sets.items()}
        self.epoch = {p: 0 for p in Phase}
        self.batch = net.batch_size
        self.ranks, self.rank = distributed.world_size(), distributed.rank()
        self.data = self.label = None
        if shuffle:
            self.order[Phase.TRAIN] = self.rng.permutation(len(self.sets[Phase.TRAIN][1]))

    def num_samples(self, phase: Phase) -> int:
        return len(self.sets[phase][1]) if phase in self.sets else 0

    def batches_per_epoch(self, phase: Phase) -> int:
        n, b = self.num_samples(phase), self.batch * self.ranks
        return max(1, n // b) if phase is Phase.TRAIN else math.ceil(n / b)

    def reset(self, phase: Phase) -> None:
        self.cursor[phase] = 0

    def _indices(self, phase: Phase) -> tuple[np.ndarray, int]:
        n, b = self.num_samples(phase), self.batch * self.ranks   # the global batch
        start = self.cursor[phase]
        if phase is Phase.TRAIN and start + b > n:  # new epoch
            self.epoch[phase] += 1
            if self.shuffle:
                self.order[phase] = self.rng.permutation(n)
            start = 0
        self.cursor[phase] = 0 if start + b >= n and phase is Phase.TEST else start + b
        start += self.rank * self.batch   # this rank's shard
        take = np.arange(start, start + self.batch) % n
        valid = max(0, min(self.batch, n - start))
        return self.order[phase][take], valid

    def load(self, net, phase: Phase) -> int:
        if phase not in self.sets:
            raise DataError(f"data layer {self.data.name!r} has no {phase.value} set")
        idx, valid = self._indices(phase)
        x, y = self.sets[phase]
        if isinstance(x, np.ndarray):
            net.value(self.data)[...] = x[idx].reshape(net.value(self.data).shape)
            net.value(self.label)[:, 0] = y[idx]
        else:  # h5py datasets want increasing indices
            order = np.argsort(idx, kind="stable")
            uniq, inverse = np.unique(idx[order], return_inverse=True)
            rows = np.empty(len(idx), np.int64)
            rows[order] = inverse
            net.value(self.data)[...] = np.asarray(x[uniq], np.float32)[rows].reshape(
                net.value(self.data).shape)
            net.value(self.label)[:, 0] = np.asarray(y[uniq])[rows]
        return valid


def _check_pair(pair, what: str):
    try:
        x, y = pair
    except (TypeError, ValueError):
        raise ShapeError(f"{what} data must be an (X, y) pair") from None
    if not hasattr(x, "shape"):
        x = np.asarray(x, np.float32)
    elif isinstance(x, np.ndarray) and x.dtype != np.float32:
        x = x.astype(np.float32)
    y = np.asarray(y).reshape(-1) if isinstance(y, (list, np.ndarray)) else y
    if len(x.shape) < 2:
        raise ShapeError(f"{what}: X must be (N, *sample_shape), got shape {x.shape}")
    if x.shape[0] != y.shape[0]:
        raise ShapeError(f"{what}: X has {x.shape[0]} samples but y has {y.shape[0]} labels")
    if x.shape[0] == 0:
        raise ShapeError(f"{what}: the set is empty")
    return x, y


def _unique_name(net, base: str) -> str:
    names = {e.name for e in net.ensembles}
    name, k = base, 1
    while name in names:
        k += 1
        name = f"{base}{k}"
    return name


def _pair_layer(net, source: ArraySource, shape) -> tuple[DataEnsemble, DataEnsemble]:
    source.data = DataEnsemble(net, _unique_name(net, "data"), shape, source)
    source.label = DataEnsemble(net, _unique_name(net, "label"), (1,), source)
    return source.data, source.label


def ArrayDataLayer(net, train, test=None, shuffle: bool = True):
    """Data and label ensembles fed from ``train = (X, y)`` (and ``test``) numpy arrays."""
    source = ArraySource(net, train, test, shuffle, "ArrayDataLayer")
    x_train = source.sets[Phase.TRAIN][0]
    if Phase.TEST in source.sets and source.sets[Phase.TEST][0].shape[1:] != x_train.shape[1:]:
        raise ShapeError(f"ArrayDataLayer: test samples have shape "
                         f"{source.sets[Phase.TEST][0].shape[1:]}, train samples {x_train.shape[1:]}")
    return _pair_layer(net, source, x_train.shape[1:])


def _open_hdf5(path):
    import h5py

    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"HDF5DataLayer: file {path!r} does not exist")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"HDF5DataLayer: cannot open {path!r} as HDF5: {exc}") from exc
    for key in ("data", "label"):
        if key not in f:
            raise DataError(f"HDF5DataLayer: {path!r} has no dataset '/{key}'")
    return f["data"], f["label"]


def HDF5DataLayer(net, train_path, test_path=None, shuffle: bool = True):
    """Data and label ensembles fed from HDF5 files with datasets ``/data`` and ``/label``."""
    train = _open_hdf5(train_path)
    test = _open_hdf5(test_path) if test_path is not None else None
    source = ArraySource(net, train, test, shuffle, "HDF5DataLayer")
    return _pair_layer(net, source, train[0].shape[1:])


class MemorySource:
    """Nothing to load: the user writes ``net.value(ens)`` before each forward pass."""

    def load(self, net, phase: Phase) -> int:
        return net.batch_size

    def batches_per_epoch(self, phase: Phase) -> int:
        return 1

    def num_samples(self, phase: Phase) -> int:
        return 0

    def reset(self, phase: Phase) -> None:
        pass


def MemoryDataLayer(net, name: str, shape) -> DataEnsemble:
    """An input ensemble fed through ``net.value(ens)``; its gradient is computed."""
    ens = DataEnsemble(net, name, shape, MemorySource())
    ens.needs_grad = True
    return ens
