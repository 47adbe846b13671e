"""``latte check``: a net built at opt level L against the same net built at level 0, and
level 0's gradients against central finite differences (issue 10, item 4).

:func:`check` takes two builds of one net (same ensembles, connections and fields; the
level-0 one compiled with one segment per ensemble, ``Net(profile=True)``), gives both the
same parameters and random data, and returns one :class:`Row` per ensemble.

Finite differences run in float32, so they probe directions, not single entries: a probe
moves a whole array along ``d`` (each entry by a step scaled to its magnitude, signed like
the gradient so the loss moves far above rounding noise, plus a random part so that a
gradient that is wrongly zero still shows) and compares ``(L(x+td) - L(x-td)) / 2t`` with
``<grad, d>``. A probe whose central differences at ``t`` and ``t/2`` disagree crossed a
kink (a ReLU at zero, a max-pool tie) or drowned in rounding: it is retried at other steps
and, failing those, counted as inconclusive, never as a disagreement.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from latte.compiler import TimeSteps
from latte.lang import (
    ActivationEnsemble,
    DataEnsemble,
    Ensemble,
    FieldKind,
    NormalizationEnsemble,
    Phase,
    readers,
)
from latte.net import Net

CLOSE = 1e-3           # level L against level 0: max |L - 0| / max |0| per array
FD_RTOL = 5e-2         # level 0 against finite differences, relative to the probe's scale
LOSS_CHANGES = (1e-2, 1e-3, 1e-1)   # how far a probe moves the loss, in the order tried
MAX_STEP = 0.1                      # the largest probe step, relative to the entries
ROUNDING = 16.0                     # float32 roundings in a gradient entry, per term summed
LOSS_RESOLUTION = 1e-5              # the smallest loss change float32 resolves, relative


@dataclass
class Row:
    """One ensemble's largest errors (None: nothing of that kind to compare)."""

    name: str
    value: float | None = None      # level L vs 0: values (train forward, test outputs)
    grad: float | None = None       # level L vs 0: its gradient and its parameters'
    fd_grad: float | None = None    # level 0 vs FD: d loss / d its values
    fd_params: float | None = None  # level 0 vs FD: its parameters' gradients
    inconclusive: int = 0           # FD probes that found only kinks or noise
    suspect: bool = False           # its backward is the likeliest origin of a wrong gradient

    def failures(self) -> list[str]:
        """The columns that disagree."""
        out = [c for c, tol in (("value", CLOSE), ("grad", CLOSE), ("fd_grad", FD_RTOL),
                                ("fd_params", FD_RTOL))
               if getattr(self, c) is not None and not getattr(self, c) <= tol]
        return out + (["backward"] if self.suspect else [])


@dataclass
class Report:
    opt_level: int
    rows: list[Row] = field(default_factory=list)

    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.failures()]

    def format(self) -> str:
        """The table ``latte check`` prints, then a verdict line."""
        head = ("ensemble", "value L-0", "grad L-0", "FD grad", "FD params", "")
        cells = [head] + [(r.name, *(_cell(getattr(r, c)) for c in
                                     ("value", "grad", "fd_grad", "fd_params")),
                           _notes(r)) for r in self.rows]
        width = max(len(c[0]) for c in cells)
        lines = [f"{c[0]:<{width}}  " + "  ".join(f"{x:>10}" for x in c[1:5]) + f"  {c[5]}"
                 for c in cells]
        bad = self.failed()
        lines.append(f"opt level {self.opt_level} vs 0 (tolerance {CLOSE:g}), level 0 vs finite "
                     f"differences (tolerance {FD_RTOL:g}): "
                     + ("all agree" if not bad else "disagree at " + ", ".join(
                         f"{r.name} ({', '.join(r.failures())})" for r in bad)))
        return "\n".join(line.rstrip() for line in lines)


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _notes(row: Row) -> str:
    notes = [f"{row.inconclusive} FD probes inconclusive"] if row.inconclusive else []
    if row.suspect:
        notes.append("<- suspect backward")
    return ", ".join(notes)


