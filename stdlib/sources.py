"""Data sources: which samples make each batch, and loading them ahead on a thread.

A source plans batches on the main thread (the order, the epoch, the random draws) and
reads and transforms the planned samples on a background thread of its own, one batch
ahead, so the next batch is ready when the current one has computed. Planning never waits
on the thread, and everything random is drawn while planning, from the source's own
generator (seeded from the net's seed): the batches are the same, in the same order, with
or without the thread. Samples held in memory that no transform changes are gathered
straight into the data ensemble's buffer instead, on the main thread: read ahead, they
would be copied twice (once on the thread, once into the buffer), and the thread's copy
would take a core from the compute threads while they run.

Training batches follow a permutation of the set (with ``shuffle``), redrawn every epoch;
test batches walk the set in order. An epoch is ``ceil(n / batch)`` batches, the last one
partial (it reports how many items are real), except in shuffled training, where it is
``n // batch`` full batches and the remainder falls to the next permutation. Under MPI with
N ranks a global batch is N consecutive batches of the order; rank r loads the r-th.
"""

from __future__ import annotations

import math
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from latte.errors import DataError
from latte.lang import Phase
from latte.runtime import distributed

_SALT = 0x6C617474   # keeps a source's stream apart from others seeded by the net's seed
CHUNK = 4096         # samples per step of a whole-set check: little memory for a large set


