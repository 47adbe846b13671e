"""The reference interpreter's net: runs a built ``Net`` from its lang objects in float64.

Nothing here compiles: neuron bodies are parsed by the frontend and interpreted
(:mod:`latte.reference.interp`), mappings and index maps are called at every neuron
(:mod:`latte.reference.frame`), normalization ensembles run their own numpy code on float64
arrays. A neuron type without a ``backward`` gets the gradient of its ``forward`` by tape
(:mod:`latte.reference.tape`), from the inputs it read in the forward pass.
"""

from __future__ import annotations

import copy

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
from latte.reference import tape
from latte.reference.frame import Frame, Slot, Table, field_rows, gather_table
from latte.reference.interp import run


def _owner(ens: BaseEnsemble) -> BaseEnsemble:
    while isinstance(ens, ActivationEnsemble):
        ens = ens.source
    return ens


def _key(ens: Ensemble, field: str) -> str:
    return ens.field_name(field)


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
    """

    def __init__(self, net, params: dict | None = None, fields: dict | None = None):
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
                    self.params[_key(ens, name)] = np.array(f.array, np.float64).reshape(f.given_shape)
                elif f.spec.kind is FieldKind.BATCH:
                    self.fields[_key(ens, name)] = np.broadcast_to(
                        f.array.astype(np.float64), (*lead, *f.array.shape)).copy()
                else:
                    self.fields[_key(ens, name)] = np.array(f.array, np.float64)
        self._override(self.params, params or {}, "params")
        self._override(self.fields, fields or {}, "fields")
        self.param_grads = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.history = {k: np.zeros_like(v) for k, v in self.params.items()}
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
            store[key] = array.reshape(store[key].shape).copy()

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
        for ens, t in self._order(reverse=False):
            if isinstance(ens, NormalizationEnsemble):
                self._norms[ens.name].forward([self._items(self.values, i) for i in ens.inputs],
                                              self._items(self.values, ens), self.rows)
            elif isinstance(ens, Ensemble):
                self._forward(ens, t)
        self.loss = float(sum(n.loss for n in self._norms.values() if n.is_loss))

    def backward(self) -> None:
        """Zero every gradient, then back-propagate from the losses in reverse net order."""
        for g in (*self.grads.values(), *self.param_grads.values()):
            g[...] = 0.0
        for ens, t in self._order(reverse=True):
            if isinstance(ens, NormalizationEnsemble):
                self._norms[ens.name].backward([self._items(self.values, i) for i in ens.inputs],
                                               [self._items(self.grads, i) for i in ens.inputs],
                                               self._items(self.values, ens),
                                               self._items(self.grads, ens), self.rows)
            elif isinstance(ens, Ensemble):
                self._backward(ens, t)

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
                self.history[k] = momentum * self.history[k] + step
                self.params[k] -= self.history[k]

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
                out[name] = Slot(f, self.params[k].reshape(n_rows, -1), rows,
                                 self.param_grads[k].reshape(n_rows, -1))
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

    def _forward(self, ens: Ensemble, t: int | None) -> None:
        tables = self._setup(ens)
        sources = self._inputs(self.values, tables, t)
        value = self._flat(self.values, ens, t)
        start = value.copy() if isinstance(ens, ActivationEnsemble) else 0.0
        if not defines_backward(ens.neuron_type):
            self._saved[ens.name, t] = ([s.copy() for s in sources], start)
        frame = Frame(ens, tables, sources, [None] * len(tables), self._slots(ens, t), start,
                      self._flat(self.grads, ens, t), len(value),
                      jitter=self._jitter(ens, False, t))
        run(self._body(ens, "forward", tables), frame)
        value[...] = np.broadcast_to(tape.raw(frame.value), value.shape)

    def _backward(self, ens: Ensemble, t: int | None) -> None:
        tables = self._setup(ens)
        grads = [None if self._dead(tb.conn.source) else g
                 for tb, g in zip(tables, self._inputs(self.grads, tables, t))]
        grad = self._flat(self.grads, ens, t)
        slots = self._slots(ens, t)
        if defines_backward(ens.neuron_type):
            sources = self._inputs(self.values, tables, t)
            value = self._flat(self.values, ens, t)
            frame = Frame(ens, tables, sources, grads, slots, value, grad.copy(), len(grad),
                          jitter=self._jitter(ens, True, t))
            run(self._body(ens, "backward", tables), frame)
            value[...] = np.broadcast_to(tape.raw(frame.value), value.shape)
            grad[...] = np.broadcast_to(tape.raw(frame.grad), grad.shape)
            return
        sources, start = self._saved[ens.name, t]
        d_start = np.zeros_like(grad)
        if isinstance(start, np.ndarray):   # an activation: its input is its value

            def sink(g):
                d_start[...] += g

            start = tape.Node(start, sink=sink)
        frame = Frame(ens, tables, sources, grads, slots, start, grad, len(grad), trace=True,
                      jitter=self._jitter(ens, True, t))
        run(self._body(ens, "forward", tables), frame)
        tape.backprop([(frame.value, grad.copy())])
        if isinstance(ens, ActivationEnsemble):
            grad[...] = d_start
