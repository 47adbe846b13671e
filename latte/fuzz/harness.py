"""Differential checks of random nets: an optimized level against level 0, and level 0
against the reference interpreter (float64, straight from the lang objects).

:func:`check_cases` builds the cases into one net per opt level, gives both the same
parameters and inputs, and compares forward values, every ensemble's gradient, every
parameter gradient and the parameters after each of three SGD steps; level 0 against the
reference one step at a time (from level 0's parameters), skipping entries that hang on a
near-tie; both comparisons allow each entry the difference that rounding alone makes to it
(see :func:`_reference_step`). Nets compile with ``LATTE_CHECK_BOUNDS=1``; a third of the
cases compile the optimized net with each kernel a segment of its own (the pieces that
``schedule.cut`` makes of costly segments), and half with every tiled product that stores
its C whole streaming its stores (:data:`latte.compiler.passes.stream.EVERY`: these nets are
too small to stream otherwise), and the other half with Winograd's 4x4 output tiles wherever
it takes 2x2 ones (``LATTE_WINOGRAD=4``: few of them have products large enough otherwise);
across both halves, half take the products of Winograd's blocks of items once over the
whole batch (:data:`latte.compiler.passes.winograd.SPREAD_EVERY`). After the last step
both nets run a ``Phase.TEST`` forward, whose intermediate values share the arena
(:mod:`latte.compiler.test_values`), and then the same steps on the net's own buffers: the
outputs must be equal, bit for bit. Last, from level 0's parameters and running statistics,
the optimized test forward (its own fused groups, line buffers and locals) must agree with
level 0's within the levels' tolerance.
Mismatches are returned as :class:`Mismatch` records naming their case's seed.

Each entry may differ by a tolerance relative to its array's scale, plus the larger of two
measures of rounding: its *window*, float32's rounding bound, an interval around the exact
value which the reference computes along with it (:mod:`latte.reference.rounding`: wide
where float32 cannot do better, terms that cancel in a sum, a softmax of large logits, a
value float32 cannot hold, and only there; level 0 must lie in it, and a level L too, so
the two may differ by its width), and its *spread*, how far the jittered references move
it, their moves added (what rounding does to a branch: a tie, an ``if`` on a sum that is
zero but for rounding, which the window does not model).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import numpy as np

from latte import Net, Phase
from latte.compiler import schedule, stored
from latte.compiler.description import describe
from latte.compiler.fingerprint import fingerprint
from latte.compiler.graph_checks import check_graph
from latte.compiler.passes import stream, winograd
from latte.fuzz.nets import Case, Config, build_case, case_of, config, normal
from latte.lang import DataEnsemble, NormalizationEnsemble, sources
from latte.stdlib import DropoutEnsemble

STEPS = 3                       # SGD steps after the first forward/backward
LR = 0.01                       # the largest first step of any parameter element
SGD = (0.5, 0.01)               # momentum, regu_coef
TOL_LEVELS = 1e-4               # float32 against float32, relative to the array's scale, per
                                # time step (recurrence carries each step's rounding onward)
TOL_REFERENCE = 2e-4            # float32 against float64
ATOL = 1e-5                     # float32 rounding of what an array's tiny entries sum
NUDGE = 1e-5                    # a nudge that shows which entries hang on a near-tie
JITTER = 4 * 2.0**-24           # a perturbation of every computed value, the size of what
                                # float32 rounds it by (2**-24 at most; exp, tanh: 2 ulp)
JITTER_PAIRS = (2, 8)           # jittered references of opposite signs, each pair its own draws
                                # (a tie among k entries must go to each in one of them: case
                                # 57937): the first pairs, then all where those fall short


@dataclass(frozen=True)
class Mismatch:
    """One array that differs: which case, which comparison, how much."""

    seed: int | None
    what: str          # e.g. "step 1 grad c3_2neuron"
    against: str       # "level 0" or "reference"
    error: float
    scale: float
    index: tuple
    bound: float = 0.0   # what the error there had to stay under

    def __str__(self) -> str:
        return (f"case {self.seed}: {self.what} differs from {self.against}: max error "
                f"{self.error:.3g} at {self.index} (scale {self.scale:.3g}, bound {self.bound:.3g})")


def _errors(got, want, tol: float, window: tuple = (0.0, 0.0)) -> tuple[np.ndarray, np.ndarray,
                                                                         float]:
    """Per-entry errors, the bounds they must stay under (:func:`_bound`, plus rounding's
    ``window``: ``got - want`` may reach ``-window[0]`` and ``window[1]``; NaN where both are
    infinite, anything where ``want`` is NaN) and ``want``'s scale."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    below, above = (np.broadcast_to(w, want.shape) for w in window)
    bound, scale = _bound(want, tol, np.isfinite(below) & np.isfinite(above))
    with np.errstate(invalid="ignore"):
        diff = got - want
        side = np.where(np.isnan(diff), np.minimum(below, above), np.where(diff < 0, below, above))
    err = np.abs(diff)
    err[np.isnan(got) != np.isnan(want)] = np.inf
    return np.nan_to_num(err, nan=0.0), bound + np.where(np.isnan(side), np.inf, side), scale


