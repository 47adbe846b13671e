"""What the neurons of one ensemble see, laid out for the interpreter: their input vectors
(one gather table per connection, built by calling the mapping at every sink neuron), their
fields (one array row per neuron, from the field's index map) and their value and gradient.

A *lane* is one (batch item, neuron) pair; the interpreter's arrays broadcast to
``lanes = (batch, neurons)``. Neurons are numbered row-major over the ensemble's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import numpy as np

from latte.compiler.frontend import NeuronRef
from latte.errors import MappingError, NeuronRuntimeError, ShapeError
from latte.lang import Connection, FieldData, FieldKind
from latte.reference import rounding, tape

Mask = Union[bool, np.ndarray]   # True: every lane; else a bool array broadcasting to lanes


@dataclass(frozen=True, eq=False)
class Table:
    """Connection ``k`` as its sink neurons read it: ``cols[i, n]`` is the flat source index
    of element ``i`` of neuron ``n``'s input vector; ``valid`` (None: all) says which lie
    inside the source (the others read ``padding``, and their gradients go nowhere)."""

    conn: Connection
    cols: np.ndarray
    valid: np.ndarray | None

    @property
    def length(self) -> int:
        return self.cols.shape[0]


def _entries(conn: Connection, idx: tuple[int, ...]) -> tuple[range, ...]:
    try:
        out = conn.mapping(*idx)
    except Exception as exc:  # noqa: BLE001 - user code; say where it failed
        raise MappingError(f"{conn.describe()}: mapping raised {type(exc).__name__}: {exc} "
                           f"for sink neuron {idx}") from exc
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(out) != len(conn.source.shape):
        raise ShapeError(f"{conn.describe()}: mapping returns {len(out)} entries for sink neuron "
                         f"{idx}, but source {conn.source.name!r} has shape {conn.source.shape}")
    if not all(isinstance(e, (int, np.integer, range)) and not isinstance(e, bool) for e in out):
        raise MappingError(f"{conn.describe()}: mapping entries must be int or range, got "
                           f"{out!r} for sink neuron {idx}")
    return tuple(e if isinstance(e, range) else range(int(e), int(e) + 1) for e in out)


def gather_table(conn: Connection) -> Table:
    """Call ``conn.mapping`` at every sink neuron and tabulate what each one reads."""
    sink, src = conn.sink.shape, conn.source.shape
    entries = [_entries(conn, idx) for idx in np.ndindex(*sink)]
    lengths = {tuple(len(r) for r in e) for e in entries}
    if len(lengths) == 1:   # the usual case: one window shape, vectorized over neurons
        starts = np.array([[r.start for r in e] for e in entries], np.int64).reshape(-1, len(src))
        steps = np.array([[r.step for r in e] for e in entries], np.int64).reshape(-1, len(src))
        grid = np.stack(np.meshgrid(*(np.arange(n) for n in lengths.pop()), indexing="ij"),
                        -1).reshape(-1, len(src))
        pos = starts[:, None, :] + steps[:, None, :] * grid[None]
    else:
        pos = [np.stack(np.meshgrid(*(np.arange(r.start, r.stop, r.step) for r in e),
                                    indexing="ij"), -1).reshape(-1, len(src)) for e in entries]
        for idx, p in zip(np.ndindex(*sink), pos):
            if len(p) != len(pos[0]):
                raise MappingError(f"{conn.describe()}: sink neuron {idx} reads {len(p)} source "
                                   f"neurons but neuron {(0,) * len(sink)} reads {len(pos[0])}; "
                                   "every sink neuron must read the same number")
        pos = np.stack(pos)                                         # (N, L, D)
    if pos.shape[1] == 0:
        raise MappingError(f"{conn.describe()}: the mapping selects no source neuron")
    inside = ((pos >= 0) & (pos < np.array(src))).all(axis=-1)   # (N, L)
    if not inside.all() and conn.padding is None:
        n, i = np.argwhere(~inside)[0]
        where = tuple(int(d) for d in np.unravel_index(n, sink))
        raise MappingError(f"{conn.describe()}: sink neuron {where} of "
                           f"{conn.sink.name!r} reads {tuple(int(p) for p in pos[n, i])} outside "
                           f"source {conn.source.name!r} (shape {src}); pass padding= to "
                           "add_connections to allow it")
    strides = np.array([int(np.prod(src[d + 1:])) for d in range(len(src))], np.int64)
    cols = np.where(inside, pos @ strides, 0)
    return Table(conn, np.ascontiguousarray(cols.T),
                 None if inside.all() else np.ascontiguousarray(inside.T))


def field_rows(ens, f: FieldData) -> np.ndarray:
    """Per neuron, the row of ``f.array`` (leading dims flattened) holding its vector."""
    n = ens.size
    lead = f.array.shape[:f.lead_ndim]
    if f.index_map is None:
        return np.arange(n)
    rows = np.empty(n, np.int64)
    for k, idx in enumerate(np.ndindex(*ens.shape)):
        r = f.index_map(*idx)
        r = tuple(r) if isinstance(r, (tuple, list)) else (r,)
        if (len(r) != len(lead) or not all(isinstance(x, (int, np.integer)) for x in r)
                or not all(0 <= x < d for x, d in zip(r, lead))):
            raise ShapeError(f"ensemble {ens.name!r}: field {f.name!r}'s index map gives {r!r} "
                             f"for neuron {idx}, not an index into its leading dims {lead}")
        rows[k] = np.ravel_multi_index(tuple(int(x) for x in r), lead)
    return rows


@dataclass(eq=False)
class Slot:
    """A field as the neurons see it: ``array`` is ``(rows, vector)`` (``(batch, rows,
    vector)`` for a Batch field), ``grad`` the parameter gradient (None for other kinds),
    ``grad_interval`` its rounding bound, ``(lo, hi, partials)`` shaped alike (None: not
    bounded; see :meth:`Frame.flush`)."""

    data: FieldData
    array: np.ndarray
    rows: np.ndarray
    grad: np.ndarray | None
    grad_interval: tuple | None = None


class Frame:
    """One ensemble's neurons in one phase: value, grad, inputs and fields over all lanes.

    ``sources[k]`` / ``source_grads[k]`` are connection ``k``'s source values and gradients,
    flat ``(batch, source size)`` (a gradient None: nothing flows there). With ``trace`` every
    input and parameter read is a :class:`tape.Node` whose gradient lands where a
    ``grad_inputs``/``grad_<param>`` ``+=`` would put it. With ``intervals`` (the sources'
    rounding bounds, ``(lo, hi)`` shaped like them, and ``grad_intervals`` the source
    gradients', ``(lo, hi, partials)``) every float read and constant is bounded
    (:mod:`latte.reference.rounding`), and every ``+=`` into a gradient widens the
    gradient's bound by the terms' and adds its partial sums' magnitudes; ``value`` and
    ``grad`` then come bounded too. ``jitter(shape)``, when given, draws the factors
    :meth:`rounded` multiplies computed values by.
    """

    def __init__(self, ens, tables: list[Table], sources: list[np.ndarray],
                 source_grads: list[np.ndarray | None], slots: dict[str, Slot], value, grad,
                 batch: int, trace: bool = False, jitter: Callable | None = None,
                 intervals: list[tuple] | None = None,
                 grad_intervals: list[tuple | None] | None = None):
        self.ens, self.tables, self.sources, self.source_grads = ens, tables, sources, source_grads
        self.slots, self.value, self.grad, self.trace = slots, value, grad, trace
        self.jitter = jitter
        self.intervals = intervals
        self.grad_intervals = grad_intervals or [None] * len(tables)
        self.bounded = intervals is not None
        self.overflow = False   # the lanes where a computed value may not fit float32
        self.leaves = [value] if isinstance(value, tape.Node) and value.sink else []
        self.lanes = (batch, ens.size)
        self.loc = None   # the statement being run (ir.Loc), for errors
        # traced Batch field writes at constant indices, so the tape follows a value kept in
        # a field and read back (the arrays hold plain values)
        self.kept: dict[tuple[str, int], object] = {}
        # the terms added into each gradient, in order, until :meth:`flush` adds them
        self.pending: dict[tuple, tuple] = {}

    # ------------------------------------------------------------ errors
    def fail(self, message: str, where: Mask = True) -> NeuronRuntimeError:
        """An error naming the ensemble and the first lane in ``where``."""
        b, n = 0, 0
        if isinstance(where, np.ndarray) and where.any():
            b, n = (int(x) for x in np.argwhere(np.broadcast_to(where, self.lanes))[0])
        neuron = tuple(int(i) for i in np.unravel_index(n, self.ens.shape))
        at = f"{self.loc}: " if self.loc is not None else ""
        return NeuronRuntimeError(f"{at}ensemble {self.ens.name!r} "
                                  f"({self.ens.neuron_type.__name__}), neuron {neuron}, batch "
                                  f"item {b}: {message}")

    def index(self, i, n: int, mask: Mask, what: str):
        """``i`` checked to be an integer in ``[0, n)`` on every lane of ``mask``."""
        v = tape.raw(i)
        if isinstance(i, tape.Node) or not is_int(v):
            raise self.fail(f"{what}: the index is not an integer ({v if np.ndim(v) == 0 else 'a float'})",
                            mask)
        if not isinstance(v, np.ndarray):
            if not 0 <= int(v) < n:
                raise self.fail(f"{what}[{int(v)}] is outside its length {n}", mask)
            return int(v)
        bad = (v < 0) | (v >= n)
        bad = bad if mask is True else bad & mask
        if bad.any():
            lane = tuple(np.argwhere(np.broadcast_to(bad, self.lanes))[0])
            value = np.broadcast_to(v, self.lanes)[lane]
            raise self.fail(f"{what}[{int(value)}] is outside its length {n}", bad)
        return np.clip(v, 0, n - 1).astype(np.int64)

    def flat_index(self, ref: NeuronRef, idx: tuple, mask: Mask):
        """The flat position in ``ref``'s vector (one index, or one per vector dim)."""
        if ref.kind in ("input", "grad_input"):
            return self.index(idx[0], self.tables[ref.conn].length, mask,
                              f"self.{'inputs' if ref.kind == 'input' else 'grad_inputs'}[{ref.conn}]")
        name = ("grad_" if ref.kind == "grad_field" else "") + ref.name
        shape = self.slots[ref.name].data.vector_shape
        if len(idx) == 1:
            return self.index(idx[0], int(np.prod(shape)), mask, f"self.{name}")
        if len(idx) != len(shape):
            raise self.fail(f"self.{name} is indexed with {len(idx)} indices; its vector has "
                            f"shape {shape}", mask)
        flat = 0
        for d, (i, extent) in enumerate(zip(idx, shape)):
            flat = flat * extent + self.index(i, extent, mask, f"self.{name} (dim {d})")
        return flat

    def rounded(self, out):
        """``out``, a computed value, times the jitter's factors where float32 would round
        it (float arrays only: a value that does not vary between lanes is computed alike
        everywhere; a float32 number, such as 0, 1 or ``exp(0)``, comes out exact)."""
        if self.jitter is None or not isinstance(out, np.ndarray) or out.dtype.kind != "f":
            return out
        factors = self.jitter(out.shape)
        with np.errstate(over="ignore"):
            exact = out.astype(np.float32) == out
        return np.where(exact, out, out * factors)

    # ------------------------------------------------------------ reads and writes
    def read(self, ref: NeuronRef, idx: tuple, mask: Mask):
        if ref.kind in ("value", "grad"):
            return getattr(self, ref.kind)
        if ref.kind in ("grad_input", "grad_field"):
            raise self.fail(f"{_show(ref)} can only be accumulated into with += or -=", mask)
        i = self.flat_index(ref, idx, mask)
        if ref.kind == "input":
            t = self.tables[ref.conn]
            cols, valid = self._columns(t, i)
            v = self._gather(self.sources[ref.conn], cols, valid, t.conn.padding)
            iv = (tuple(self._gather(e, cols, valid, t.conn.padding) for e in self.intervals[ref.conn])
                  if self.bounded else None)
            sink = (lambda g: self._scatter(ref.conn, i, g)) if self.trace else None
            return self._leaf(v, sink, iv)
        if isinstance(i, int) and (ref.name, i) in self.kept:
            return self.kept[ref.name, i]
        slot = self.slots[ref.name]
        v = self._field(slot, i)   # float32 values already (Batch fields: exact ones)
        sink = (lambda g: self._to_param(slot, i, g)) if self.trace and slot.grad is not None else None
        return self._leaf(v, sink, (v, v))

    def _leaf(self, v: np.ndarray, sink: Callable | None, iv: tuple | None):
        """A value read: traced to ``sink`` and bounded by ``iv`` as the frame asks."""
        if not (sink or self.bounded):
            return v
        leaf = tape.Node(v, sink=sink, interval=iv if self.bounded else None)
        if sink:
            self.leaves.append(leaf)
        return leaf

    def unbound_overflow(self) -> None:
        """After a traced run's backprop: every value read on a lane where a computed value
        may not fit float32 (:attr:`overflow`) receives an unbounded gradient, for the
        compiler derives its own adjoints, which may multiply that value by a zero where the
        tape never reads it."""
        if np.any(self.overflow):
            iv = (np.where(self.overflow, -np.inf, 0.0), np.where(self.overflow, np.inf, 0.0))
            for leaf in self.leaves:
                leaf.sink(tape.Node(np.zeros(np.shape(iv[0])), interval=iv))

    def note(self, v):
        """``v``, a computed value, after adding the lanes where its bound is infinite to
        :attr:`overflow`."""
        if tape.is_bounded(v):
            wide = ~np.isfinite(v.interval[0]) | ~np.isfinite(v.interval[1])
            if np.any(wide):
                self.overflow = self.overflow | wide
        return v

    def constant(self, c):
        """A constant of the neuron body (bounded: by its float32 rounding)."""
        if self.bounded and isinstance(c, float):
            return tape.Node(c, interval=rounding.exact(c))
        return c

    def write(self, ref: NeuronRef, idx: tuple, value, mask: Mask, merge: Callable) -> None:
        if ref.kind in ("value", "grad"):
            setattr(self, ref.kind, merge(mask, value, getattr(self, ref.kind)))
            return
        if ref.kind != "field" or self.slots[ref.name].data.spec.kind is not FieldKind.BATCH:
            raise self.fail(f"{_show(ref)} cannot be assigned (only value, grad, Batch fields "
                            "and locals; gradients take += or -=)", mask)
        slot, i = self.slots[ref.name], self.flat_index(ref, idx, mask)
        old = self._field(slot, i)
        if self.trace and isinstance(i, int):
            self.kept[ref.name, i] = merge(mask, value, self.kept.get((ref.name, i), old))
        elif self.trace:   # an index that varies: later reads see plain values
            self.kept = {k: v for k, v in self.kept.items() if k[0] != ref.name}
        new = np.broadcast_to(np.where(mask, tape.raw(value), old), self.lanes)
        b = np.arange(self.lanes[0])[:, None]
        slot.array[b, slot.rows[None, :], np.broadcast_to(i, self.lanes)] = new

    def accumulate(self, ref: NeuronRef, idx: tuple, value, op: str, mask: Mask) -> None:
        """``grad_inputs[k][i] op= value`` or ``grad_<param>[i] op= value`` (op + or -)."""
        if op not in "+-":
            raise self.fail(f"{_show(ref)} can only be accumulated into with += or -=", mask)
        g, (lo, hi) = tape.raw(value), tape.interval(value)
        if op == "-":
            g, lo, hi = -g, -hi, -lo
        if mask is not True:
            g, lo, hi = (np.where(mask, x, 0.0) for x in (g, lo, hi))
        g = tape.bounded(np.broadcast_to(g, self.lanes), (lo, hi) if self.bounded else None)
        i = self.flat_index(ref, idx, mask)
        if ref.kind == "grad_input":
            self._scatter(ref.conn, i, g)
        else:
            self._to_param(self.slots[ref.name], i, g)

    # ------------------------------------------------------------ helpers
    def _columns(self, t: Table, i) -> tuple[np.ndarray, np.ndarray | None]:
        if isinstance(i, np.ndarray):
            n = np.arange(self.lanes[1])
            return t.cols[i, n], None if t.valid is None else t.valid[i, n]
        return t.cols[i][None, :], None if t.valid is None else t.valid[i][None, :]

    def _gather(self, src: np.ndarray, cols: np.ndarray, valid, padding) -> np.ndarray:
        """What the lanes read of ``src`` (flat ``(batch, size)``) at ``cols``; ``padding``
        where not ``valid``."""
        v = (src[:, cols[0]] if cols.shape[0] == 1 else
             np.take_along_axis(src, np.broadcast_to(cols, self.lanes), 1))
        return v if valid is None else np.where(valid, v, padding)

    def _field(self, slot: Slot, i) -> np.ndarray:
        if slot.data.spec.kind is FieldKind.BATCH:
            b = np.arange(self.lanes[0])[:, None]
            return slot.array[b, slot.rows[None, :], i]
        return slot.array[slot.rows[None, :], i]

    def _scatter(self, k: int, i, g) -> None:
        """Add ``g`` (per lane) into the source gradients connection ``k``'s element ``i``
        reads; padded elements take nothing."""
        dest = self.source_grads[k]
        if dest is None:
            return
        cols, valid = self._columns(self.tables[k], i)
        lin = np.broadcast_to(cols, self.lanes) + np.arange(self.lanes[0])[:, None] * dest.shape[1]
        keep = None if valid is None else np.broadcast_to(valid, self.lanes)
        self._add_into(dest, self.grad_intervals[k], lin, g, self.lanes, keep)

    def _to_param(self, slot: Slot, i, g) -> None:
        """Add ``g`` into the parameter gradient; ``g`` has the read's shape (a static
        index reads ``(1, neurons)``: do not count it once per batch item)."""
        n = np.ndim(tape.raw(g))
        shape = self.lanes if isinstance(i, np.ndarray) else (
            np.shape(tape.raw(g))[0] if n == 2 else 1, self.lanes[1])
        lin = slot.rows[None, :] * slot.grad.shape[1] + i
        self._add_into(slot.grad, slot.grad_interval, lin, g, shape)

    def _add_into(self, dest: np.ndarray, bounds: tuple | None, lin, g, shape: tuple,
                  keep: np.ndarray | None = None) -> None:
        """Queue the terms ``g`` (broadcast to ``shape``) for adding into ``dest`` at the flat
        positions ``lin`` (where ``keep``); :meth:`flush` adds them."""
        lin = np.broadcast_to(lin, shape)
        terms = [np.broadcast_to(x, shape)
                 for x in (tape.raw(g), *(tape.interval(g) if bounds is not None else ()))]
        if keep is not None:
            lin, terms = lin[keep], [x[keep] for x in terms]
        key = (dest.__array_interface__["data"][0], dest.shape)   # views of one gradient
        queued = self.pending.setdefault(key, (dest, bounds, [], []))
        queued[2].append(lin.reshape(-1))
        queued[3].append([x.reshape(-1) for x in terms])

    def flush(self) -> None:
        """Add every queued term into its gradient, in the order they came; with bounds,
        ``(lo, hi, partials)``, widen the interval by the terms' and add the partial sums'
        magnitudes (the additions' rounding, :func:`rounding.spread` once the gradient is
        whole). One pass per gradient: the frame's additions in one (no neuron body reads a
        gradient it adds to), not one per loop iteration."""
        for dest, bounds, lins, queued in self.pending.values():
            lin = np.concatenate(lins)
            terms = [np.concatenate(x) for x in zip(*queued)]

            def added(weights: np.ndarray, lin=lin, dest=dest) -> np.ndarray:
                return np.bincount(lin, weights, dest.size).reshape(dest.shape)

            if bounds is not None:
                ends = rounding.accumulation(bounds[:2], rounding.parts(*terms[1:], added))
                bounds[2][...] += rounding.partials(lin, terms[0], dest)
                bounds[0][...], bounds[1][...] = ends
            dest += added(terms[0])
        self.pending.clear()


def is_int(v) -> bool:
    """Whether ``v`` is integer-typed (Python/numpy ints and booleans)."""
    v = tape.raw(v)
    if isinstance(v, np.ndarray):
        return v.dtype.kind in "iub"
    return isinstance(v, (int, np.integer, np.bool_))


def _show(ref: NeuronRef) -> str:
    if ref.kind in ("input", "grad_input"):
        return f"self.{'inputs' if ref.kind == 'input' else 'grad_inputs'}[{ref.conn}]"
    return f"self.{'grad_' if ref.kind == 'grad_field' else ''}{ref.name}"
