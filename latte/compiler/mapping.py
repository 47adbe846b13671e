"""Mapping analysis: mapping functions -> affine access relations (paper section 5.2).

A mapping is an ordinary Python callable. Per source dimension we fit ``lo + step * t``
(``0 <= t < length``) with ``lo`` affine in the sink index, or quasi-affine: a sink index
``d`` may also appear floor-divided by a constant ``q`` dividing its extent (``o // 4``, the
channel group of a grouped convolution; synthesis strip-mines ``d`` into ``(d // q, d % q)``
and every index is affine again). The fit is proven at every sink neuron,
never sampled: a large ensemble's mapping is called once on symbolic indices
(:mod:`latte.compiler.symbolic`), which gives its result at every neuron at once; a mapping
that cannot be traced, and every mapping of a small ensemble, is called at every neuron and
the fit compared with all results (vectorized). A mapping that is not affine falls back to
an explicit gather table, as does one whose sink dimension would need two different
divisors. isl decides whether the accessed footprint stays inside the source (it reads
``floor(d/q)``). Fields' index maps are fitted the same way, affine only.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import islpy as isl
import numpy as np

from latte.compiler.ir import Affine
from latte.compiler.symbolic import Sym, SymRange, Untraceable, quot_var, split_var, trace
from latte.errors import MappingError, ShapeError

_EXHAUSTIVE = 4096   # ensembles up to this size: call the mapping at every neuron, always
_CHECKS = 64         # random neurons where a real call must agree with the traced form


def sink_var(d: int) -> str:
    """Canonical name of sink dimension ``d`` in fitted affine forms."""
    return f"%{d}"


def sink_dim(var: str) -> tuple[int, int]:
    """``(d, q)`` of a fitted form's variable: sink dimension ``d`` floor-divided by ``q``."""
    name, q = split_var(var)
    return int(name[1:]), q


def quotients(forms) -> dict[int, int] | None:
    """The divisor of each sink dimension the affine ``forms`` floor-divide (None when one
    dimension is divided by two different constants: no strip-mining makes both affine)."""
    out: dict[int, int] = {}
    for form in forms:
        for var in form.vars:
            d, q = sink_dim(var)
            if q > 1 and out.setdefault(d, q) != q:
                return None
    return out


def value_at(form: Affine, idx: tuple[int, ...]) -> int:
    """A fitted form's value at sink neuron ``idx``."""
    out = form.const
    for var, c in form.terms:
        d, q = sink_dim(var)
        out += c * (idx[d] // q)
    return out


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
                     if all(sink_dim(v)[0] != d for a in self.dims for v in a.lo.vars))

    def quotients(self) -> dict[int, int]:
        """Sink dimension -> the constant the access floor-divides it by."""
        return {} if self.dims is None else quotients(a.lo for a in self.dims)


def _points(shape: tuple[int, ...]):
    """Every index of ``shape``, row-major."""
    return itertools.product(*(range(d) for d in shape))


def _checks(shape: tuple[int, ...], seed: int = 0) -> list[tuple[int, ...]]:
    """Corners, unit steps and a few random indices of ``shape``."""
    pts = set(itertools.product(*({0, d - 1} for d in shape)))
    pts |= {tuple(int(i == d and n > 1) for i in range(len(shape))) for d, n in enumerate(shape)}
    rng = np.random.default_rng(seed)
    pts |= {tuple(int(x) for x in p) for p in rng.integers(0, shape, size=(_CHECKS, len(shape)))}
    return sorted(pts)