# ---------------------------------------------------------------- the check
def check(net: Net, ref: Net, *, seed: int = 0, probes: int = 1) -> Report:
    """Compare ``net`` (any opt level) with ``ref`` (opt level 0, built with one segment per
    ensemble), then ``ref``'s gradients with finite differences (``probes`` per array).

    Both nets get ``ref``'s initial fields (parameters that start all zero, biases, get
    small random values so that they matter), the same random data (class indices for
    labels) and the same ``Batch`` fields from ``before_forward`` (dropout masks), which
    stay fixed throughout. Both nets are modified: use builds made for checking.
    """
    pairs = _pair(net, ref)
    rng = np.random.default_rng(seed)
    ref.init()
    fd = _FiniteDifferences(ref, rng, probes)   # first, as it checks how ref was built
    net.init()   # last: from level 2 on, init sets BLAS to one thread per call
    for p in ref.params:
        if not p.value.any():
            p.value[...] = 0.1 * rng.standard_normal(p.value.shape)
    for e, r in pairs:
        if isinstance(r, Ensemble):
            for name, f in r.fields.items():
                if f.spec.kind is not FieldKind.BATCH:
                    net.field(e, name)[...] = ref.field(r, name)
    data = {r.name: _random_data(ref, r, rng) for r in ref.ensembles if isinstance(r, DataEnsemble)}
    for n in (net, ref):
        _Feed(n, data)
    _fix_before_forward(ref, net)

    report = Report(net.opt_level)
    rows = {r.name: Row(r.name) for r in ref.ensembles}
    report.rows = list(rows.values())
    for phase in (Phase.TEST, Phase.TRAIN):   # train last: the probes start from its state
        net.forward(phase)
        ref.forward(phase)
        for e, r in pairs:
            if _shows_value(ref, r, phase):
                _worst(rows[r.name], "value", _diff(net.value(e), ref.value(r)))
        if phase is Phase.TRAIN:
            net.backward()
            ref.backward()
            for e, r in pairs:
                if _has_grad(ref, r):
                    _worst(rows[r.name], "grad", _diff(net.grad(e), ref.grad(r)))
            for p, q in zip(net.params, ref.params, strict=True):
                owner = _owner(ref, q.name)
                _worst(rows[owner], "grad", _diff(p.grad, q.grad, _grad_floor(ref, owner, q)))
            grads = {r: ref.grad(r).copy() for r in ref.ensembles if _has_grad(ref, r)}
            param_grads = {q.name: q.grad.copy() for q in ref.params}

    for r, g in grads.items():
        _record(rows[r.name], "fd_grad", fd.value_probes(r, g))
    for q in ref.params:
        owner = _owner(ref, q.name)
        _record(rows[owner], "fd_params", fd.param_probes(ref.ensemble(owner), q, param_grads[q.name]))
    _blame(ref, rows)
    return report


def _pair(net: Net, ref: Net) -> list[tuple]:
    names = [(e.name, type(e).__name__, e.shape) for e in net.ensembles]
    if names != [(r.name, type(r).__name__, r.shape) for r in ref.ensembles]:
        raise ValueError("the two builds of the net differ (does the script build its net "
                         "at random?): cannot compare them")
    return list(zip(net.ensembles, ref.ensembles, strict=True))


def _owner(net: Net, param_name: str) -> str:
    """The name of the ensemble holding the parameter (a layer may publish it under its own
    name: an LSTM's ``"lstm.weight_ih"`` lives in ``"lstm.ih"``)."""
    return next(e.name for e in net.ensembles if isinstance(e, Ensemble)
                for f in e.params if e.field_name(f.name) == param_name)


def _random_data(net: Net, ens: DataEnsemble, rng: np.random.Generator) -> np.ndarray:
    """Class indices for a ``(1,)`` label (the first input of the ensembles that read it
    gives the class count), targets in [0, 1) for other labels, ids for an embedding's
    input, standard normal values for the rest; ``(time_steps, batch, *shape)`` with time
    steps."""
    lead = (net.time_steps, net.batch_size) if net.time_steps > 1 else (net.batch_size,)
    shape = (*lead, *ens.shape)
    vocab = [e.vocab_size for e in net.ensembles if getattr(e, "ids", None) is ens]
    if vocab:
        return rng.integers(0, min(vocab), shape).astype(np.float32)
    if _is_label(net, ens):
        readers = [e for e in net.ensembles if isinstance(e, NormalizationEnsemble)
                   and any(i is ens for i in e.inputs)]
        if ens.size == 1:
            classes = min(e.inputs[0].size for e in readers)
            return rng.integers(0, classes, shape).astype(np.float32)
        return rng.random(shape, dtype=np.float32)
    return rng.standard_normal(shape, dtype=np.float32)


def _is_label(net: Net, ens: DataEnsemble) -> bool:
    """Whether only loss-like ensembles read ``ens``, and never as their first input."""
    readers = [e for e in net.ensembles if isinstance(e, NormalizationEnsemble)
               and any(i is ens for i in e.inputs)]
    return (bool(readers) and all(e.inputs[0] is not ens for e in readers)
            and not any(c.source is ens for c in net.connections))


class _Feed:
    """The data source of every data ensemble of a net under check: fixed arrays."""

    def __init__(self, net: Net, data: dict[str, np.ndarray]):
        self.data = {net.ensemble(name): x for name, x in data.items()}
        for ens in self.data:
            ens.source = self

    def load(self, net: Net, phase: Phase) -> int:
        for ens, x in self.data.items():
            net.value(ens)[...] = x
        return net.batch_size


