"""The reference interpreter's net: runs a built ``Net`` from its lang objects in float64.

Nothing here compiles: neuron bodies are parsed by the frontend and interpreted
(:mod:`latte.reference.interp`), mappings and index maps are called at every neuron
(:mod:`latte.reference.frame`), normalization ensembles run their own numpy code on float64
arrays. A neuron type without a ``backward`` gets the gradient of its ``forward`` by tape
(:mod:`latte.reference.tape`), from the inputs it read in the forward pass.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from latte.compiler.frontend import NeuronInfo, parse_method
from latte.errors import ShapeError
from latte.lang import (
                        ActivationEnsemble,
                        DataEnsemble,
                        Ensemble,
                        FieldKind,
                        NormalizationEnsemble,
                        Phase,
                        defines_backward,
)
from latte.lang.ensemble import BaseEnsemble
from latte.lang.inplace import give_copies
from latte.lang.time import check_time, order_for_time, time_loops
from latte.reference import hosts, rounding, tape
from latte.reference.frame import Frame, Slot, Table, field_rows, gather_table
from latte.reference.interp import run


def _owner(ens: BaseEnsemble) -> BaseEnsemble:
    while isinstance(ens, ActivationEnsemble):
        ens = ens.source
    return ens


def _key(ens: Ensemble, field: str) -> str:
    return ens.field_name(field)


def _zeros_like(store: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Zero arrays shaped like ``store``'s, shared where ``store``'s are."""
    made: dict[int, np.ndarray] = {}
    return {k: made.setdefault(id(v), np.zeros_like(v)) for k, v in store.items()}


@dataclass
class Stores:
    """One array per value, gradient, parameter gradient and parameter, by name."""

    values: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    param_grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray]


@dataclass
class Bounds:
    """Float32 rounding bounds (:mod:`latte.reference.rounding`) of a reference's arrays,
    entry by entry: compiled float32 code computes ``values[name]`` within
    ``[lo.values[name], hi.values[name]]`` (an infinite end: float32 may overflow there),
    and so on; ``params`` after :meth:`Reference.sgd_step`, from exact float32 ones.
    ``partials`` (gradients only) sums the magnitudes of the partial sums a gradient still
    accumulates, whose rounding joins its interval once it is whole (:meth:`whole`)."""

    lo: Stores
    hi: Stores
    partials: Stores

    def whole(self, store: str, name: str) -> tuple:
        """The interval of gradient ``store[name]``, its accumulation's rounding in."""
        lo, hi, sizes = (getattr(s, store)[name] for s in (self.lo, self.hi, self.partials))
        return rounding.spread(lo, hi, sizes)