def _bound(want: np.ndarray, tol: float, held=True) -> tuple[float, float]:
    """The bound of errors against ``want`` and its scale (the bound is relative to it):
    the largest entry float32 can hold (where ``held``)."""
    held = np.broadcast_to(held, np.shape(want)) & ~np.isnan(want)
    scale = max(float(np.abs(want, where=held, out=np.zeros(np.shape(want))).max()), 1e-2)
    return tol * scale + ATOL, scale


def _compare(out: list, what: str, name: str, got, want, tol: float, against: str,
             fragile: np.ndarray | None = None, spread: np.ndarray | None = None,
             window: tuple = (0.0, 0.0)) -> None:
    """Record a mismatch of ``got`` against ``want``, ignoring ``fragile`` entries and
    allowing each entry, beyond the bound, the larger of its ``spread`` (how far rounding
    moves it, see :func:`_reference_step`) and its rounding ``window`` (see :func:`_errors`)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        out.append(Mismatch(case_of(name), f"{what} {name} shape {got.shape} vs {want.shape}",
                            against, np.inf, 0.0, ()))
        return
    if got.size == 0:
        return
    err, bound, scale = _errors(got, want, tol, window)
    if spread is not None:
        bound = np.fmax(bound, tol * scale + ATOL + spread)
    if fragile is not None:
        err[fragile] = 0.0
    if not (err <= bound).all():
        excess = np.where(err <= bound, -np.inf, err - bound)
        idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(excess)), err.shape))
        out.append(Mismatch(case_of(name), f"{what} {name}", against, float(err[idx]), scale,
                            idx, float(bound[idx])))


def build(seeds: list[int], cfg: Config, level: int, loss: Callable | None = None,
          derived: float = 0.0):
    """One net at ``level`` holding every case of ``seeds`` (compiled)."""
    os.environ.setdefault("LATTE_CHECK_BOUNDS", "1")
    os.environ.setdefault("LATTE_VERIFY", "steps")
    net = Net(cfg.batch, time_steps=cfg.time_steps, num_threads=cfg.threads, opt_level=level,
              seed=0)
    cases = [build_case(net, s, loss, derived) for s in seeds]
    check_graph(net)   # what compile_net does to the net before describing it
    described = describe(net, (level, False, 1)).key
    net.init()
    if describe(net, (level, False, 1)).key != described:
        raise AssertionError(f"cases {seeds}: the net's description changed as it compiled")
    return net, cases


def _inputs(rngs: dict, net: Net, cases: list[Case]) -> dict[str, np.ndarray]:
    feed = {}
    for case in cases:
        rng = rngs[case.seed]
        for e in case.inputs:
            feed[e.name] = normal(rng, net.value(e.name).shape)
        for e, n in case.labels:
            feed[e.name] = rng.integers(0, n, net.value(e.name).shape).astype(np.float32)
    return feed


def _computed(net: Net) -> list:
    return [e for e in net.ensembles if not isinstance(e, NormalizationEnsemble)]


def check_cases(seeds: list[int], *, level: int | None = None, reference: bool = True,
                loss: Callable | None = None, derived: float = 0.0,
                timings: dict | None = None) -> list[Mismatch]:
    """Run cases ``seeds`` (they share ``config(seeds[0])``; ``level`` overrides its
    optimized level) and return every mismatch found. ``derived``: the fraction of
    generated neurons left without ``backward``.

    The cases run first against the bounded reference alone, which allows each entry its
    window but no spread and skips no fragile entry (:func:`_reference_step`): every
    allowance the others make widens a bound or skips an entry, and they change nothing
    else, so what passes so passes with them. Only where something differs do the cases run
    again with the others: the nudged references and the first :data:`JITTER_PAIRS`
    jittered pairs, then, where something still differs, all of them (more pairs only add
    to the allowances); the last run decides."""
    found = _check(seeds, level, reference, loss, derived, timings, pairs=0)
    for pairs in JITTER_PAIRS if reference else ():
        if found:
            found = _check(seeds, level, reference, loss, derived, timings, pairs)
    return found


def _check(seeds: list[int], level: int | None, reference: bool, loss: Callable | None,
           derived: float, timings: dict | None, pairs: int) -> list[Mismatch]:
    """:func:`check_cases`'s run, with the bounded reference alone (``pairs`` 0) or the
    nudged ones too and ``pairs`` pairs of jittered ones."""
    cfg = config(seeds[0])
    level = cfg.level if level is None else level
    timings = {} if timings is None else timings
    start = time.process_time()
    base, cases = build(seeds, cfg, 0, loss, derived)
    timings["compile0"] = timings.get("compile0", 0.0) + time.process_time() - start
    start = time.process_time()
    pieces = 1 if seeds[0] % 3 == 0 else schedule.PIECE_COST   # each kernel a segment
    four = {"LATTE_WINOGRAD": "4"} if seeds[0] % 2 == 0 else {}   # F(4x4, 3x3)'s tiles
    spread = seeds[0] % 4 in (0, 1)   # Winograd's blocks of items: products over the batch
    with _set(schedule, "PIECE_COST", pieces), _set(stream, "EVERY", seeds[0] % 2 == 1), \
            _set(winograd, "SPREAD_EVERY", spread), mock.patch.dict(os.environ, four):
        opt, _ = build(seeds, cfg, level, loss, derived)
    timings["compileL"] = timings.get("compileL", 0.0) + time.process_time() - start
    _check_stored(seeds, base, opt)
    rngs = {c.seed: np.random.default_rng([c.seed, 7]) for c in cases}   # a case's own draws
    for p, q in zip(base.params, opt.params, strict=True):
        assert p.name == q.name
        p.value[...] = normal(rngs[case_of(p.name)], p.value.shape, 0.5)
        q.value[...] = p.value
    feeds = [_inputs(rngs, base, cases) for _ in range(STEPS + 1)]
    refs = _references(base, pairs) if reference else None
    spread: dict = {}   # (store, name) -> how far rounding moves each entry, this step
    nudges = np.random.default_rng([*seeds, 11])
    labels = {e.name for c in cases for e, _ in c.labels}   # class indices: never nudged
    out: list[Mismatch] = []
    against = (f"level 0 (level {level}, batch {cfg.batch}, {cfg.time_steps} time step(s), "
               f"{cfg.threads} thread(s))")
    lr = None
    tol = TOL_LEVELS * cfg.time_steps
    for step, feed in enumerate(feeds):
        start = time.process_time()
        for net in (base, opt):
            for name, x in feed.items():
                net.value(name)[...] = x
            net.forward(Phase.TRAIN)
            net.backward()
        timings["run"] = timings.get("run", 0.0) + time.process_time() - start
        bounds = None
        if refs is not None:
            start = time.process_time()
            spread, fragile = _reference_step(out, refs, base, feed, labels, step, nudges)
            bounds = refs[0].bounds
            timings["reference"] = timings.get("reference", 0.0) + time.process_time() - start
        _compare_nets(out, f"step {step}", base, opt, tol, against, spread, bounds)
        if step == STEPS:
            break
        if lr is None:   # steps of at most LR per element: random nets are steep
            lr = LR / max([1.0, *(float(np.abs(p.grad).max()) for p in base.params)])
        for net in (base, opt):
            net.update(lr, *SGD)
        if refs is not None:
            _reference_update(out, refs[0], base, step, lr, fragile)
        _compare_updates(out, f"step {step} update", base, opt, tol, against, spread, bounds)
    for net in (base, opt):
        _check_test_forward(out, net)
    _compare_test_forwards(out, base, opt, tol, against)
    return out


def _test_outputs(net: Net) -> list:
    """The ensembles whose values a test forward must leave right: those no ensemble reads,
    and the inputs of host steps."""
    read = {id(s) for e in net.ensembles if not isinstance(e, NormalizationEnsemble)
            for s in sources(net, e)}
    outputs = [e for e in net.ensembles if id(e) not in read or any(
        e in n.inputs for n in net.ensembles if isinstance(n, NormalizationEnsemble))]
    return [e for e in _computed(net) if e in outputs]


def _compare_test_forwards(out: list, base: Net, opt: Net, tol: float, against: str) -> None:
    """Compare the optimized net's test forward (its own groups, line buffers and locals)
    with level 0's, both from level 0's parameters and running statistics."""
    for p, q in zip(base.params, opt.params, strict=True):
        q.value[...] = p.value
    for key, v in base.state.items():
        opt.state[key][...] = v
    for net in (base, opt):
        net.forward(Phase.TEST)
    for e in _test_outputs(base):
        _compare(out, "test forward value", e.name, opt.value(e.name), base.value(e), tol, against)


def _check_test_forward(out: list, net: Net) -> None:
    """Record where ``net``'s test forward, its intermediate values in the arena, gives
    outputs (the values no ensemble reads, the inputs of host steps) other than the same
    steps give on the net's own buffers."""
    net.forward(Phase.TEST)
    got = {e.name: net.value(e).copy() for e in _test_outputs(net)}
    net.run_steps(net.program.test, "forward")
    for name, value in got.items():
        if not np.array_equal(value, net.value(name), equal_nan=True):
            err = np.abs(value.astype(np.float64) - net.value(name))
            idx = tuple(int(i) for i in np.unravel_index(int(np.nanargmax(err)), err.shape))
            out.append(Mismatch(case_of(name), f"test forward value {name}",
                                f"the test steps on its own buffers (level {net.opt_level})",
                                float(err[idx]), 0.0, idx))