class Rows:
    """The samples of one array, or of HDF5 datasets concatenated in order, read by index.

    ``names`` says what each part is in error messages (``"train X"``, a file's path)."""

    def __init__(self, parts: list, names: list[str]):
        self.parts, self.names = parts, names
        self.ends = np.cumsum([len(p) for p in parts])
        self.shape = (int(self.ends[-1]), *parts[0].shape[1:])

    def __len__(self) -> int:
        return self.shape[0]

    def where(self, i: int) -> str:
        """``i``'s part and its index there, as an error message names them."""
        k = int(np.searchsorted(self.ends, i, side="right"))
        local = i - (int(self.ends[k - 1]) if k else 0)
        return f"{self.names[k]}, sample {local}"

    @property
    def in_memory(self) -> bool:
        """One numpy array (not HDF5 datasets)."""
        return len(self.parts) == 1 and isinstance(self.parts[0], np.ndarray)

    def take(self, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The samples ``idx``, in order (in memory, gathered into ``out`` if given)."""
        if self.in_memory:   # "clip" (the indices are valid): numpy buffers "raise"'s out
            return np.take(self.parts[0], idx, axis=0, out=out, mode="clip")
        assert out is None, "HDF5 rows are read into arrays of their own"
        # HDF5 reads want increasing, distinct indices within each file
        uniq, inverse = np.unique(idx, return_inverse=True)
        starts = np.concatenate([[0], self.ends[:-1]])
        chunks = []
        for part, lo, hi in zip(self.parts, starts, self.ends, strict=True):
            mine = uniq[(uniq >= lo) & (uniq < hi)] - lo
            if len(mine):   # a run of indices (unshuffled batches) is one slice: fast in h5py
                run = mine[-1] - mine[0] + 1 == len(mine)
                chunks.append(np.asarray(part[mine[0]:mine[-1] + 1] if run else part[mine]))
        return np.concatenate(chunks)[inverse.reshape(-1)]


def first_bad(x: np.ndarray) -> int | None:
    """The first sample of ``x`` holding a nan or an inf (None: all finite)."""
    if x.dtype.kind not in "fc":
        return None
    for lo in range(0, len(x), CHUNK):
        bad = ~np.isfinite(x[lo:lo + CHUNK].reshape(min(CHUNK, len(x) - lo), -1)).all(axis=1)
        if bad.any():
            return lo + int(np.argmax(bad))
    return None


@dataclass(frozen=True)
class Plan:
    """One rank's batch: sample indices, how many are real, the transform's seed."""

    rows: np.ndarray
    valid: int
    seed: int | None


@dataclass(frozen=True)
class Batch:
    x: np.ndarray
    y: np.ndarray
    valid: int


def read(xs: Rows, ys: Rows, plan: Plan, transform, checked: bool, rank: int) -> Batch:
    """Read and transform a planned batch (on the background thread); ``checked``: ``X``
    and ``y`` are known to be finite, else the batch is checked."""
    x, y = xs.take(plan.rows), ys.take(plan.rows)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    if not checked:
        for rows, v in ((xs, x), (ys, y)):
            bad = first_bad(v)
            if bad is not None:
                raise DataError(f"{rows.where(int(plan.rows[bad]))}: a value is not finite "
                                "(nan or inf)")
    if transform is not None:
        x = transform(x, None if plan.seed is None else np.random.default_rng([plan.seed, rank]))
    return Batch(x, y, plan.valid)


class ArraySource:
    """Feeds a data and a label ensemble from :class:`Rows` (in memory or HDF5).

    ``sets`` maps each phase to its ``(X, y)`` rows; ``checked``: whether ``X`` is known to
    be finite (else each batch is checked as it is read); ``transform``: see
    :mod:`latte.stdlib.transforms`; ``prefetch``: load the next batch on a thread (but
    samples in memory that no transform changes: see the module docstring).
    """

    def __init__(self, net, sets: dict, *, shuffle: bool, transform=None, checked: bool = True,
                 prefetch: bool = True):
        self.sets, self.shuffle, self.transform = sets, shuffle, transform
        self.checked, self.prefetch = checked, prefetch
        streams = len(net.data_sources())
        self.rng = np.random.default_rng(None if net.seed is None else [net.seed, _SALT, streams])
        self.batch = net.batch_size
        self.ranks, self.rank = distributed.world_size(), distributed.rank()
        self.cursor = {p: 0 for p in Phase}
        self.epoch = {p: 0 for p in Phase}
        self.order = {p: np.arange(len(s[0])) for p, s in sets.items()}
        if shuffle:
            self.order[Phase.TRAIN] = self.rng.permutation(len(sets[Phase.TRAIN][0]))
        self.data = self.label = None
        self._pending: dict[Phase, tuple[Future, tuple]] = {}
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ the epoch
    def num_samples(self, phase: Phase) -> int:
        return len(self.sets[phase][0]) if phase in self.sets else 0

    def batches_per_epoch(self, phase: Phase) -> int:
        n, b = self.num_samples(phase), self.batch * self.ranks
        return max(1, n // b) if phase is Phase.TRAIN and self.shuffle else math.ceil(n / b)

    def reset(self, phase: Phase) -> None:
        """Start ``phase`` over from its first batch (the test pass does, every epoch)."""
        pending = self._pending.get(phase)
        if phase is Phase.TEST and pending is not None and pending[1][0] in (0, self._end(phase)):
            return   # the batch read ahead is the first one (test batches draw nothing)
        self._drop(phase)
        self.cursor[phase] = 0

    def _end(self, phase: Phase) -> int:
        """Where an epoch of ``phase`` ends, in samples of the global batch order."""
        return self.batches_per_epoch(phase) * self.batch * self.ranks

    def _plan(self, phase: Phase) -> Plan:
        """The next batch of ``phase``: advances the cursor (main thread only)."""
        n, b = self.num_samples(phase), self.batch * self.ranks   # the global batch
        start = self.cursor[phase]
        if start >= self._end(phase):   # a new epoch
            start = 0
            if phase is Phase.TRAIN:
                self.epoch[phase] += 1
                if self.shuffle:
                    self.order[phase] = self.rng.permutation(n)
        self.cursor[phase] = start + b
        random = phase is Phase.TRAIN and self.transform is not None
        seed = int(self.rng.integers(2**63)) if random else None
        start += self.rank * self.batch   # this rank's shard
        take = np.arange(start, start + self.batch) % n
        return Plan(self.order[phase][take], max(0, min(self.batch, n - start)), seed)

    def _position(self, phase: Phase) -> tuple:
        return self.cursor[phase], self.epoch[phase], self.order[phase], self.rng.bit_generator.state

    def _drop(self, phase: Phase) -> None:
        """Forget a batch planned ahead: the source is where it was before planning it."""
        pending = self._pending.pop(phase, None)
        if pending is not None:
            pending[0].cancel()
            self.cursor[phase], self.epoch[phase], self.order[phase], state = pending[1]
            if phase is Phase.TRAIN:   # the only phase that draws from the generator
                self.rng.bit_generator.state = state

    # ------------------------------------------------------------ snapshots
    def snapshot(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Where the source is, as a snapshot keeps it (JSON, and the batch orders as
        arrays): per phase the cursor and epoch, and the generator's state, each as it was
        before the batches read ahead were planned."""
        cursor, epoch, order = dict(self.cursor), dict(self.epoch), dict(self.order)
        rng = self.rng.bit_generator.state
        for phase, (_, position) in self._pending.items():
            cursor[phase], epoch[phase], order[phase], state = position
            if phase is Phase.TRAIN:   # the only phase that draws from the generator
                rng = state
        phases = [p.value for p in self.sets]
        info = {"ensemble": self.data.name, "ranks": self.ranks, "rng": rng,
                "samples": {p.value: self.num_samples(p) for p in self.sets},
                "cursor": {p: cursor[Phase(p)] for p in phases},
                "epoch": {p: epoch[Phase(p)] for p in phases}}
        return info, {f"order/{p}": order[Phase(p)] for p in phases}

    def restorer(self, info, arrays: dict[str, np.ndarray]) -> Callable[[], None]:
        """Check a :meth:`snapshot` (ValueError saying what is wrong) and return what puts
        the source back there. A snapshot of other data (other sizes) or of another rank
        count is not restored (with a warning): its positions mean nothing here."""
        if not isinstance(info, dict) or not {"ensemble", "ranks", "rng", "samples", "cursor",
                                              "epoch"} <= info.keys():
            raise ValueError("no position saved (another net's snapshot, or damaged)")
        samples = {p.value: self.num_samples(p) for p in self.sets}
        if info["samples"] != samples or info["ranks"] != self.ranks:
            warnings.warn(f"data layer {self.data.name!r}: the snapshot's data position is for "
                          f"{info['samples']} samples on {info['ranks']} rank(s), this source "
                          f"has {samples} on {self.ranks}: not restored", RuntimeWarning,
                          stacklevel=5)
            return lambda: None
        orders = {}
        for p, n in samples.items():
            order = arrays.get(f"order/{p}")
            if (order is None or order.shape != (n,) or order.dtype.kind not in "iu"
                    or not (np.sort(order) == np.arange(n)).all()):
                raise ValueError(f"the {p} batch order is missing or not a permutation of "
                                 f"{n} samples")
            orders[Phase(p)] = order
        try:
            type(self.rng.bit_generator)().state = info["rng"]
            cursor = {Phase(p): int(info["cursor"][p]) for p in samples}
            epoch = {Phase(p): int(info["epoch"][p]) for p in samples}
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"a damaged position ({exc})") from None

        def restore() -> None:
            for phase in list(self._pending):
                self._drop(phase)
            self.cursor.update(cursor)
            self.epoch.update(epoch)
            self.order.update(orders)
            self.rng.bit_generator.state = info["rng"]
        return restore

    def check_labels(self, ens, who: str, *, classes: int | None = None,
                     bounds: tuple[float, float] | None = None) -> None:
        """Raise :class:`DataError` naming the array and the sample when a label of ``ens``
        (if it is this source's label ensemble) is not a class index in ``[0, classes)``
        or not within ``bounds``. A loss layer calls this when it is built."""
        if ens is not self.label:
            return
        if classes is not None:
            want = f"a class index in [0, {classes})"
        else:
            want = f"in [{bounds[0]:g}, {bounds[1]:g}]"
        for _, rows in self.sets.values():
            for lo in range(0, len(rows), CHUNK):
                idx = np.arange(lo, min(lo + CHUNK, len(rows)))
                y = np.asarray(rows.take(idx), np.float64).reshape(len(idx), -1)
                if classes is not None:
                    bad = (y < 0) | (y >= classes) | (y != np.floor(y))
                else:
                    bad = (y < bounds[0]) | (y > bounds[1])
                if bad.any():
                    i, j = np.unravel_index(int(np.argmax(bad)), bad.shape)
                    raise DataError(f"{who}: {rows.where(lo + int(i))}: label {y[i, j]:g} is "
                                    f"not {want}")

    # ------------------------------------------------------------ loading
    def _job(self, phase: Phase) -> Callable[[], Batch]:
        """Plan the next batch of ``phase``; the job that reads it holds no reference to
        the source (an unfinished job does not keep a dropped net alive)."""
        xs, ys = self.sets[phase]
        return partial(read, xs, ys, self._plan(phase), self.transform, self.checked, self.rank)

    def load(self, net, phase: Phase) -> int:
        """Write the next batch of ``phase`` into the ensembles; returns how many items are
        real. Then starts reading the batch after it."""
        if phase not in self.sets:
            raise DataError(f"data layer {self.data.name!r} has no {phase.value} set")
        x, y = net.value(self.data), net.value(self.label)
        xs, ys = self.sets[phase]
        if self.transform is None and self.checked and net.time_steps == 1 and xs.in_memory:
            plan = self._plan(phase)   # gathered straight into the buffer (module docstring)
            xs.take(plan.rows, out=x)
            y[...] = ys.take(plan.rows).reshape(y.shape)
            return plan.valid
        pending = self._pending.pop(phase, None)
        batch = pending[0].result() if pending else self._job(phase)()
        if net.time_steps > 1:   # samples (batch, T, ...) -> buffers (T, batch, ...)
            x[...] = batch.x.reshape(x.shape[1], x.shape[0], *x.shape[2:]).swapaxes(0, 1)
            y[...] = batch.y.reshape(y.shape[1], y.shape[0], *y.shape[2:]).swapaxes(0, 1)
        else:
            x[...] = batch.x.reshape(x.shape)
            y[...] = batch.y.reshape(y.shape)
        if self.prefetch:
            position = self._position(phase)
            self._pending[phase] = (self._thread().submit(self._job(phase)), position)
        return batch.valid

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"latte-data-{self.data.name}")
            # the thread ends when the source is collected (or at exit); no waiting there:
            # the collection may run on that very thread
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool

    def close(self) -> None:
        """Drop batches read ahead and end the background thread."""
        for phase in list(self._pending):
            self._drop(phase)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
