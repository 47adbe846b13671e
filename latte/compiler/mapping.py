"""Mapping analysis: mapping functions -> affine access relations (paper section 5.2).

A mapping is an ordinary Python callable. We evaluate it on concrete sink indices, fit per
source dimension ``lo + step * t`` (``0 <= t < length``) with ``lo`` affine in the sink
index, verify the fit on many points (all of them for small ensembles), and build an isl
map. A mapping that is not affine falls back to an explicit gather table. isl decides
whether the accessed footprint stays inside the source.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import islpy as isl
import numpy as np

from latte.compiler.ir import Affine
from latte.errors import MappingError, ShapeError

_EXHAUSTIVE = 4096   # check every sink index of ensembles up to this size
_SAMPLES = 2048


def sink_var(d: int) -> str:
    """Canonical name of sink dimension ``d`` in fitted affine forms."""
    return f"%{d}"


@dataclass(frozen=True)
class DimAccess:
    """Source dimension ``j`` reads ``lo + step * t`` for ``0 <= t < length``."""

    lo: Affine
    step: int
    length: int


@dataclass(frozen=True, eq=False)
class ConnAccess:
    """What one connection reads, per sink neuron."""

    conn: object
    dims: tuple[DimAccess, ...] | None     # None: not affine, see ``table``
    table: np.ndarray | None               # (sink.size, length) flat source offsets, -1 = pad
    in_bounds: bool                        # no index ever leaves the source
    relation: isl.Map | None               # { sink[d] -> source[s] }

    @property
    def length(self) -> int:
        if self.dims is None:
            return int(self.table.shape[1])
        return int(np.prod([d.length for d in self.dims]))

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the input vector (row-major over source dims)."""
        return (self.length,) if self.dims is None else tuple(d.length for d in self.dims)

    def shared_dims(self) -> tuple[int, ...]:
        """Sink dimensions along which every neuron reads the same source values."""
        ndim = len(self.conn.sink.shape)
        if self.dims is None:
            t = self.table.reshape(self.conn.sink.shape + (-1,))
            return tuple(d for d in range(ndim) if t.shape[d] == 1
                         or (t == t.take([0], axis=d)).all())
        return tuple(d for d in range(ndim)
                     if all(a.lo.coef(sink_var(d)) == 0 for a in self.dims))


def _sample_points(shape: tuple[int, ...], seed: int = 0):
    size = int(np.prod(shape))
    if size <= _EXHAUSTIVE:
        return list(itertools.product(*(range(d) for d in shape)))
    corners = list(itertools.product(*({0, d - 1} for d in shape)))
    rng = np.random.default_rng(seed)
    rand = [tuple(int(x) for x in p) for p in rng.integers(0, shape, size=(_SAMPLES, len(shape)))]
    return corners + rand


def _fit(values: dict[tuple, int], shape: tuple[int, ...]) -> Affine | None:
    """Fit ``values[idx] = c0 + sum c_d idx_d`` from the origin and unit steps; verify all."""
    origin = (0,) * len(shape)
    c0 = values[origin]
    coeffs = {}
    for d, extent in enumerate(shape):
        if extent > 1:
            unit = tuple(1 if i == d else 0 for i in range(len(shape)))
            if unit not in values:
                return None
            coeffs[sink_var(d)] = values[unit] - c0
    fit = Affine.build(coeffs, c0)
    for idx, v in values.items():
        if c0 + sum(coeffs.get(sink_var(d), 0) * i for d, i in enumerate(idx)) != v:
            return None
    return fit


def _entries(conn, idx) -> tuple:
    try:
        out = conn.mapping(*idx)
    except Exception as exc:  # noqa: BLE001 - user code; report where it failed
        raise MappingError(f"{conn.describe()}: mapping raised {type(exc).__name__}: {exc} "
                           f"for sink neuron {idx}") from exc
    out = out if isinstance(out, (tuple, list)) else (out,)
    src_ndim = len(conn.source.shape)
    if len(out) != src_ndim:
        raise ShapeError(f"{conn.describe()}: mapping returns {len(out)} entries for sink neuron "
                         f"{idx}, but source {conn.source.name!r} has {src_ndim} dimension(s) "
                         f"(shape {conn.source.shape})")
    for e in out:
        if not isinstance(e, (int, np.integer, range)):
            raise MappingError(f"{conn.describe()}: mapping entries must be int or range, got "
                               f"{type(e).__name__} for sink neuron {idx}")
    return tuple(e if isinstance(e, range) else range(int(e), int(e) + 1) for e in out)