@contextlib.contextmanager
def _set(owner, name: str, value):
    """``owner.name`` (a module's setting: :data:`~latte.compiler.schedule.PIECE_COST`,
    :data:`~latte.compiler.passes.stream.EVERY`) set to ``value`` meanwhile."""
    kept = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, kept)


def _check_stored(seeds: list[int], base: Net, opt: Net) -> None:
    """What a warm ``net.init()`` relies on, for these cases: two equal builds describe
    alike, and the optimized program comes back from its pickle bound to the net's own
    ensembles, with the fingerprint of the program it was."""
    settings = (opt.opt_level, False, 1)
    desc = describe(opt, settings)
    if describe(base, settings).key != desc.key:
        raise AssertionError(f"cases {seeds}: two equal nets have different descriptions")
    data = stored.dumps(desc, opt.program, "", 0)
    loaded = None if data is None else stored.loads(desc, data)
    if loaded is None:
        raise AssertionError(f"cases {seeds}: the program does not store and load")
    program = loaded[0]
    if (_fingerprint(program) != _fingerprint(opt.program)
            or any(a is not b for (a, _), (b, _) in zip(program.params, opt.program.params))):
        raise AssertionError(f"cases {seeds}: the stored program differs from the compiled one")


def _fingerprint(program) -> str:
    return fingerprint(program.segments(), program.buffer_index(), program.buffers.threads)