def _fit_all(values: np.ndarray, shape: tuple[int, ...], quasi: bool = False) -> Affine | None:
    """The affine form ``c0 + sum c_d idx_d`` equal to ``values`` (row-major over ``shape``)
    at every index, or None: fitted from the origin and unit steps, compared everywhere.
    With ``quasi``, a dimension may also contribute ``b_d * (idx_d // q_d)``, ``q_d`` the
    first step along ``d`` where the linear term alone stops fitting (it must divide the
    extent)."""
    grid = values.reshape(shape)
    c0 = int(grid[(0,) * len(shape)])
    coeffs, pred = {}, np.full(shape, c0, dtype=np.int64)
    for d, extent in enumerate(shape):
        if extent == 1:
            continue
        line = grid[tuple(slice(None) if i == d else 0 for i in range(len(shape)))] - c0
        steps = np.arange(extent)
        c = int(line[1])
        coeffs[sink_var(d)] = c
        fitted = c * steps
        off = np.flatnonzero(line != fitted)
        if off.size:
            q = int(off[0])
            if not quasi or extent % q:
                return None
            coeffs[quot_var(sink_var(d), q)] = int(line[q]) - c * q
            fitted = fitted + coeffs[quot_var(sink_var(d), q)] * (steps // q)
        pred += fitted.reshape([-1 if i == d else 1 for i in range(len(shape))])
    return Affine.build(coeffs, c0) if np.array_equal(grid, pred) else None


def where(fn) -> str:
    """``file:line: `` of a user's callable (a mapping, an index map), if known."""
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}: " if code is not None else ""


def _entries(conn, idx) -> tuple:
    try:
        out = conn.mapping(*idx)
    except Exception as exc:  # noqa: BLE001 - user code; report where it failed
        raise MappingError(f"{where(conn.mapping)}{conn.describe()}: mapping raised "
                           f"{type(exc).__name__}: {exc} for sink neuron {idx}") from exc
    out = out if isinstance(out, (tuple, list)) else (out,)
    src_ndim = len(conn.source.shape)
    if len(out) != src_ndim:
        raise ShapeError(f"{where(conn.mapping)}{conn.describe()}: mapping returns {len(out)} "
                         f"entries for sink neuron {idx}, but source {conn.source.name!r} has "
                         f"{src_ndim} dimension(s) (shape {conn.source.shape})")
    for e in out:
        if not isinstance(e, (int, np.integer, range)):
            raise MappingError(f"{where(conn.mapping)}{conn.describe()}: mapping entries must be "
                               f"int or range, got {type(e).__name__} for sink neuron {idx}")
    return tuple(e if isinstance(e, range) else range(int(e), int(e) + 1) for e in out)


def _ranges(dims: tuple[DimAccess, ...], idx: tuple[int, ...]) -> tuple[range, ...]:
    """What fitted ``dims`` select for sink neuron ``idx``."""
    return tuple(range(value_at(a.lo, idx), value_at(a.lo, idx) + a.step * a.length, a.step)
                 for a in dims)


def _divisible(form: Affine, shape: tuple[int, ...]) -> Affine | None:
    """A traced form with its quotients checked: ``d // q`` is 0 when ``q`` reaches past the
    extent (dropped); otherwise ``q`` must divide the extent (None if not)."""
    for var in form.vars:
        d, q = sink_dim(var)
        if q >= shape[d]:
            form = form.substitute(var, Affine())
        elif shape[d] % q:
            return None
    return form


def _traced_dims(conn) -> tuple[DimAccess, ...] | None:
    """The mapping's accesses from one symbolic call (None if it cannot be traced, or a real
    call disagrees: a mapping that looks at its arguments' types)."""
    shape = conn.sink.shape
    try:
        out = trace(conn.mapping, [sink_var(d) for d in range(len(shape))])
    except Untraceable:
        return None
    out = out if isinstance(out, (tuple, list)) else (out,)
    dims = []
    for e in out:
        if isinstance(e, SymRange):
            lo = _divisible(e.lo, shape)
            if lo is None:
                return None
            dims.append(DimAccess(lo, e.step, e.length))
        elif isinstance(e, range):
            dims.append(DimAccess(Affine((), e.start), e.step, len(e)))
        elif isinstance(e, (Sym, int, np.integer)) and not isinstance(e, bool):
            lo = _divisible(e.aff, shape) if isinstance(e, Sym) else Affine((), int(e))
            if lo is None:
                return None
            dims.append(DimAccess(lo, 1, 1))
        else:
            return None
    if len(dims) != len(conn.source.shape):
        return None
    dims = tuple(dims)
    if any(_entries(conn, idx) != _ranges(dims, idx) for idx in _checks(shape)):
        return None
    return dims