def _fix_before_forward(ref: Net, net: Net) -> None:
    """Draw each ``before_forward`` once (in ``ref``) and give both nets the ``Batch`` fields
    it drew for every training forward from now on (the test phase keeps its own)."""
    for r in ref.ensembles:
        if not isinstance(r, Ensemble) or type(r).before_forward is Ensemble.before_forward:
            continue
        r.before_forward(Phase.TRAIN, {name: ref.field(r, name) for name in r.fields})
        drawn = {name: ref.field(r, name).copy() for name, f in r.fields.items()
                 if f.spec.kind is FieldKind.BATCH}
        for n in (ref, net):
            ens = n.ensemble(r.name)
            ens.before_forward = _fixed(type(ens).before_forward.__get__(ens), drawn)


def _fixed(original: Callable, drawn: dict[str, np.ndarray]) -> Callable:
    def before_forward(phase: Phase, fields: dict[str, np.ndarray]) -> None:
        if phase is Phase.TRAIN:
            for name, x in drawn.items():
                fields[name][...] = x
        else:
            original(phase, fields)
    return before_forward


def _shows_value(net: Net, ens, phase: Phase) -> bool:
    """Whether ``net.value(ens)`` holds ``ens``'s values after a forward of ``phase``: not
    when an in-place activation overwrote them; in the test phase (where a fused group's
    intermediates never reach memory) only for what losses and outputs read."""
    if any(isinstance(e, ActivationEnsemble) and e.source is ens for e in net.ensembles):
        return False
    if phase is Phase.TEST:
        return any(isinstance(e, NormalizationEnsemble) and any(i is ens for i in e.inputs)
                   for e in net.ensembles)
    return not isinstance(ens, DataEnsemble)


def _has_grad(net: Net, ens) -> bool:
    """Whether ``net.grad(ens)`` is a gradient of the loss to check: in-place activations
    share their source's (which holds d loss / d the source's values once backward is done),
    losses have none, data ensembles only when their gradient is computed and they are not
    labels."""
    if isinstance(ens, (ActivationEnsemble, NormalizationEnsemble)):
        return False
    return not isinstance(ens, DataEnsemble) or (getattr(ens, "needs_grad", False)
                                                 and not _is_label(net, ens))


def _diff(got: np.ndarray, want: np.ndarray, floor: float = 0.0) -> float:
    """The largest error relative to ``want``'s largest entry (at least ``floor``)."""
    scale = max(float(np.max(np.abs(want), initial=0.0)), floor)
    err = float(np.max(np.abs(got - want), initial=0.0))
    return err / scale if scale > 0 else (0.0 if err == 0 else np.inf)


def _grad_floor(ref: Net, owner: str, param) -> float:
    """The smallest scale a parameter gradient is judged at: its :func:`sum_rounding` over
    the tolerance."""
    return sum_rounding(ref, param) / CLOSE


def sum_rounding(net: Net, param) -> float:
    """How far float32 rounding may move an entry of ``param``'s gradient: it sums the
    owner's gradient over the batch and the neurons that share one parameter row, so a
    gradient that is exactly zero (a bias before a batch norm) comes out as that much
    noise at any level."""
    owner = net.ensemble(_owner(net, param.name))
    if not _has_grad(net, owner):
        return 0.0
    rows = param.value.shape[0] if param.value.ndim else 1
    total = float(np.abs(net.grad(owner)).sum())
    return ROUNDING * total / rows * float(np.finfo(np.float32).eps)


def _worst(row: Row, column: str, err: float) -> None:
    old = getattr(row, column)
    setattr(row, column, err if old is None or not err <= old else old)


def _record(row: Row, column: str, errors: list[float | None]) -> None:
    for err in errors:
        if err is None:
            row.inconclusive += 1
        else:
            _worst(row, column, err)


