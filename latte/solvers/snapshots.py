"""A run's snapshot folder: ``snapshot_<iteration>.npz`` files and ``log.csv``.

:func:`prepare` decides, before training, whether a run continues what the folder holds
(resumed from its newest snapshot, or from a snapshot the user loaded) or starts anew
(refused when the folder holds another run's files, unless told to delete them);
:func:`write` adds a snapshot and keeps the newest few. Under MPI every rank calls both
(a snapshot gathers every rank's generators); only rank 0 touches the files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from latte.compiler.cache import remove_temps
from latte.errors import LatteError
from latte.runtime import distributed

LOG = "log.csv"
_NAME = re.compile(r"snapshot_(\d+)\.npz")


def snapshot_path(directory, iteration: int) -> Path:
    """Where the snapshot taken after ``iteration`` iterations goes."""
    return Path(directory) / f"snapshot_{iteration:06d}.npz"


def snapshots(directory) -> list[Path]:
    """The snapshots in ``directory``, oldest (fewest iterations) first."""
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), Path(directory) / name) for name in os.listdir(directory)
             if (m := _NAME.fullmatch(name))]
    return [path for _, path in sorted(found)]


def newest_snapshot(directory) -> Path | None:
    """The snapshot with the most iterations in ``directory`` (None: there is none)."""
    found = snapshots(directory)
    return found[-1] if found else None


def prepare(net, directory, *, resume: bool, overwrite: bool) -> None:
    """Make ``directory`` ready for ``net``'s run: with ``resume`` load its newest snapshot
    (if there is none, start anew); a net not resumed (nothing loaded) starts anew, which
    needs a folder without another run's snapshots and log, or ``overwrite`` (or ``resume``
    without a snapshot): they are deleted. Temporary files of interrupted snapshot writes
    are removed."""
    found = [str(p) for p in snapshots(directory)]
    log = os.path.join(directory, LOG)
    if os.path.exists(log):
        found.append(log)
    found = distributed.bcast(found)   # every rank acts on what rank 0 saw (rank 0 deletes)
    saved = [f for f in found if f.endswith(".npz")]
    if resume and not net.solver_state and saved:
        net.load(saved[-1])
    elif not net.solver_state and found:
        if not (overwrite or resume):   # resuming a run that wrote no snapshot: start over
            names = ", ".join(os.path.basename(f) for f in found[-3:])
            raise LatteError(f"snapshot dir {os.fspath(directory)!r} holds another run's files "
                             f"({len(found)}: ...{names}): continue it with `latte run "
                             "--resume` (SolverParameters(resume=True)) or delete them with "
                             "`--overwrite` (overwrite=True), or choose another snapshot_dir")
        if distributed.rank() == 0:
            for f in found:
                os.unlink(f)
    if distributed.rank() == 0 and os.path.isdir(directory):
        remove_temps(Path(directory), "snapshot_*.npz")


def write(net, directory, iteration: int, keep: int) -> None:
    """Snapshot ``net`` after ``iteration`` iterations, then delete all but the newest
    ``keep`` snapshots (the new one is whole on disk before any old one goes)."""
    net.save(snapshot_path(directory, iteration))
    if distributed.rank() == 0:
        for old in snapshots(directory)[:-keep]:
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass
