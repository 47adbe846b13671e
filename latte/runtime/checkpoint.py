"""Snapshots: everything training needs to go on exactly as if it had never stopped.

A snapshot is an ``.npz`` file (written atomically: a whole old file or a whole new one)
holding

- ``value/<param>``, ``<solver state>/<param>`` (SGD's ``history``, Adam's ``exp_avg``...)
  and ``state/<name>`` (``net.state``): float32 arrays, finite;
- ``__state__``: the solver's progress (``net.solver_state``, JSON);
- ``__latte__``: a JSON header: the format, every rank's random generators (the net's,
  and every ensemble's ``rng``, e.g. dropout's), and every data source's position (its
  ``snapshot()``; the arrays it returns are ``source/<i>/<key>``).

:func:`load` reads and checks the whole file against the net before it changes anything:
a file that is not a latte snapshot, is damaged or truncated, or lacks a key the net needs
is a :class:`~latte.errors.DataError` naming the path and what is wrong. A snapshot from
before the header existed (``__state__`` and arrays only) loads its arrays and progress.

Under MPI :func:`save` is collective (each rank's generators differ: dropout masks are
per rank); rank 0 writes the file.
"""

from __future__ import annotations

import io
import json
import os
import warnings
import zipfile
from pathlib import Path

import numpy as np

from latte.compiler.cache import remove_temps, write_atomic
from latte.errors import DataError, TrainingError
from latte.runtime import distributed

FORMAT, VERSION = "latte-snapshot", 1
HEADER, PROGRESS = "__latte__", "__state__"
_NOT_SOLVER = ("value", "state", "source")   # array prefixes that are not solver states


# ---------------------------------------------------------------- what a net holds
def generators(net) -> dict[str, np.random.Generator]:
    """The net's random generators by name: its own and every ensemble's ``rng``."""
    gens = {"net": net.rng}
    for e in net.ensembles:
        if isinstance(getattr(e, "rng", None), np.random.Generator):
            gens[f"ensemble:{e.name}"] = e.rng
    return gens


def _sources(net) -> list:
    """The data sources that have a position to keep (``snapshot``/``restore``)."""
    return [s for s in net.data_sources() if hasattr(s, "snapshot")]


def _arrays(net) -> dict[str, np.ndarray]:
    """The live float arrays a snapshot holds, by key."""
    arrays = {f"value/{p.name}": p.value for p in net.params}
    arrays |= {f"{k}/{p.name}": a for p in net.params for k, a in sorted(p.state.items())}
    return arrays | {f"state/{name}": a for name, a in net.state.items()}


# ---------------------------------------------------------------- save
def save(net, path) -> None:
    """Write ``net``'s snapshot to ``path`` atomically (collective under MPI). Raises
    :class:`~latte.errors.TrainingError`, writing nothing, when an array is not finite."""
    path = Path(os.path.abspath(path))
    mine = {name: g.bit_generator.state for name, g in generators(net).items()}
    ranks = distributed.gather(mine)
    if distributed.rank() != 0:
        return
    arrays = _arrays(net)
    for key, a in arrays.items():
        if not np.isfinite(a).all():
            raise TrainingError(f"snapshot {str(path)!r} not written: {key!r} holds a NaN or an "
                                "infinity (the last snapshot written stays)")
    sources = []
    for i, s in enumerate(_sources(net)):
        info, extra = s.snapshot()
        sources.append(info)
        arrays |= {f"source/{i}/{k}": v for k, v in extra.items()}
    header = {"format": FORMAT, "version": VERSION, "ranks": ranks, "sources": sources}
    buf = io.BytesIO()
    np.savez(buf, **{HEADER: np.array(json.dumps(header)),
                     PROGRESS: np.array(json.dumps(net.solver_state))}, **arrays)
    remove_temps(path.parent, path.name)   # an interrupted earlier write of this file
    write_atomic(path, buf.getvalue())