def _compare_nets(out, what: str, base: Net, opt: Net, tol: float, against: str,
                  spread: dict, bounds) -> None:
    """Compare ``opt``'s values and gradients with ``base``'s, allowing each entry its
    ``spread`` (``(store, name)`` -> array) or its window's width (:func:`_width`)."""
    for e in _computed(base):
        _compare(out, f"{what} value", e.name, opt.value(e.name), base.value(e), tol, against,
                 spread=spread.get(("values", e.name)), window=_width(bounds, "values", e.name))
        if not isinstance(e, DataEnsemble) or getattr(e, "needs_grad", False):
            _compare(out, f"{what} grad", e.name, opt.grad(e.name), base.grad(e), tol, against,
                     spread=spread.get(("grads", e.name)), window=_width(bounds, "grads", e.name))
    for p, q in zip(base.params, opt.params):
        _compare(out, f"{what} param grad", p.name, q.grad, p.grad, tol, against,
                 spread=spread.get(("param_grads", p.name)),
                 window=_width(bounds, "param_grads", p.name))


def _compare_updates(out, what: str, base: Net, opt: Net, tol: float, against: str,
                     spread: dict, bounds) -> None:
    """Compare ``opt``'s parameters after an update with ``base``'s, skipping them where
    rounding moved a gradient entry past the bound; then give ``opt`` ``base``'s parameters
    and momenta: the next step compares from one state (the windows hold from there)."""
    for p, q in zip(base.params, opt.params):
        skip = _past(p.grad, spread.get(("param_grads", p.name)), tol)
        _compare(out, what, p.name, q.value, p.value, tol, against, skip,
                 window=_width(bounds, "params", p.name))
        q.value[...], q.history[...] = p.value, p.history


