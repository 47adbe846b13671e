"""``net.predict``: a ``Phase.TEST`` forward over any number of samples, ``batch_size`` at
a time, on the compiled program (nothing is recompiled per call).

The samples go straight into the values of the net's input ensemble; no data source is
asked for a batch, so a training run's order, shuffling and read-ahead stay as they were
(a data layer's ``transform`` is not applied: pass samples as the ensemble takes them).
Only the steps the output depends on run: loss and accuracy layers (whose reductions are
collective under MPI) are skipped unless the output depends on them. The test program
keeps a fused group's intermediate values in line buffers and the others in the arena
(:mod:`latte.compiler.test_values`); an output that is such a value is computed by the
training program's forward steps, run in the test phase.

Samples map to an ensemble's value view through :func:`to_buffer` and back through
:func:`from_buffer`; a view with a leading time dimension, ``(T, batch, *shape)``, takes
samples ``(n, T, *shape)`` (sample-major, as datasets are).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from latte.compiler import HostStep, flat_steps
from latte.compiler.ir import accesses
from latte.errors import LatteError, ShapeError
from latte.lang import DataEnsemble, Ensemble, NormalizationEnsemble, Phase, sources


@dataclass(frozen=True)
class PredictPlan:
    """What predicting ``output`` runs: the input it feeds and the steps it runs."""

    input: DataEnsemble
    output: object
    steps: tuple
    before_forward: tuple   # the output's ancestors that prepare fields (dropout's mask)
    phase: str = "test"     # the program the steps are of ("forward": the training one)


_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # net -> {output: plan}


def predict(net, x, output=None) -> np.ndarray:
    """``output``'s values for the samples ``x``: a new float32 array
    ``(n, *output.shape)``. See :meth:`latte.net.Net.predict`."""
    net.init()
    plan = _plan(net, output)
    x_in, x_out = net.value(plan.input), net.value(plan.output)
    sample = _sample_shape(x_in, plan.input)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != len(sample) + 1 or x.shape[1:] != sample:
        raise ShapeError(f"predict: input ensemble {plan.input.name!r} takes samples of shape "
                         f"{sample}: x must be (n, {', '.join(map(str, sample))}), got "
                         f"{x.shape}")
    n, batch = len(x), net.batch_size
    out = np.empty((n, *_sample_shape(x_out, plan.output)), np.float32)
    prepare_fields(net, plan)
    for ens in net.ensembles:
        if isinstance(ens, NormalizationEnsemble):
            ens.phase = Phase.TEST
    for lo in range(0, n, batch):
        count = min(batch, n - lo)
        to_buffer(x_in, plan.input, x[lo:lo + count])
        net.valid = count   # the loss-free steps ignore it; a host step may not
        net.run_steps(list(plan.steps), plan.phase)
        out[lo:lo + count] = from_buffer(x_out, plan.output, count)
    return out


def prepare_fields(net, plan: PredictPlan) -> None:
    """Have the ensembles that prepare fields for ``plan`` do so for ``Phase.TEST``
    (dropout's all-ones mask)."""
    for ens in plan.before_forward:
        ens.before_forward(Phase.TEST, {name: net.field(ens, name) for name in ens.fields})


def to_buffer(view: np.ndarray, ens, samples: np.ndarray) -> None:
    """Write ``samples`` into the first batch items of ``ens``'s value ``view`` and zero the
    rest (the padding of a last, partial batch)."""
    k = len(samples)
    if _timed(view, ens):
        view[:, :k] = samples.swapaxes(0, 1)
        view[:, k:] = 0.0
    else:
        view[:k] = samples
        view[k:] = 0.0


def from_buffer(view: np.ndarray, ens, count: int) -> np.ndarray:
    """The first ``count`` batch items of ``ens``'s value ``view``, sample-major."""
    return view[:, :count].swapaxes(0, 1) if _timed(view, ens) else view[:count]


def _timed(view: np.ndarray, ens) -> bool:
    """Whether ``view`` is ``(T, batch, *shape)`` rather than ``(batch, *shape)``."""
    return view.ndim == len(ens.shape) + 2


def _sample_shape(view: np.ndarray, ens) -> tuple[int, ...]:
    """One sample's shape: ``ens.shape``, after the time steps when there are some."""
    return (view.shape[0], *ens.shape) if _timed(view, ens) else tuple(ens.shape)


def _plan(net, output) -> PredictPlan:
    plans = _plans.setdefault(net, {})
    out = _output(net, output)
    if out not in plans:
        plans[out] = _make_plan(net, out)
    return plans[out]


def _output(net, output):
    """The ensemble ``output`` names; by default the input of the first loss layer, else
    the last ensemble added."""
    if output is not None:
        try:
            return net.ensemble(output)
        except KeyError:
            names = ", ".join(repr(e.name) for e in net.ensembles)
            raise LatteError(f"predict: no ensemble named {output!r} in this net (it has "
                             f"{names})") from None
    for e in net.ensembles:
        if isinstance(e, NormalizationEnsemble) and e.is_loss:
            return e.inputs[0]
    if not net.ensembles:
        raise LatteError("predict: the net has no ensembles")
    return net.ensembles[-1]


def _ancestors(net, ens) -> list:
    """``ens`` and every ensemble whose values it depends on, in net order."""
    seen, todo = {id(ens): ens}, [ens]
    while todo:
        for s in sources(net, todo.pop()):
            if id(s) not in seen:
                seen[id(s)] = s
                todo.append(s)
    return [e for e in net.ensembles if id(e) in seen]


def _make_plan(net, out) -> PredictPlan:
    ancestors = _ancestors(net, out)
    inputs = [e for e in ancestors if isinstance(e, DataEnsemble)]
    if len(inputs) != 1:
        names = ", ".join(repr(e.name) for e in inputs) or "none"
        raise LatteError(f"predict: output {out.name!r} depends on {len(inputs)} input "
                         f"ensembles ({names}); predict feeds exactly one (a MemoryDataLayer "
                         "or an ArrayDataLayer's data)")
    program, bufs = net.program, net.program.buffers
    mine = {id(e) for e in ancestors}
    value = bufs.value_home(out)   # what kernels write (a zero-copy join's)

    def needed(steps: list) -> list:   # host steps only where the output depends on them
        return [s for s in steps if not isinstance(s, HostStep) or id(s.ensemble) in mine]

    steps, phase = needed(program.test), "test"
    if not isinstance(out, DataEnsemble) and (not _writes(steps, value, bufs)
                                              or value in program.test_values):
        # an intermediate of the test program (in a fused group's line buffers, or in the
        # arena): the training forward stores it
        steps, phase = needed(program.forward), "forward"
    prepare = tuple(e for e in ancestors if isinstance(e, Ensemble)
                    and type(e).before_forward is not Ensemble.before_forward)
    return PredictPlan(inputs[0], out, tuple(steps), prepare, phase)


def _writes(steps, buffer, bufs) -> bool:
    """Whether one of ``steps`` (a time loop's included) writes ``buffer``."""
    return any(bufs.value(s.ensemble) == buffer if isinstance(s, HostStep) else
               any(a.written and bufs.base(a.buffer) == buffer for k in s.kernels
                   for a in accesses(k.body))
               for s in flat_steps(steps))