def _relation(sink_shape, src_shape, dims: tuple[DimAccess, ...]) -> isl.Map:
    d = [f"d{i}" for i in range(len(sink_shape))]
    s = [f"s{j}" for j in range(len(src_shape))]
    t = [f"t{j}" for j in range(len(src_shape))]

    def aff(a: Affine) -> str:
        terms = [f"{c}*d{v[1:]}" for v, c in a.terms]
        return " + ".join(terms + [str(a.const)])

    cons = [f"0 <= {x} < {n}" for x, n in zip(d, sink_shape)]
    cons += [f"0 <= {tj} < {a.length} and {sj} = {aff(a.lo)} + {a.step}*{tj}"
             for sj, tj, a in zip(s, t, dims)]
    return isl.Map(f"{{ [{', '.join(d)}] -> [{', '.join(s)}] : exists ({', '.join(t)} : "
                   f"{' and '.join(cons)}) }}")


def _box(shape) -> isl.Set:
    s = [f"s{j}" for j in range(len(shape))]
    return isl.Set(f"{{ [{', '.join(s)}] : {' and '.join(f'0 <= {x} < {n}' for x, n in zip(s, shape))} }}")


def analyze_connection(conn) -> ConnAccess:
    """Fit the connection's mapping; raise if it reads outside the source without padding."""
    sink_shape, src_shape = conn.sink.shape, conn.source.shape
    points = _sample_points(sink_shape)
    ranges = {p: _entries(conn, p) for p in points}
    origin = (0,) * len(sink_shape)
    for axis in range(len(sink_shape)):  # the fit needs the unit points
        unit = tuple(1 if i == axis else 0 for i in range(len(sink_shape)))
        if sink_shape[axis] > 1 and unit not in ranges:
            ranges[unit] = _entries(conn, unit)
    dims = []
    for j in range(len(src_shape)):
        steps = {r[j].step for r in ranges.values()}
        lengths = {len(r[j]) for r in ranges.values()}
        lo = _fit({p: r[j].start for p, r in ranges.items()}, sink_shape) \
            if len(steps) == 1 and len(lengths) == 1 else None
        if lo is None:
            dims = None
            break
        dims.append(DimAccess(lo, steps.pop(), lengths.pop()))
    if dims is None:
        return _gather(conn)
    dims = tuple(dims)
    if any(a.length == 0 for a in dims):
        raise MappingError(f"{conn.describe()}: mapping selects no source neuron for sink "
                           f"neuron {origin}")
    rel = _relation(sink_shape, src_shape, dims)
    outside = rel.intersect_range(_box(src_shape).complement())
    in_bounds = outside.is_empty()
    if not in_bounds and conn.padding is None:
        pt = outside.domain().sample_point()
        idx = tuple(int(pt.get_coordinate_val(isl.dim_type.set, i).to_python())
                    for i in range(len(sink_shape)))
        raise MappingError(f"{conn.describe()}: sink neuron {idx} of {conn.sink.name!r} reads "
                           f"{tuple(conn.mapping(*idx))} outside source {conn.source.name!r} "
                           f"(shape {src_shape}); pass padding= to add_connections to allow it")
    return ConnAccess(conn, dims, None, in_bounds, rel)