# ---------------------------------------------------------------- load
def read(path) -> dict[str, np.ndarray]:
    """Every array of the snapshot at ``path`` (each zip member's checksum verified)."""
    where = os.fspath(path)
    if not os.path.exists(where):
        raise DataError(f"snapshot {where!r} does not exist")
    try:
        with np.load(where, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise DataError(f"snapshot {where!r} cannot be read ({type(exc).__name__}: {exc}); it "
                        "is damaged, truncated or not a latte snapshot") from None
    if not isinstance(arrays, dict) or PROGRESS not in arrays:
        raise DataError(f"snapshot {where!r} is not a latte snapshot (no {PROGRESS!r} entry)")
    return arrays


def load(net, path) -> None:
    """Restore ``net`` from the snapshot at ``path``, checked whole before anything changes."""
    where = os.fspath(path)
    data = read(path)
    copies, restores = _check(net, data, where)
    for dest, src in copies:
        (dest() if callable(dest) else dest)[...] = src
    for restore in restores:
        restore()


def _bad(where: str, what: str) -> DataError:
    return DataError(f"snapshot {where!r} {what}")


def _json(data: dict, key: str, where: str):
    try:
        return json.loads(str(data[key][()]))
    except (ValueError, TypeError, IndexError) as exc:
        raise _bad(where, f"has a damaged {key!r} entry ({exc})") from None


def _check(net, data: dict, where: str) -> tuple[list, list]:
    """What loading copies (``(live array, saved array)`` pairs) and the restores of
    positions and generators to run after, once every check has passed."""
    progress = _json(data, PROGRESS, where)
    if not isinstance(progress, dict):
        raise _bad(where, f"has a damaged {PROGRESS!r} entry (not an object)")
    saved_kinds = {(kind, name) for kind, _, name in (k.partition("/") for k in data)
                   if name and kind not in _NOT_SOLVER}
    copies = []   # (the live array, or a function giving it, and the saved array)
    for p in net.params:
        kinds = sorted({k for k, name in saved_kinds if name == p.name})
        for kind in set(p.state) - set(kinds):   # a state the snapshot's solver had not
            copies.append((p.state[kind], np.zeros((), np.float32)))
        copies.append((p.value, _array(data, f"value/{p.name}", p.value.shape, where)))
        copies += [(lambda p=p, k=k: p.solver_state(k),
                    _array(data, f"{k}/{p.name}", p.value.shape, where)) for k in kinds]
    copies += [(a, _array(data, f"state/{name}", a.shape, where)) for name, a in net.state.items()]
    restores = [lambda: setattr(net, "solver_state", progress)]
    if HEADER in data:
        restores += _check_header(net, data, _json(data, HEADER, where), where)
    return copies, restores


def _array(data: dict, key: str, shape: tuple, where: str) -> np.ndarray:
    if key not in data:
        raise _bad(where, f"has no {key!r} (it is another net's snapshot, or incomplete)")
    a = data[key]
    if a.shape != tuple(shape):
        raise _bad(where, f"{key!r} has shape {a.shape}, the net expects {tuple(shape)}")
    if a.dtype != np.float32:
        raise _bad(where, f"{key!r} has dtype {a.dtype}, not float32")
    if not np.isfinite(a).all():
        raise _bad(where, f"{key!r} holds a NaN or an infinity")
    return a


def _check_header(net, data: dict, header, where: str) -> list:
    """The restores of generators and data positions the header holds."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _bad(where, f"is not a latte snapshot (its {HEADER!r} header is foreign)")
    if header.get("version") != VERSION:
        raise _bad(where, f"has format version {header.get('version')!r}; this latte reads "
                   f"version {VERSION}")
    ranks, infos = header.get("ranks"), header.get("sources")
    if not isinstance(ranks, list) or not ranks or not isinstance(infos, list):
        raise _bad(where, "has a damaged header (no ranks or sources)")
    size = distributed.world_size()
    if len(ranks) != size:
        warnings.warn(f"snapshot {where!r} was written by {len(ranks)} rank(s), this run has "
                      f"{size}: parameters and progress are restored, random generators and "
                      "data positions are not", RuntimeWarning, stacklevel=4)
        return []
    restores = []
    mine = ranks[distributed.rank()]
    for name, gen in generators(net).items():
        state = mine.get(name) if isinstance(mine, dict) else None
        if state is None:
            raise _bad(where, f"has no state for the random generator {name!r}")
        try:   # try it on a scratch generator of the same kind
            type(gen.bit_generator)().state = state
        except (TypeError, ValueError, KeyError) as exc:
            raise _bad(where, f"has a damaged state for the random generator {name!r} "
                       f"({exc})") from None
        restores.append(lambda bg=gen.bit_generator, st=state: setattr(bg, "state", st))
    for i, source in enumerate(_sources(net)):
        info = infos[i] if i < len(infos) else None
        arrays = {k.split("/", 2)[2]: v for k, v in data.items()
                  if k.startswith(f"source/{i}/")}
        try:
            restore = source.restorer(info, arrays)
        except ValueError as exc:
            raise _bad(where, f"data source {i}: {exc}") from None
        restores.append(restore)
    return restores
