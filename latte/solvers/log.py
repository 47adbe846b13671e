"""A run's logs in its snapshot dir: ``log.csv`` has one row per epoch (the epoch, the
iterations so far, the epoch's last training loss, test loss and accuracy),
``iterations.csv`` one row per iteration (its number counted from 1, the epoch, the training
loss). :class:`Log` writes them as :func:`~latte.solvers.sgd.solve` trains; :func:`read`
reads them back (for ``latte plot``); a log without ``iterations.csv`` (older runs) reads
as one with no iteration rows."""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from latte.compiler.cache import write_atomic
from latte.errors import DataError
from latte.solvers.snapshots import LOG

ITERATIONS = "iterations.csv"
COLUMNS = ["epoch", "iteration", "train_loss", "test_loss", "test_accuracy"]
ITERATION_COLUMNS = ["iteration", "epoch", "train_loss"]


class Log:
    """Writes ``directory``'s logs (nothing when ``directory`` is None). A run resumed at
    iteration ``start`` keeps the rows up to it (those after were written past the
    snapshot it resumed from). Iteration rows are kept in memory and appended with each
    epoch's row and before each snapshot (:meth:`flush`), not once per iteration."""

    def __init__(self, directory: str | None, start: int = 0):
        self.paths = {}
        self._pending: list[list] = []
        if directory is None:
            return
        os.makedirs(directory, exist_ok=True)
        for name, columns, at in ((LOG, COLUMNS, 1), (ITERATIONS, ITERATION_COLUMNS, 0)):
            path = self.paths[name] = os.path.join(directory, name)
            rows = []
            if os.path.exists(path):
                with open(path, newline="") as f:
                    rows = [r for r in csv.reader(f) if len(r) == len(columns)
                            and r[at].isdigit() and int(r[at]) <= start]   # not the header
            text = io.StringIO()
            csv.writer(text).writerows([columns, *rows])
            write_atomic(Path(path), text.getvalue().encode())

    @property
    def path(self) -> str | None:
        """Where ``log.csv`` goes (None: no logs are written)."""
        return self.paths.get(LOG)

    def iteration(self, iteration: int, epoch: int, loss: float) -> None:
        """Note the training loss of ``iteration`` (counted from 1)."""
        if self.paths:
            self._pending.append([iteration, epoch, loss])

    def flush(self) -> None:
        """Append the iteration rows noted so far."""
        if self._pending:
            self._append(ITERATIONS, self._pending)
            self._pending = []

    def epoch(self, epoch: int, iteration: int, train_loss: float | None,
              test_loss: float | None, accuracy: float | None) -> None:
        """Append ``epoch``'s row (after its iteration rows)."""
        if self.paths:
            self.flush()
            self._append(LOG, [[epoch, iteration, "" if train_loss is None else train_loss,
                                "" if test_loss is None else test_loss,
                                "" if accuracy is None else accuracy]])

    def _append(self, name: str, rows: list[list]) -> None:
        with open(self.paths[name], "a", newline="") as f:
            csv.writer(f).writerows(rows)


@dataclass
class Curves:
    """A log read back: per epoch ``epochs`` (a record array with :data:`COLUMNS`, missing
    values NaN), per iteration ``iterations`` and ``train_loss`` (empty without
    ``iterations.csv``)."""

    path: Path
    epochs: np.ndarray
    iterations: np.ndarray
    train_loss: np.ndarray


def read(path) -> Curves:
    """Read ``log.csv`` at ``path`` and the ``iterations.csv`` beside it, if there is one;
    :class:`~latte.errors.DataError` naming the file (and line) when one is not a latte
    log or holds something that is not a number."""
    path = Path(path)
    epochs = _table(path, COLUMNS)
    if len(epochs) == 0:
        raise DataError(f"log {str(path)!r} holds no epochs yet")
    beside = path.with_name(ITERATIONS)
    its = _table(beside, ITERATION_COLUMNS) if beside.exists() else np.zeros((0, 3))
    return Curves(path, np.rec.fromarrays(epochs.T, names=COLUMNS), its[:, 0], its[:, 2])


def _table(path: Path, columns: list[str]) -> np.ndarray:
    """The rows of a latte CSV log as floats (empty fields NaN)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read log {str(path)!r}: {exc}") from None
    if not rows or rows[0] != columns:
        raise DataError(f"{str(path)!r} is not a latte log: its first line should be "
                        f"{','.join(columns)!r}")
    values = []
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(columns):
            raise DataError(f"{str(path)!r}, line {line}: {len(row)} fields, expected "
                            f"{len(columns)} ({','.join(columns)})")
        try:
            values.append([float(v) if v != "" else np.nan for v in row])
        except ValueError:
            raise DataError(f"{str(path)!r}, line {line}: {','.join(row)!r} holds a value "
                            "that is not a number") from None
    return np.array(values, np.float64).reshape(-1, len(columns))
