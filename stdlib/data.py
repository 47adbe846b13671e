"""Data layers: ensembles whose values come from arrays, HDF5 files or the user.

Data layers move data; they compute nothing. Their sources (:mod:`latte.stdlib.sources`)
plan each batch, read it ahead on a thread and transform it
(:mod:`latte.stdlib.transforms`). Labels are class indices (``y`` shaped ``(N,)`` or
``(N, 1)``: a label ensemble of shape ``(1,)``) or targets of any shape (``y`` shaped
``(N, *shape)``: a label ensemble of that shape, for regression or multi-label losses).
In a net with time steps the data are sequences: ``X`` is ``(N, T, *sample_shape)`` and
``y`` is ``(N, T)`` (or ``(N, T, *shape)``), one sample and one label per step.
Bad data is an error naming the array and the sample before training starts: a nan or an
inf in an in-memory ``X`` or ``y`` (HDF5 data is checked batch by batch as it is read), a
test set whose samples have another shape, and (checked by the loss layer that reads the
labels, when it is built) a label outside what the loss accepts.
"""

from __future__ import annotations

import os

import numpy as np

from latte.errors import DataError, ShapeError
from latte.lang import DataEnsemble, Phase
from latte.stdlib.sources import ArraySource, Rows, first_bad


def _array_pair(pair, what: str) -> tuple[Rows, Rows]:
    """``(X, y)`` numpy arrays (or array-likes) checked and wrapped as :class:`Rows`."""
    try:
        x, y = pair
    except (TypeError, ValueError):
        raise ShapeError(f"{what} data must be an (X, y) pair") from None
    x = np.asarray(x, np.float32)
    y = np.asarray(y)
    if y.ndim > 1 and y.dtype.kind == "f":
        y = y.astype(np.float32)
    if x.ndim < 2:
        raise ShapeError(f"{what}: X must be (N, *sample_shape), got shape {x.shape}")
    if y.ndim < 1 or x.shape[0] != y.shape[0]:
        raise ShapeError(f"{what}: X has {x.shape[0]} samples but y has "
                         f"{y.shape[0] if y.ndim else 0} labels")
    if x.shape[0] == 0:
        raise ShapeError(f"{what}: the set is empty")
    for name, v in (("X", x), ("y", y)):
        bad = first_bad(v)
        if bad is not None:
            raise DataError(f"{what} {name}, sample {bad}: a value is not finite (nan or inf)")
    return Rows([x], [f"{what} X"]), Rows([y], [f"{what} y"])


def _label_shape(y: Rows, steps: int = 1) -> tuple[int, ...]:
    """The label ensemble's shape; with time steps, of one step's label."""
    lead = 1 if steps == 1 else 2
    return y.shape[lead:] if len(y.shape) > lead else (1,)


def _check_steps(net, rows: Rows, what: str) -> None:
    """In a net with time steps, samples and labels must be sequences of its length."""
    if net.time_steps > 1 and (len(rows.shape) < 2 or rows.shape[1] != net.time_steps):
        raise ShapeError(f"{what} has shape {rows.shape}; the net has time_steps="
                         f"{net.time_steps}, so it must be (N, {net.time_steps}, ...)")


def _unique_name(net, base: str) -> str:
    names = {e.name for e in net.ensembles}
    name, k = base, 1
    while name in names:
        k += 1
        name = f"{base}{k}"
    return name