class Reference:
    """Runs ``net`` per neuron in float64 numpy: the executable definition of the language.

    ``params`` / ``fields`` (``{"ens.field": array}``) override the arrays the ensembles
    were given (a Batch field's array is ``(batch, *field array shape)``, as
    ``net.field`` shows it). With time steps every ensemble's arrays hold ``time_steps x
    batch`` items, step-major, and a time loop's ensembles run one step at a time, reading
    a recurrent connection's source at the step before (zeros before step 0). After
    :meth:`forward`, ``values[name]`` is what
    ``net.value(name)`` shows; after :meth:`backward`, ``grads[name]`` what ``net.grad(name)``
    shows and ``param_grads["ens.field"]`` each parameter's gradient. An activation shares
    its source's value and gradient arrays. The reference never calls ``before_forward``
    (dropout draws its masks there): give such Batch fields through ``fields``.

    ``jitter`` (0: none) multiplies what each float ``+ - * /`` and ``exp``/``log``/``tanh``/
    ``sqrt`` of a neuron body computes, where float32 would round it (where it is no float32
    number), by ``1 + jitter * N(0, 1)``, drawn per lane and operation from ``jitter_seed``
    (two references with one seed and opposite jitters perturb alike, with opposite signs):
    what these perturbations move is what rounding may move. The random tester runs so to
    find the entries that hang on rounding.

    With ``bounds``, ``self.bounds`` (:class:`Bounds`) holds where float32 may land around
    every value and gradient (every float the interpreter computes carries its rounding
    bound: :mod:`latte.reference.rounding`); host steps need a rule in
    :mod:`latte.reference.hosts`. Without, ``self.bounds`` is None.
    """

    def __init__(self, net, params: dict | None = None, fields: dict | None = None,
                 bounds: bool = False):
        check_time(net)    # as the compiler does: activations that may not work in place get
        give_copies(net)   # a copy, the time loops' ensembles are consecutive
        order_for_time(net)
        self.net, self.steps = net, net.time_steps
        self.rows = net.batch_size * net.time_steps   # items of every step, step-major
        self.batch = net.batch_size
        lead = (self.steps, self.batch) if self.steps > 1 else (self.batch,)   # as net.value
        self._loops = {e: loop for loop in time_loops(net) for e in loop.ensembles}
        self.phase = Phase.TRAIN
        self.loss = 0.0
        self.jitter, self.jitter_seed = 0.0, 0
        self.values: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        for ens in net.ensembles:
            owner = _owner(ens)
            if owner is ens:
                self.values[ens.name] = np.zeros((*lead, *ens.shape))
                self.grads[ens.name] = np.zeros((*lead, *ens.shape))
            else:
                self.values[ens.name] = self.values[owner.name]
                self.grads[ens.name] = self.grads[owner.name]
        self.params: dict[str, np.ndarray] = {}
        self.fields: dict[str, np.ndarray] = {}
        for ens in self._neuron_ensembles():
            for name, f in ens.fields.items():
                if f.spec.kind is FieldKind.PARAM:
                    self.params[_key(ens, name)] = ens.public(
                        name, np.array(f.array, np.float64).reshape(f.given_shape))
                elif f.spec.kind is FieldKind.BATCH:
                    self.fields[_key(ens, name)] = np.broadcast_to(
                        f.array.astype(np.float64), (*lead, *f.array.shape)).copy()
                else:
                    self.fields[_key(ens, name)] = np.array(f.array, np.float64)
        self._override(self.params, params or {}, "params")
        self._override(self.fields, fields or {}, "fields")
        self.param_grads = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.history = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.bounds = Bounds(*(Stores(_zeros_like(self.values), _zeros_like(self.grads),
                                      _zeros_like(self.param_grads), _zeros_like(self.params))
                               for _ in range(3))) if bounds else None
        self._tables: dict[str, list[Table]] = {}
        self._rows: dict[str, np.ndarray] = {}
        self._bodies: dict[tuple[str, str], object] = {}
        self._saved: dict[str, tuple] = {}   # forward-time inputs of neurons without backward
        # normalization ensembles keep state between forward and backward (a loss's
        # probabilities): the reference runs them on copies so the net's own stay untouched
        self._norms = {e.name: copy.copy(e) for e in net.ensembles
                       if isinstance(e, NormalizationEnsemble)}

    def _neuron_ensembles(self) -> list[Ensemble]:
        return [e for e in self.net.ensembles if isinstance(e, Ensemble)]

    @staticmethod
    def _override(store: dict, given: dict, what: str) -> None:
        for key, array in given.items():
            if key not in store:
                raise KeyError(f"Reference: no {what[:-1]} named {key!r} (known: {sorted(store)})")
            array = np.asarray(array, np.float64)
            if array.size != store[key].size:
                raise ShapeError(f"Reference: {what} {key!r} has shape {array.shape}, expected "
                                 f"{store[key].shape}")
            store[key][...] = array.reshape(store[key].shape)

    # ------------------------------------------------------------ running
    def forward(self, inputs: dict[str, np.ndarray], phase: Phase = Phase.TRAIN) -> None:
        """Run every ensemble's forward in net order; ``inputs`` holds a ``(batch, *shape)``
        (``(time_steps, batch, *shape)``) array for every data ensemble."""
        self.phase = phase
        for norm in self._norms.values():
            norm.phase = phase
        data = [e for e in self.net.ensembles if isinstance(e, DataEnsemble)]
        unknown = set(inputs) - {e.name for e in data}
        if unknown:
            raise KeyError(f"Reference.forward: {sorted(unknown)} are not data ensembles")
        for ens in data:
            if ens.name not in inputs:
                raise KeyError(f"Reference.forward: no input for data ensemble {ens.name!r}")
            x = np.asarray(inputs[ens.name], np.float64)
            if x.size != self.values[ens.name].size:
                raise ShapeError(f"Reference.forward: input {ens.name!r} has shape {x.shape}, "
                                 f"expected {self.values[ens.name].shape}")
            self.values[ens.name][...] = x.reshape(self.values[ens.name].shape)
            if self.bounds is not None:   # float32 data: exact
                for end in self._ends("values"):
                    end[ens.name][...] = self.values[ens.name]
        for ens, t in self._order(reverse=False):
            if isinstance(ens, NormalizationEnsemble):
                self._host_forward(ens)
            elif isinstance(ens, Ensemble):
                self._forward(ens, t)
        self.loss = float(sum(n.loss for n in self._norms.values() if n.is_loss))

    def backward(self) -> None:
        """Zero every gradient, then back-propagate from the losses in reverse net order."""
        stores = (self.grads, self.param_grads)
        if self.bounds is not None:
            stores += (*self._ends("grads", 3), *self._ends("param_grads", 3))
        for g in (g for store in stores for g in store.values()):
            g[...] = 0.0
        for ens, t in self._order(reverse=True):
            if isinstance(ens, NormalizationEnsemble):
                self._host_backward(ens)
            elif isinstance(ens, Ensemble):
                self._backward(ens, t)
        if self.bounds is not None:   # every gradient is whole: its rounding joins its bound
            for store in ("grads", "param_grads"):
                for name, lo in getattr(self.bounds.lo, store).items():
                    hi = getattr(self.bounds.hi, store)[name]
                    lo[...], hi[...] = self.bounds.whole(store, name)
                    getattr(self.bounds.partials, store)[name][...] = 0.0

    def _host_forward(self, ens: NormalizationEnsemble) -> None:
        """Run a host step's forward (and, bounded, its rule for the value's bound)."""
        inputs = [self._items(self.values, i) for i in ens.inputs]
        value = self._items(self.values, ens)
        self._norms[ens.name].forward(inputs, value, self.rows)
        if self.bounds is not None:
            r = hosts.forward_radius(self._norms[ens.name], inputs,
                                     self._radii(ens.inputs), value, self.rows)
            for end, e in zip(self._ends("values"), rounding.around(value, r)):
                self._items(end, ens)[...] = e

    def _host_backward(self, ens: NormalizationEnsemble) -> None:
        """Run a host step's backward (and, bounded, its rule for what it adds into its
        inputs' gradients, plus the rounding of adding it)."""
        inputs = [self._items(self.values, i) for i in ens.inputs]
        grads = [self._items(self.grads, i) for i in ens.inputs]
        before = [g.copy() for g in grads] if self.bounds is not None else []
        grad = self._items(self.grads, ens)
        self._norms[ens.name].backward(inputs, grads, self._items(self.values, ens), grad,
                                       self.rows)
        if self.bounds is None:
            return
        radii = hosts.backward_radii(self._norms[ens.name], inputs, self._radii(ens.inputs),
                                     grad, self._radii([ens], "grads")[0], self.rows)
        for i, g, old, r in zip(ens.inputs, grads, before, radii):
            if r is not None:
                lo, hi, sizes = (self._items(end, i) for end in self._ends("grads", 3))
                added = rounding.parts(*rounding.around(g - old, r), lambda x: x)
                lo[...], hi[...] = rounding.accumulation((lo, hi), added)
                sizes += np.where(g != old, np.abs(g), 0.0)

    def _ends(self, store: str, n: int = 2) -> tuple[dict, ...]:
        """The lower and upper bounds of ``store`` (``"values"``, ``"grads"``, ...), and
        with ``n`` 3 the magnitudes of a gradient's partial sums."""
        return tuple(getattr(s, store) for s in (self.bounds.lo, self.bounds.hi,
                                                 self.bounds.partials)[:n])

    def _radii(self, ensembles: list, store: str = "values") -> list[np.ndarray]:
        """How far each ensemble's ``store`` may be off either way, ``(items, *shape)``."""
        out = []
        for e in ensembles:
            ends = tuple(self._items(end, e) for end in self._ends(store, 2 if store == "values" else 3))
            iv = ends if store == "values" else rounding.spread(*ends)
            out.append(rounding.radius(self._items(getattr(self, store), e), iv))
        return out

    def _order(self, reverse: bool):
        """``(ensemble, step)`` in run order: an ensemble outside time loops once over all
        steps (step None), a time loop's ensembles step by step."""
        ensembles = self.net.ensembles[::-1] if reverse else self.net.ensembles
        steps = range(self.steps)[::-1] if reverse else range(self.steps)
        for i, ens in enumerate(ensembles):
            loop = self._loops.get(ens)
            if loop is None:
                yield ens, None
            elif i == 0 or self._loops.get(ensembles[i - 1]) is not loop:
                members = [e for e in ensembles if self._loops.get(e) is loop]
                for t in steps:
                    for member in members:
                        yield member, t

    def sgd_step(self, lr: float, momentum: float = 0.0, regu_coef: float = 0.0) -> None:
        """``hist = mom*hist + lr*lr_mult*(grad + regu*decay_mult*param)``; ``param -= hist``."""
        for ens in self._neuron_ensembles():
            for f in ens.params:
                k = _key(ens, f.name)
                step = lr * f.spec.lr_mult * (self.param_grads[k]
                                              + regu_coef * f.spec.decay_mult * self.params[k])
                if self.bounds is not None:
                    self._bound_update(k, lr * f.spec.lr_mult, momentum * self.history[k], step)
                self.history[k] = momentum * self.history[k] + step
                self.params[k] -= self.history[k]

    def _bound_update(self, k: str, rate: float, kept: np.ndarray, step: np.ndarray) -> None:
        """The interval of parameter ``k`` after ``param - (kept + step)`` (an SGD update in
        float32, from exact parameters and history): the gradient's, times ``rate``, and
        three roundings, of the step, the history and the update."""
        with np.errstate(invalid="ignore"):   # lr 0 (an infinite gradient) times inf: NaN
            lo, hi = (rate * (end[k] - self.param_grads[k]) for end in self._ends("param_grads"))
        new = self.params[k] - kept - step
        m = 3 * rounding.U * (np.abs(kept) + 2 * np.abs(step) + np.abs(self.params[k]))
        ends = rounding.outward(new - hi, new - lo, m, m)
        self.bounds.lo.params[k], self.bounds.hi.params[k] = ends

    # ------------------------------------------------------------ one ensemble
    def _flat(self, arrays: dict, ens: BaseEnsemble, t: int | None = None,
              shift: int = 0) -> np.ndarray:
        """``ens``'s rows of all steps (``t`` None), or of step ``t + shift`` (before step
        0: zeros, whose gradients go nowhere)."""
        flat = arrays[ens.name].reshape(self.rows, -1)
        if t is None:
            return flat
        if t + shift < 0:
            return np.zeros((self.batch, flat.shape[1]))
        return flat[(t + shift) * self.batch:(t + shift + 1) * self.batch]

    def _items(self, arrays: dict, ens: BaseEnsemble) -> np.ndarray:
        """``ens``'s array as a normalization ensemble sees it: ``(items, *shape)``."""
        return arrays[ens.name].reshape(self.rows, *ens.shape)

    def _inputs(self, arrays: dict, tables: list[Table], t: int | None) -> list:
        return [self._flat(arrays, tb.conn.source, t, -1 if tb.conn.recurrent else 0)
                for tb in tables]

    def _setup(self, ens: Ensemble) -> list[Table]:
        if ens.name not in self._tables:
            self._tables[ens.name] = [gather_table(c) for c in self.net.connections_into(ens)]
            for name, f in ens.fields.items():
                self._rows[_key(ens, name)] = field_rows(ens, f)
        return self._tables[ens.name]

    def _body(self, ens: Ensemble, phase: str, tables: list[Table]):
        if (ens.name, phase) not in self._bodies:
            info = NeuronInfo(tuple(t.length for t in tables),
                              {n: int(np.prod(f.vector_shape)) for n, f in ens.fields.items()},
                              frozenset(f.name for f in ens.params))
            self._bodies[ens.name, phase] = parse_method(ens.neuron_type, phase, info)
        return self._bodies[ens.name, phase]

    def _slots(self, ens: Ensemble, t: int | None) -> dict[str, Slot]:
        out = {}
        for name, f in ens.fields.items():
            k = _key(ens, name)
            rows = self._rows[k]
            n_rows = int(np.prod(f.array.shape[:f.lead_ndim]))
            if f.spec.kind is FieldKind.PARAM:
                # the published arrays (parameter, gradient, bounds) as the neurons see them
                bounds = () if self.bounds is None else self._ends("param_grads", 3)
                param, grad, *ends = (ens.stored(name, a).reshape(n_rows, -1) for a in (
                    self.params[k], self.param_grads[k], *(end[k] for end in bounds)))
                out[name] = Slot(f, param, rows, grad, tuple(ends) if bounds else None)
            elif f.spec.kind is FieldKind.BATCH:
                batch = self.fields[k].reshape(self.rows, n_rows, -1)
                if t is not None:
                    batch = batch[t * self.batch:(t + 1) * self.batch]
                out[name] = Slot(f, batch, rows, None)
            else:
                out[name] = Slot(f, self.fields[k].reshape(n_rows, -1), rows, None)
        return out

    def _jitter(self, ens: Ensemble, backward: bool, t: int | None):
        """The factors of ``ens``'s forward or backward pass at step ``t`` (None without
        jitter): the same draws in every reference with this seed, whatever ran before. A
        backward that reruns the forward draws its own, as compiled code recomputes it."""
        if not self.jitter:
            return None
        rng = np.random.default_rng([self.jitter_seed, self.net.ensembles.index(ens), backward,
                                     0 if t is None else t + 1])
        return lambda shape: 1.0 + self.jitter * rng.standard_normal(shape)

    def _dead(self, ens: BaseEnsemble) -> bool:
        """A data ensemble nobody asked the gradient of: the compiled net leaves it zero."""
        return isinstance(ens, DataEnsemble) and not getattr(ens, "needs_grad", False)

    def _intervals(self, store: str, tables: list[Table], t: int | None) -> list | None:
        """The bounds of the connections' sources' ``store`` (None: not bounded): ``(lo,
        hi)`` for values, ``(lo, hi, partials)`` for gradients, which the frame adds to."""
        if self.bounds is None:
            return None
        n = 2 if store == "values" else 3
        return list(zip(*(self._inputs(end, tables, t) for end in self._ends(store, n))))

    def _bounded(self, store: str, ens: Ensemble, t: int | None, array: np.ndarray):
        """``array`` (``ens``'s ``store`` at ``t``, or a copy), bounded as the reference
        holds it (a gradient whole); plain when not bounded."""
        if self.bounds is None:
            return array
        grads = store == "grads"
        ends = tuple(self._flat(end, ens, t) for end in self._ends(store, 3 if grads else 2))
        iv = rounding.spread(*ends) if grads else ends
        return tape.Node(array, interval=tuple(np.array(e) for e in iv))

    def _store(self, store: str, ens: Ensemble, t: int | None, computed) -> None:
        """Write what a frame computed into ``ens``'s ``store`` at ``t`` (and its bound,
        a gradient's whole: its partials start over)."""
        out = self._flat(getattr(self, store), ens, t)
        out[...] = np.broadcast_to(tape.raw(computed), out.shape)
        if self.bounds is not None:
            grads = store == "grads"
            for end, e in zip(self._ends(store, 3 if grads else 2),
                              (*tape.interval(computed), 0.0)):
                self._flat(end, ens, t)[...] = np.broadcast_to(e, out.shape)

    def _forward(self, ens: Ensemble, t: int | None) -> None:
        tables = self._setup(ens)
        sources, bounds = self._inputs(self.values, tables, t), self._intervals("values", tables, t)
        value = self._flat(self.values, ens, t)
        start = (self._bounded("values", ens, t, value.copy())
                 if isinstance(ens, ActivationEnsemble) else 0.0)
        if not defines_backward(ens.neuron_type):
            self._saved[ens.name, t] = ([s.copy() for s in sources],
                                        bounds and [(lo.copy(), hi.copy()) for lo, hi in bounds],
                                        start)
        frame = Frame(ens, tables, sources, [None] * len(tables), self._slots(ens, t), start,
                      self._flat(self.grads, ens, t), len(value),
                      jitter=self._jitter(ens, False, t), intervals=bounds)
        run(self._body(ens, "forward", tables), frame)
        self._store("values", ens, t, frame.value)

    def _backward(self, ens: Ensemble, t: int | None) -> None:
        tables = self._setup(ens)
        dead = [self._dead(tb.conn.source) for tb in tables]
        grads = [None if d else g for d, g in zip(dead, self._inputs(self.grads, tables, t))]
        grad_bounds = self._intervals("grads", tables, t)
        grad_bounds = grad_bounds and [None if d else b for d, b in zip(dead, grad_bounds)]
        grad = self._flat(self.grads, ens, t)
        seed = self._bounded("grads", ens, t, grad.copy())
        slots = self._slots(ens, t)
        if defines_backward(ens.neuron_type):
            value = self._bounded("values", ens, t, self._flat(self.values, ens, t))
            frame = Frame(ens, tables, self._inputs(self.values, tables, t), grads, slots, value,
                          seed, len(grad), jitter=self._jitter(ens, True, t),
                          intervals=self._intervals("values", tables, t),
                          grad_intervals=grad_bounds)
            run(self._body(ens, "backward", tables), frame)
            frame.flush()
            self._store("values", ens, t, frame.value)
            self._store("grads", ens, t, frame.grad)
            return
        sources, bounds, start = self._saved[ens.name, t]
        received = [0.0]   # the gradient an activation's input receives (it becomes grad)
        if not isinstance(start, float):   # an activation: its input is its value

            def sink(g):
                ends = zip(tape.interval(received[0]), tape.interval(g))
                received[0] = tape.bounded(tape.raw(received[0]) + tape.raw(g),
                                           tuple(a + b for a, b in ends)
                                           if self.bounds is not None else None)

            start = tape.Node(tape.raw(start), sink=sink, interval=getattr(start, "interval", None))
        frame = Frame(ens, tables, sources, grads, slots, start, grad, len(grad), trace=True,
                      jitter=self._jitter(ens, True, t), intervals=bounds,
                      grad_intervals=grad_bounds)
        run(self._body(ens, "forward", tables), frame)
        tape.backprop([(frame.value, seed)])
        frame.unbound_overflow()
        frame.flush()
        if isinstance(ens, ActivationEnsemble):
            self._store("grads", ens, t, received[0])