# ---------------------------------------------------------------- finite differences
class _FiniteDifferences:
    """Probes of a level-0 net's loss: perturb a parameter or the values an ensemble's
    forward step left, and rerun the forward steps (one per ensemble) that follow."""

    def __init__(self, net: Net, rng: np.random.Generator, probes: int):
        self.net, self.rng, self.probes = net, rng, probes
        self.steps = net.program.forward
        order = {e: i for i, e in enumerate(net.ensembles)}
        self.position = [order[_step_ensemble(s)] for s in self.steps]
        # a time loop reruns whole: its ensembles' probes start at its first one
        self.loop_start = {e: order[s.ensembles[0]] for s in self.steps
                           if isinstance(s, TimeSteps) for e in s.ensembles}
        self.order = order

    def value_probes(self, ens, g: np.ndarray) -> list[float | None]:
        """Probes of d loss / d ``ens``'s values as its own forward step leaves them (none
        for an ensemble of a time loop: rerunning the loop recomputes them)."""
        if ens in self.loop_start:
            return [None] * self.probes
        live = self.net.value(ens)
        loss = functools.partial(self._rerun_from(self.order[ens] + 1), live)
        x = live.copy()
        return [self._probe(x, g, loss) for _ in range(self.probes)]

    def param_probes(self, ens, param, g: np.ndarray) -> list[float | None]:
        """Probes of d loss / d ``param`` of ``ens``."""
        base = param.value.copy()
        start = self.loop_start.get(ens, self.order[ens])
        loss = functools.partial(self._rerun_from(start), param.value)
        try:
            return [self._probe(base, g, loss) for _ in range(self.probes)]
        finally:
            param.value[...] = base

    def _rerun_from(self, position: int) -> Callable[[np.ndarray, np.ndarray], float]:
        """Run the forward steps before the ensemble at ``position`` once, and return
        ``loss(live, moved)``: write ``moved`` into the live array ``live``, rerun the steps
        from there and return the loss.
        Values the later steps overwrite in place (an activation's source) are restored
        before each rerun."""
        k = next((i for i, p in enumerate(self.position) if p >= position), len(self.steps))
        for source in self.net.data_sources():
            source.load(self.net, Phase.TRAIN)
        self.net.run_steps(self.steps[:k])
        saved = [(self.net.value(a.source), self.net.value(a.source).copy())
                 for a in self.net.ensembles if isinstance(a, ActivationEnsemble)
                 and self.order[a] >= position > self.order[a.source]]

        def loss(live: np.ndarray, moved: np.ndarray) -> float:
            for overwritten, x in saved:
                overwritten[...] = x
            live[...] = moved
            self.net.run_steps(self.steps[k:])
            return self.net.loss
        return loss

    def _probe(self, x: np.ndarray, g: np.ndarray, loss: Callable[[np.ndarray], float]) -> float | None:
        """The relative error of ``g`` against central differences along one random
        direction (see the module docstring); None when no step gives a stable one."""
        rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
        signs = self.rng.choice(np.float32((-0.5, 0.5)), x.shape)
        d = (np.abs(x) + np.float32(rms or 1.0)) * (np.sign(g) + signs)
        norm = _dot(np.abs(g), np.abs(d))   # the slope's scale (then also the measured one)
        resolved = LOSS_RESOLUTION * max(abs(loss(x)), 1.0)   # a smaller change is rounding
        for change in LOSS_CHANGES:
            t = min(MAX_STEP, change / norm) if norm > 0 else MAX_STEP
            errors = []
            for step in (t, t / 2):
                plus, minus = x + np.float32(step) * d, x - np.float32(step) * d
                measured = (loss(plus) - loss(minus)) / (2 * step)
                predicted = _dot(g, plus - minus) / (2 * step)   # the steps as rounded
                norm = max(norm, abs(measured), resolved / (2 * step))
                errors.append((measured - predicted) / norm if norm > 0 else 0.0)
            if abs(errors[0] - errors[1]) <= FD_RTOL / 2:
                return abs(errors[1])
        return None


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum(a * b, dtype=np.float64))


def _step_ensemble(step):
    """The ensemble a level-0 forward step (one per ensemble: ``Net(profile=True)``) runs;
    a time loop's first."""
    if isinstance(step, TimeSteps):
        return step.ensembles[0]
    kernels = getattr(step, "kernels", None)
    if kernels is None:
        return step.ensemble
    owners = {k.ensemble for k in kernels}
    if len(owners) != 1 or None in owners:
        raise ValueError("the level-0 build must run one ensemble per step: build it with "
                         "Net(profile=True)")
    return kernels[0].ensemble


def _blame(net: Net, rows: dict[str, Row]) -> None:
    """Mark the ensembles whose backward is the likeliest origin of a wrong gradient: one
    whose parameter gradients are wrong while the gradient it receives is right; the readers
    of a wrong gradient (through in-place activations, whose own gradient is overwritten)
    when the gradients they receive are right. Losses count as receiving the right one."""
    def fine(e) -> bool:
        r = rows[e.name]
        return isinstance(e, NormalizationEnsemble) or r.fd_grad is not None and r.fd_grad <= FD_RTOL

    for e in net.ensembles:
        row = rows[e.name]
        if row.fd_params is not None and not row.fd_params <= FD_RTOL and fine(e):
            row.suspect = True
        if row.fd_grad is not None and not row.fd_grad <= FD_RTOL:
            chain, ends, todo = [], [], readers(net, e)
            while todo:
                r = todo.pop(0)
                if isinstance(r, ActivationEnsemble):
                    chain.append(r)
                    todo += readers(net, r)
                else:
                    ends.append(r)
            if all(fine(r) for r in ends):
                for r in chain + ends:
                    rows[r.name].suspect = True