def _layer(net, sets: dict, what: str, *, shuffle: bool, transform, prefetch: bool,
           checked: bool) -> tuple[DataEnsemble, DataEnsemble]:
    """The data and label ensembles of a source over ``sets`` (phase -> (X, y) rows)."""
    x, y = sets[Phase.TRAIN]
    for phase, (a, b) in sets.items():
        _check_steps(net, a, f"{what} {phase.value} X")
        _check_steps(net, b, f"{what} {phase.value} y")
    steps = net.time_steps
    if Phase.TEST in sets:
        tx, ty = sets[Phase.TEST]
        for kind, a, b in (("samples", x, tx), ("labels", y, ty)):
            if _label_shape(a, steps) != _label_shape(b, steps):
                raise ShapeError(f"{what}: test {kind} have shape {_label_shape(b, steps)}, "
                                 f"train {kind} {_label_shape(a, steps)}")
    sample = x.shape[1:] if steps == 1 else x.shape[2:]
    if transform is not None and steps > 1:
        raise ShapeError(f"{what}: transforms apply to images, not to sequences "
                         f"(the net has time_steps={steps})")
    shape = sample if transform is None else transform.shape(sample)
    source = ArraySource(net, sets, shuffle=shuffle, transform=transform, checked=checked,
                         prefetch=prefetch)
    source.data = DataEnsemble(net, _unique_name(net, "data"), shape, source)
    source.label = DataEnsemble(net, _unique_name(net, "label"), _label_shape(y, steps), source)
    return source.data, source.label


def ArrayDataLayer(net, train, test=None, shuffle: bool = True, *, transform=None,
                   prefetch: bool = True):
    """Data and label ensembles fed from ``train = (X, y)`` (and ``test``) numpy arrays.

    ``X`` is ``(N, *sample_shape)``; ``y`` holds class indices ``(N,)`` or targets
    ``(N, *shape)``. ``transform`` (a :class:`~latte.stdlib.transforms.Transform` or one
    step) is applied to every batch; the data ensemble has its output shape. With
    ``prefetch`` the next batch is read on a background thread while the current one
    computes (the batches are the same without it); without a transform (and in a net
    without time steps) the samples are gathered straight into the data buffer instead,
    as reading them ahead would copy them twice (:mod:`latte.stdlib.sources`).
    """
    sets = {Phase.TRAIN: _array_pair(train, "ArrayDataLayer train")}
    if test is not None:
        sets[Phase.TEST] = _array_pair(test, "ArrayDataLayer test")
    return _layer(net, sets, "ArrayDataLayer", shuffle=shuffle, transform=transform,
                  prefetch=prefetch, checked=True)


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
    x, y = f["data"], f["label"]
    if len(x.shape) < 2 or len(y.shape) < 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise DataError(f"HDF5DataLayer: {path!r}: /data {x.shape} and /label {y.shape} must "
                        "hold the same number (> 0) of samples, /data as (N, *sample_shape)")
    return x, y


def _hdf5_pair(paths) -> tuple[Rows, Rows]:
    """The files ``paths`` (one path or a list), concatenated in order."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise DataError("HDF5DataLayer: an empty list of files")
    pairs = [_open_hdf5(p) for p in paths]
    names = [os.fspath(p) for p in paths]
    for (x, y), name in zip(pairs[1:], names[1:]):
        for key, a, b in (("data", x, pairs[0][0]), ("label", y, pairs[0][1])):
            if a.shape[1:] != b.shape[1:]:
                raise DataError(f"HDF5DataLayer: {name!r} /{key} has samples of shape "
                                f"{a.shape[1:]}, {names[0]!r} of shape {b.shape[1:]}")
    return (Rows([x for x, _ in pairs], [f"{n} /data" for n in names]),
            Rows([y for _, y in pairs], [f"{n} /label" for n in names]))


def HDF5DataLayer(net, train_path, test_path=None, shuffle: bool = True, *, transform=None,
                  prefetch: bool = True):
    """Data and label ensembles fed from HDF5 files with datasets ``/data`` and ``/label``
    (sample-major; ``/label`` as for :func:`ArrayDataLayer`, Caffe's ``(N, 1)`` included).
    Each path may be a list of files, concatenated in order. Each batch is checked for nan
    and inf as it is read (the files may not fit in memory)."""
    sets = {Phase.TRAIN: _hdf5_pair(train_path)}
    if test_path is not None:
        sets[Phase.TEST] = _hdf5_pair(test_path)
    return _layer(net, sets, "HDF5DataLayer", shuffle=shuffle, transform=transform,
                  prefetch=prefetch, checked=False)


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
