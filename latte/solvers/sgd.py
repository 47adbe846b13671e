"""The training loop: epochs of forward / backward / update, then a test pass."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from latte.errors import TrainingError
from latte.lang import NormalizationEnsemble, Phase
from latte.overrides import pick
from latte.plot import draw_beside
from latte.runtime import distributed
from latte.solvers import log as logs
from latte.solvers import snapshots
from latte.solvers.algorithms import Solver
from latte.solvers.policies import LRPolicy, MomPolicy


@dataclass
class SolverParameters:
    """What every solver shares: the rate and momentum schedules, the epochs, the L2
    coefficient (``regu_coef * decay_mult * param`` added to each gradient) and where
    snapshots go. ``clip_gradients=c`` scales all gradients together so that their global
    L2 norm is at most ``c`` (torch's ``clip_grad_norm_``), before the L2 term.

    In ``snapshot_dir``, :func:`solve` writes ``log.csv`` and ``iterations.csv`` (see
    :mod:`latte.solvers.log`; under ``latte run`` also ``curves.png``) and a snapshot
    ``snapshot_<iteration>.npz`` every ``snapshot_every`` iterations (None: after each
    epoch's test pass) and after the last epoch, keeping the newest ``keep_snapshots``.
    ``resume`` (``latte run --resume``) continues from the newest snapshot there; a new run
    refuses a folder holding another run's snapshots or log unless ``overwrite``
    (``--overwrite``) says to delete them."""

    lr_policy: object = field(default_factory=lambda: LRPolicy.Fixed(0.01))
    mom_policy: object = field(default_factory=lambda: MomPolicy.Fixed(0.0))
    max_epoch: int = 1
    regu_coef: float = 0.0
    snapshot_dir: str | None = None
    clip_gradients: float | None = None
    snapshot_every: int | None = None
    keep_snapshots: int = 3
    resume: bool = False
    overwrite: bool = False

    def __post_init__(self):
        self.max_epoch = int(pick("max_epoch", self.max_epoch))
        self.resume = bool(pick("resume", self.resume))
        self.overwrite = bool(pick("overwrite", self.overwrite))
        if self.snapshot_every is not None and not int(self.snapshot_every) >= 1:
            raise ValueError(f"snapshot_every must be a positive number of iterations or None, "
                             f"got {self.snapshot_every}")
        if not int(self.keep_snapshots) >= 1:
            raise ValueError(f"keep_snapshots must be at least 1, got {self.keep_snapshots}")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other")
        if self.clip_gradients is not None and not self.clip_gradients > 0:
            raise ValueError(f"clip_gradients must be positive, got {self.clip_gradients}")


@dataclass
class History:
    """What training produced: one loss per iteration, one test accuracy per epoch."""

    train_loss: list[float] = field(default_factory=list)
    test_accuracy: list[float] = field(default_factory=list)
    test_loss: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)


def _test(net) -> tuple[float | None, float | None]:
    """Accuracy and loss over the whole test set (None when there is no test set).

    Accuracy comes from the first ensemble that scores predictions (``counts``): an
    AccuracyLayer, or a softmax loss's arg-max.
    """
    sources = net.data_sources()
    if not sources or any(s.num_samples(Phase.TEST) == 0 for s in sources):
        return None, None
    accs = [e for e in net.ensembles
            if isinstance(e, NormalizationEnsemble) and e.counts is not None]
    for s in sources:
        s.reset(Phase.TEST)
    hits = count = loss_sum = 0.0
    for _ in range(max(s.batches_per_epoch(Phase.TEST) for s in sources)):
        net.forward(Phase.TEST)
        # items in this batch over all ranks (the loss is already averaged over them)
        valid = float(accs[0].counts[1] if accs else
                      distributed.allreduce_sum(np.array([net.valid], np.float64))[0])
        if accs:
            hits += accs[0].counts[0]
        loss_sum += net.loss * valid
        count += valid
    return (hits / count if accs else None), loss_sum / count


def solve(solver: Solver, net, progress=None) -> History:
    """Train ``net`` for ``max_epoch`` epochs; returns the :class:`History` (of the
    iterations this call ran: a resumed run's starts where the snapshot was taken).

    ``progress`` (optional) is called as ``progress(event, **info)`` for ``"iteration"``
    and ``"epoch"`` events; ``latte run`` uses it for its progress bar.
    """
    progress = progress or pick("progress", None)
    net.init()
    net.compile_update(solver.rule)
    params = solver.params
    distributed.agree({"epochs": params.max_epoch, "the solver": type(solver).__name__,
                       "snapshot_every": params.snapshot_every})
    leader = distributed.rank() == 0   # under MPI only rank 0 logs and writes snapshots
    if params.snapshot_dir:
        snapshots.prepare(net, params.snapshot_dir, resume=params.resume,
                          overwrite=params.overwrite)
    sources = net.data_sources()
    iters = max((s.batches_per_epoch(Phase.TRAIN) for s in sources), default=1)
    history = History()
    it = int(net.solver_state.get("iteration", 0))
    start_epoch = int(net.solver_state.get("epoch", 0))
    start_batch = int(net.solver_state.get("batch", 0))   # a snapshot taken inside an epoch
    log = logs.Log(params.snapshot_dir if leader else None, it)
    every = params.snapshot_every

    def snapshot(state: dict) -> None:
        net.solver_state = state
        if params.snapshot_dir:
            log.flush()
            snapshots.write(net, params.snapshot_dir, it, params.keep_snapshots)

    for epoch in range(start_epoch, params.max_epoch):
        t0 = time.perf_counter()
        for batch in range(start_batch if epoch == start_epoch else 0, iters):
            net.forward(Phase.TRAIN)
            loss = net.loss
            if not math.isfinite(loss):
                raise TrainingError(f"the loss became {loss} at iteration {it} (epoch {epoch}); "
                                    "lower the learning rate or check the data")
            net.backward()
            solver.step(net, it)
            bad = net.nonfinite_params()
            if bad:
                raise TrainingError(f"parameter {bad[0]!r} became non-finite (NaN or inf) at "
                                    f"iteration {it} (epoch {epoch}); lower the learning rate, "
                                    "clip the gradients or check the data")
            history.train_loss.append(loss)
            it += 1
            log.iteration(it, epoch, loss)
            if every and it % every == 0 and batch + 1 < iters:
                snapshot({"iteration": it, "epoch": epoch, "batch": batch + 1})
            if progress:
                progress("iteration", epoch=epoch, iteration=it, iterations=iters, loss=loss,
                         images=net.batch_size * distributed.world_size())
        history.epoch_seconds.append(time.perf_counter() - t0)
        net.resync()
        acc, test_loss = _test(net)
        if acc is not None:
            history.test_accuracy.append(acc)
        if test_loss is not None:
            history.test_loss.append(test_loss)
        log.epoch(epoch, it, history.train_loss[-1] if history.train_loss else None, test_loss,
                  acc)
        if not every or it % every == 0 or epoch + 1 == params.max_epoch:
            snapshot({"iteration": it, "epoch": epoch + 1})
        else:
            net.solver_state = {"iteration": it, "epoch": epoch + 1}
        if progress:
            progress("epoch", epoch=epoch, accuracy=acc, test_loss=test_loss,
                     train_loss=history.train_loss[-1] if history.train_loss else None)
    if log.path and pick("plot", False):   # latte run draws the curves
        draw_beside(log.path)
    return history