def _evaluated_dims(conn) -> tuple[DimAccess, ...] | None:
    """The mapping called at every sink neuron; the fit compared with every result."""
    shape = conn.sink.shape
    rows = np.array([[(r.start, r.step, len(r)) for r in _entries(conn, idx)]
                     for idx in _points(shape)], dtype=np.int64)
    dims = []
    for j in range(len(conn.source.shape)):
        starts, steps, lengths = rows[:, j, 0], rows[:, j, 1], rows[:, j, 2]
        if (steps != steps[0]).any() or (lengths != lengths[0]).any():
            return None
        lo = _fit_all(starts, shape, quasi=True)
        if lo is None:
            return None
        dims.append(DimAccess(lo, int(steps[0]), int(lengths[0])))
    return tuple(dims)


def _relation(sink_shape, src_shape, dims: tuple[DimAccess, ...]) -> isl.Map:
    d = [f"d{i}" for i in range(len(sink_shape))]
    s = [f"s{j}" for j in range(len(src_shape))]
    t = [f"t{j}" for j in range(len(src_shape))]

    def aff(a: Affine) -> str:
        terms = []
        for v, c in a.terms:
            dim, q = sink_dim(v)
            terms.append(f"{c}*d{dim}" if q == 1 else f"{c}*floor(d{dim}/{q})")
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
    origin = (0,) * len(sink_shape)
    dims = _traced_dims(conn) if int(np.prod(sink_shape)) > _EXHAUSTIVE else None
    if dims is None:
        dims = _evaluated_dims(conn)
    if dims is None or quotients(a.lo for a in dims) is None:
        return _gather(conn)
    if any(a.length == 0 for a in dims):
        raise MappingError(f"{where(conn.mapping)}{conn.describe()}: mapping selects no source "
                           "neuron for sink "
                           f"neuron {origin}")
    rel = _relation(sink_shape, src_shape, dims)
    outside = rel.intersect_range(_box(src_shape).complement())
    in_bounds = outside.is_empty()
    if not in_bounds and conn.padding is None:
        pt = outside.domain().sample_point()
        idx = tuple(int(pt.get_coordinate_val(isl.dim_type.set, i).to_python())
                    for i in range(len(sink_shape)))
        raise MappingError(f"{where(conn.mapping)}{conn.describe()}: sink neuron {idx} of "
                           f"{conn.sink.name!r} reads {tuple(conn.mapping(*idx))} outside source "
                           f"{conn.source.name!r} "
                           f"(shape {src_shape}); pass padding= to add_connections to allow it")
    return ConnAccess(conn, dims, None, in_bounds, rel)


def analyze_connections(conns) -> list[ConnAccess]:
    """:func:`analyze_connection` for every connection into one ensemble; where two of them
    floor-divide a sink dimension by different constants (synthesis can strip-mine it only
    one way), the later ones read through gather tables."""
    out, chosen = [], {}
    for conn in conns:
        access = analyze_connection(conn)
        q = access.quotients()
        if any(chosen.get(d, n) != n for d, n in q.items()):
            access = _gather(conn)
        else:
            chosen.update(q)
        out.append(access)
    return out


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
            raise MappingError(f"{where(conn.mapping)}{conn.describe()}: sink neuron {idx} reads "
                               f"{len(grid)} source "
                               f"neurons but neuron {(0,) * len(sink_shape)} reads {length}; "
                               "every sink neuron must read the same number")
        ok = ((grid >= 0) & (grid < np.array(src_shape))).all(axis=1)
        if not ok.all():
            if conn.padding is None:
                raise MappingError(f"{where(conn.mapping)}{conn.describe()}: sink neuron {idx} of "
                                   f"{conn.sink.name!r} "
                                   f"reads {tuple(int(v) for v in grid[~ok][0])} outside source "
                                   f"{conn.source.name!r} (shape {src_shape}); pass padding= "
                                   "to add_connections to allow it")
            in_bounds = False
        flat = np.ravel_multi_index(tuple(np.clip(grid, 0, np.array(src_shape) - 1).T), src_shape)
        rows.append(np.where(ok, flat, -1))
    return ConnAccess(conn, None, np.array(rows, dtype=np.int32), in_bounds, None)