def _gather(conn) -> ConnAccess:
    """Explicit table of flat source offsets, for mappings that are not affine."""
    sink_shape, src_shape = conn.sink.shape, conn.source.shape
    rows, length, in_bounds = [], None, True
    for idx in itertools.product(*(range(d) for d in sink_shape)):
        grid = np.stack(np.meshgrid(*[np.array(r) for r in _entries(conn, idx)], indexing="ij"),
                        -1).reshape(-1, len(src_shape))
        if length is None:
            length = len(grid)
        if len(grid) != length:
            raise MappingError(f"{conn.describe()}: sink neuron {idx} reads {len(grid)} source "
                               f"neurons but neuron {(0,) * len(sink_shape)} reads {length}; "
                               "every sink neuron must read the same number")
        ok = ((grid >= 0) & (grid < np.array(src_shape))).all(axis=1)
        if not ok.all():
            if conn.padding is None:
                raise MappingError(f"{conn.describe()}: sink neuron {idx} of {conn.sink.name!r} "
                                   f"reads {tuple(grid[~ok][0])} outside source "
                                   f"{conn.source.name!r} (shape {src_shape}); pass padding= "
                                   "to add_connections to allow it")
            in_bounds = False
        flat = np.ravel_multi_index(tuple(np.clip(grid, 0, np.array(src_shape) - 1).T), src_shape)
        rows.append(np.where(ok, flat, -1))
    return ConnAccess(conn, None, np.array(rows, dtype=np.int32), in_bounds, None)


def fit_index_map(ens, field) -> tuple[Affine, ...]:
    """Affine form of a field's ``index_map`` (identity when none was given), bounds-checked."""
    shape = ens.shape
    if field.index_map is None:
        return tuple(Affine.of(sink_var(d)) for d in range(len(shape)))
    points = _sample_points(shape)
    for axis in range(len(shape)):
        unit = tuple(1 if i == axis else 0 for i in range(len(shape)))
        if shape[axis] > 1 and unit not in points:
            points.append(unit)
    values = {}
    for p in points:
        v = field.index_map(*p)
        v = v if isinstance(v, tuple) else (v,)
        if len(v) != field.lead_ndim or not all(isinstance(x, (int, np.integer)) for x in v):
            raise ShapeError(f"ensemble {ens.name!r}: index_map of field {field.name!r} must return "
                             f"{field.lead_ndim} int(s) for every neuron; got {v!r} for neuron {p}")
        for x, n in zip(v, field.array.shape):
            if not 0 <= x < n:
                raise ShapeError(f"ensemble {ens.name!r}: index_map of field {field.name!r} returns "
                                 f"{v} for neuron {p}, outside the array's shape {field.array.shape}")
        values[p] = v
    fits = tuple(_fit({p: v[j] for p, v in values.items()}, shape) for j in range(field.lead_ndim))
    if any(f is None for f in fits):
        raise ShapeError(f"ensemble {ens.name!r}: index_map of field {field.name!r} is not affine "
                         "in the neuron index")
    return fits


def tile_local(access: ConnAccess, sink_dim: int, sink_rows: int, src_dim: int, src_rows: int,
               tiles: int, lag: int = 0) -> bool:
    """Does tile ``T`` of the sink (rows ``[T*sink_rows, (T+1)*sink_rows)`` of ``sink_dim``)
    read only tiles ``T-lag .. T+lag`` of the source (``src_rows`` rows each along
    ``src_dim``), for every ``0 <= T < tiles``? Decided by isl on the access relation, with
    ``T`` as a parameter. With ``lag = 0``, padding falls outside every tile: the answer is no."""
    if access.dims is None:
        return False
    rel = access.relation
    n_in = rel.dim(isl.dim_type.in_)
    n_out = rel.dim(isl.dim_type.out)
    d = [f"d{i}" for i in range(n_in)]
    s = [f"s{j}" for j in range(n_out)]
    tile = isl.Set(f"[T] -> {{ [{', '.join(d)}] : 0 <= T < {tiles} and "
                   f"T*{sink_rows} <= d{sink_dim} < T*{sink_rows} + {sink_rows} }}")
    allowed = isl.Set(f"[T] -> {{ [{', '.join(s)}] : (T - {lag})*{src_rows} <= s{src_dim} "
                      f"< (T + {lag + 1})*{src_rows} }}")
    reads = rel.align_params(tile.get_space()).intersect_domain(tile).range()
    return reads.is_subset(allowed.align_params(reads.get_space()))