def _width(bounds, store: str, name: str) -> tuple:
    """How far rounding may set an optimized level's entries from level 0's, either way:
    the width of the window both lie in (0 without a reference)."""
    if bounds is None:
        return 0.0, 0.0
    width = getattr(bounds.hi, store)[name] - getattr(bounds.lo, store)[name]
    return width, width


def _around(ref, store: str, name: str) -> tuple:
    """How far below and above the reference's entries level 0 may lie: its window."""
    want = getattr(ref, store)[name]
    return want - getattr(ref.bounds.lo, store)[name], getattr(ref.bounds.hi, store)[name] - want


def _past(want, spread: np.ndarray | None, tol: float) -> np.ndarray:
    """The entries of ``want`` whose ``spread`` exceeds the bound of ``tol``."""
    if spread is None:
        return np.zeros(np.shape(want), bool)
    return spread > _bound(want, tol)[0]


def _references(net: Net, pairs: int) -> list | None:
    """The reference interpreters (or None while ``latte.reference`` is not there): one for
    the comparison, which bounds float32's rounding, and with ``pairs`` more: two that run
    on inputs and parameters nudged by +-NUDGE, and ``pairs`` pairs that perturb every
    value they compute by +-JITTER."""
    try:
        from latte.reference import Reference
    except ImportError:
        return None
    if not pairs:
        return [Reference(net, bounds=True)]
    refs = [Reference(net, bounds=True), *(Reference(net) for _ in range(2 + 2 * pairs))]
    for i, ref in enumerate(refs[3:]):
        ref.jitter = JITTER if i % 2 == 0 else -JITTER
    return refs