def fit_index_map(ens, field) -> tuple[Affine, ...]:
    """Affine form of a field's ``index_map`` (identity when none was given), proven at every
    neuron and bounds-checked; computed once per field (synthesis asks for each phase)."""
    fit = _FITS.get(field)
    if fit is None:
        fit = _FITS[field] = _fit_index_map(ens, field)
    return fit


_FITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fit_index_map(ens, field) -> tuple[Affine, ...]:
    shape = ens.shape
    if field.index_map is None:
        return tuple(Affine.of(sink_var(d)) for d in range(len(shape)))
    fits = _traced_index_map(ens, field) if int(np.prod(shape)) > _EXHAUSTIVE else None
    if fits is None:
        values = np.array([_index_map_at(ens, field, p) for p in _points(shape)], np.int64)
        fits = tuple(_fit_all(values[:, j], shape) for j in range(field.lead_ndim))
        if any(f is None for f in fits):
            raise ShapeError(f"{where(field.index_map)}ensemble {ens.name!r}: index_map of field "
                             f"{field.name!r} is not affine in the neuron index")
    box = {sink_var(d): (0, n - 1) for d, n in enumerate(shape)}
    for fit, n in zip(fits, field.array.shape):
        lo, hi = fit.bounds(box)
        if lo < 0 or hi >= n:   # an affine form's extremes lie at corners: name one
            low = lo < 0
            p = tuple(0 if (fit.coef(sink_var(d)) >= 0) == low else e - 1
                      for d, e in enumerate(shape))
            raise ShapeError(f"{where(field.index_map)}ensemble {ens.name!r}: index_map of field "
                             f"{field.name!r} returns {field.index_map(*p)} for neuron {p}, "
                             f"outside the array's shape {field.array.shape}")
    return fits


def _index_map_at(ens, field, p: tuple[int, ...]) -> tuple[int, ...]:
    v = field.index_map(*p)
    v = v if isinstance(v, tuple) else (v,)
    if len(v) != field.lead_ndim or not all(isinstance(x, (int, np.integer)) for x in v):
        raise ShapeError(f"{where(field.index_map)}ensemble {ens.name!r}: index_map of field "
                         f"{field.name!r} must return {field.lead_ndim} int(s) for every neuron; "
                         f"got {v!r} for neuron {p}")
    return tuple(int(x) for x in v)


def _traced_index_map(ens, field) -> tuple[Affine, ...] | None:
    """The index map's affine forms from one symbolic call (None: not traceable, or a real
    call disagrees)."""
    try:
        out = trace(field.index_map, [sink_var(d) for d in range(len(ens.shape))])
    except Untraceable:
        return None
    out = out if isinstance(out, tuple) else (out,)
    if len(out) != field.lead_ndim or not all(
            isinstance(x, (Sym, int, np.integer)) and not isinstance(x, bool) for x in out):
        return None
    fits = tuple(x.aff if isinstance(x, Sym) else Affine((), int(x)) for x in out)
    if any(sink_dim(v)[1] > 1 for f in fits for v in f.vars):   # a quotient: not affine
        return None
    for p in _checks(ens.shape):
        at = {sink_var(d): (i, i) for d, i in enumerate(p)}
        if _index_map_at(ens, field, p) != tuple(f.bounds(at)[0] for f in fits):
            return None
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