def _reference_step(out: list, refs: list, base: Net, feed: dict, labels: set, step: int,
                    rng: np.random.Generator) -> tuple[dict, dict]:
    """Run one step of level 0 on the references (from level 0's parameters, momenta and
    dropout masks), compare, and return ``(spread, fragile)``, each ``(store, name)`` ->
    array (both empty with the bounded reference alone). ``spread``: how far the jittered
    references move each entry, what rounding alone may change (an exact tie or an ``if``
    on a sum that is zero but for rounding moves all the way to the other side; a sum of
    large terms that cancel, as far as their rounding goes); an entry may differ by that
    much more than the bound. A pair breaks a tie two ways: one among more entries may go
    to a third (case 4794). Their moves add up: with the same draws of opposite signs, each
    of several lanes' ties flips in one of the two, and float32 may flip them all (case
    39760: two neurons' ``min(a2, 0.5)`` ties each send a gradient to one input); where
    many ties' flips compound (through a recurrence: case 49903) float32's combination of
    them may move an entry further than one pair's, hence pairs with draws of their own. Entries
    on which the nudged references disagree with the plain one, or that rounding moves
    past the bound, are fragile: a max or an ``if`` decides on a near-tie there, which
    float32 and float64 may break differently; level 0's update is not compared there."""
    _run_references(refs, base, feed, labels, rng, step)
    ref, nudged, jittered = refs[0], refs[1:3], refs[3:]
    spread, fragile = {}, {}

    def check(what: str, name: str, got, store: str) -> None:
        want, near_tie = getattr(ref, store)[name], None
        if jittered:
            spread[store, name] = _moves(jittered, store, name, want).sum(axis=0)
            near_tie = _past(want, _moves(nudged, store, name, want).max(axis=0), TOL_REFERENCE)
            fragile[store, name] = near_tie | _past(want, spread[store, name], TOL_REFERENCE)
        _compare(out, f"step {step} {what}", name, got, want, TOL_REFERENCE, "reference",
                 near_tie, spread.get((store, name)), _around(ref, store, name))

    for e in _computed(base):
        check("value", e.name, base.value(e), "values")
        check("grad", e.name, base.grad(e), "grads")
    for p in base.params:
        check("param grad", p.name, p.grad, "param_grads")
    return spread, fragile


def _run_references(refs: list, base: Net, feed: dict, labels: set,
                    rng: np.random.Generator, step: int) -> None:
    """One forward and backward of each reference from level 0's state: the plain one, the
    nudged ones (parameters by NUDGE relative, inputs by NUDGE absolute: tiny inputs decide
    ties too) and the jittered ones (pair k draws the factors of seed ``k * (STEPS + 1) +
    step``, its two references with opposite signs)."""
    arrays = {**{p.name: p.value for p in base.params}, **feed}
    drawn = {k: NUDGE * rng.standard_normal(v.shape) for k, v in arrays.items()} \
        if len(refs) > 1 else {}
    nudge = {k: v for k, v in drawn.items() if k not in labels}   # class indices stay
    for i, ref in enumerate(refs):
        sign = (0, 1, -1)[i] if i < 3 else 0
        shift = {k: sign * v for k, v in nudge.items()} if sign else {}
        ref.jitter_seed = max(0, i - 3) // 2 * (STEPS + 1) + step
        for p in base.params:
            ref.params[p.name][...] = p.value * (1.0 + shift.get(p.name, 0.0))
            ref.history[p.name][...] = p.history
        for e in base.ensembles:
            if isinstance(e, DropoutEnsemble):
                ref.fields[f"{e.name}.mask"][...] = base.field(e, "mask")
        ref.forward({k: x + shift.get(k, 0.0) for k, x in feed.items()}, phase=Phase.TRAIN)
        ref.backward()


def _moves(others: list, store: str, name: str, want: np.ndarray) -> np.ndarray:
    """Per reference of ``others`` and entry, how far it is from ``want``."""
    return np.array([_errors(getattr(o, store)[name], want, 0.0)[0] for o in others])


def _reference_update(out: list, ref, base: Net, step: int, lr: float, fragile: dict) -> None:
    """Compare level 0's SGD step (already taken) with the reference's."""
    ref.sgd_step(lr, *SGD)
    for p in base.params:
        _compare(out, f"step {step} update", p.name, p.value, ref.params[p.name], TOL_REFERENCE,
                 "reference", fragile.get(("param_grads", p.name)),
                 window=_around(ref, "params", p.name))
