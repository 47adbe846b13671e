"""``Net``: the user's handle on a network, from building it to running compiled code."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from latte import random as latte_random
from latte.aligned import aligned_zeros
from latte.compiler import compile_net
from latte.compiler.blas import pin_other_blas, set_blas_threads
from latte.compiler.jit import openmp
from latte.compiler.machine import usable_cores
from latte.compiler.update import ParamBuffers, UpdateRule
from latte.lang import DataEnsemble, Ensemble, Graph, NormalizationEnsemble, Phase
from latte.lang.ensemble import published, unpublished
from latte.overrides import pick
from latte.runtime import checkpoint, distributed
from latte.runtime.executor import Executor
from latte.runtime.memory import Memory
from latte.runtime.predict import predict
from latte.runtime.profile import Profile
from latte.runtime.updater import Updater
from latte.solvers.algorithms import SGD_RULE


@dataclass(frozen=True, eq=False)
class Parameter:
    """A learnable array: ``value`` and ``grad`` are live views of the net's buffers.
    ``state`` holds the solvers' per-parameter arrays by name (SGD's ``"history"``, Adam's
    ``"exp_avg"``...), created zero when a solver first needs them. ``axes``: the order the
    views show the stored axes in, where the layer publishes them in another (None: as
    stored)."""

    name: str
    value: np.ndarray
    grad: np.ndarray
    lr_mult: float
    decay_mult: float
    state: dict[str, np.ndarray] = field(default_factory=dict)
    axes: tuple[int, ...] | None = None

    def solver_state(self, name: str) -> np.ndarray:
        """The state array ``name`` (zeros of the parameter's shape when new, stored as the
        value is: the compiled update walks both alike)."""
        if name not in self.state:
            zeros = aligned_zeros(self.stored(self.value).shape, np.float32)
            self.state[name] = published(zeros, self.axes)
        return self.state[name]

    def stored(self, array: np.ndarray) -> np.ndarray:
        """``array`` (the value, its gradient or a state) as stored: contiguous."""
        return unpublished(array, self.axes)

    @property
    def history(self) -> np.ndarray:
        """SGD's momentum history."""
        return self.solver_state("history")


class Net(Graph):
    """A network of ensembles; ``init()`` compiles it, ``forward``/``backward`` run it.

    ``profile=True`` (or ``latte run --profile``) compiles one native segment per ensemble
    (or fused group) and times each: ``net.profile`` (a :class:`~latte.runtime.profile.Profile`)
    then holds per-ensemble forward/backward time; it is None otherwise.
    """

    def __init__(self, batch_size: int, *, time_steps: int = 1, num_threads: int | None = None,
                 opt_level: int = 3, seed: int | None = None, deterministic: bool = False,
                 profile: bool = False):
        super().__init__(batch_size, time_steps)
        self.profile: Profile | None = Profile() if pick("profile", profile) else None
        self.num_threads = pick("num_threads", num_threads)
        if self.num_threads is None and distributed.active():
            self.num_threads = 1   # one compute thread per rank unless told otherwise
        self.opt_level = int(pick("opt_level", opt_level))
        self.seed = distributed.shared_seed(pick("seed", seed))
        self.deterministic = bool(deterministic)
        if not 0 <= self.opt_level <= 3:
            raise ValueError(f"opt_level must be 0..3, got {self.opt_level}")
        self.rng = latte_random.seed(self.seed)
        self.program = None
        self.params: list[Parameter] = []
        self.solver_state: dict = {}
        self.valid = self.batch_size
        self._executor = None
        self._memory = None
        self._comm: distributed.Communicator | None = None

    # ------------------------------------------------------------ compile
    def init(self) -> None:
        """Compile the net (idempotent)."""
        if self.program is not None:
            return
        threads = self.num_threads or usable_cores()
        if threads > 1 and self.opt_level >= 2 and openmp() is None:
            warnings.warn("libgomp not found (it comes with gcc): running on one thread", stacklevel=2)
            threads = 1
        # from opt level 2 latte forks its own threads and each sgemm call runs on one
        set_blas_threads(1 if self.opt_level >= 2 else threads)
        pin_other_blas()
        split = distributed.active() or self.profile is not None
        self.program = compile_net(self, self.opt_level, split_segments=split, threads=threads)
        self.frozen = True
        self._memory = Memory(self.program)
        self._comm = (distributed.Communicator(os.environ.get("LATTE_MPI_OVERLAP") != "0")
                      if distributed.active() else None)
        self._executor = Executor(self.program, self._memory, self._comm, self.profile)
        bufs = self.program.buffers
        self.params = []
        for ens, name in self.program.params:
            f = ens.fields[name]
            value, grad = (ens.public(name, self._memory[b].reshape(f.given_shape))
                           for b in (bufs.field(ens, name), bufs.field_grad(ens, name)))
            self.params.append(Parameter(ens.field_name(name), value, grad, f.spec.lr_mult,
                                         f.spec.decay_mult, axes=ens.public_axes.get(name)))
        self._updater = Updater(self.params, [ParamBuffers(p.name, bufs.field(e, n),
                                                           bufs.field_grad(e, n))
                                              for p, (e, n) in zip(self.params, self.program.params)],
                                self._memory, self._executor, bufs.threads, self.opt_level, split)
        self._before_forward = [(e, {name: self.field(e, name) for name in e.fields})
                                for e in self.ensembles if isinstance(e, Ensemble)
                                and type(e).before_forward is not Ensemble.before_forward]
        distributed.agree(distributed.net_facts(self))   # before any parameter moves
        self.resync()   # every rank starts from rank 0's parameters

    def resync(self) -> None:
        """Under MPI, give every rank rank 0's parameters and momenta. Ranks apply the same
        reduced gradients, but a reduction may round differently on each rank; ``solve``
        calls this once per epoch so such differences cannot accumulate."""
        for p in self.params:
            distributed.broadcast(p.stored(p.value))
            for name in sorted(p.state):
                distributed.broadcast(p.stored(p.state[name]))

    def _ready(self) -> None:
        if self.program is None:
            self.init()

    # ------------------------------------------------------------ run
    def data_sources(self) -> list:
        seen = []
        for e in self.ensembles:
            if isinstance(e, DataEnsemble) and e.source is not None and e.source not in seen:
                seen.append(e.source)
        return seen

    def forward(self, phase: Phase = Phase.TRAIN) -> None:
        """Load the next batch from every data source and run the forward pass. A
        ``Phase.TEST`` pass runs the test program: at opt level 3 the values inside a fused
        group (all but its last member's) stay in line buffers, not in ``value``."""
        self._ready()
        self.phase = phase
        column = "test" if phase is Phase.TEST else "forward"
        start = time.perf_counter()
        valid = self.batch_size
        for source in self.data_sources():
            valid = min(valid, source.load(self, phase))
        self.valid = valid
        if self.profile is not None:
            self.profile.add("(data)", column, time.perf_counter() - start)
        for ens in self.ensembles:
            if isinstance(ens, NormalizationEnsemble):
                ens.phase = phase
        for ens, fields in self._before_forward:
            start = time.perf_counter()
            ens.before_forward(phase, fields)
            if self.profile is not None:
                self.profile.add(ens.name, column, time.perf_counter() - start)
        self._executor.forward(valid, column)

    def run_steps(self, steps: list, phase: str = "forward") -> None:
        """Run some of ``program.forward``'s steps (``phase`` ``"test"``: of ``program.test``)
        as they are: no data loading and no ``before_forward`` (``latte check`` reruns what
        follows a perturbed ensemble)."""
        self._ready()
        ex = self._executor
        ex._run(steps, self.valid, ex.test_code if phase == "test" else ex.code)

    def backward(self) -> None:
        """Zero every gradient, then back-propagate from the losses."""
        self._ready()
        self._executor.backward(self.valid)

    def update(self, lr: float, momentum: float = 0.0, regu_coef: float = 0.0, *,
               rule: UpdateRule = SGD_RULE, scalars: dict | None = None,
               clip_gradients: float | None = None) -> None:
        """One solver step, compiled: by default SGD,
        ``hist = mom*hist + lr*lr_mult*(grad + regu*decay_mult*param); param -= hist``.
        A solver passes its ``rule`` (:mod:`latte.compiler.update`) and the values of the
        rule's own ``scalars`` (a float, or one per parameter); ``clip_gradients`` first
        scales all gradients so that their global L2 norm is at most that."""
        self._ready()
        columns = {"lr": [lr * p.lr_mult for p in self.params], "mom": momentum,
                   "l2": [regu_coef * p.decay_mult for p in self.params], **(scalars or {})}
        self._updater.update(rule, columns, clip_gradients)

    def compile_update(self, rule: UpdateRule = SGD_RULE) -> None:
        """Compile the update of ``rule`` and the reductions around it (``solve`` calls this
        before training; else the first :meth:`update` does)."""
        self._ready()
        self._updater.compile(rule)

    def grad_norm(self) -> float:
        """The global L2 norm of every parameter gradient (what ``clip_gradients`` clips)."""
        self._ready()
        return self._updater.grad_norm()

    def nonfinite_params(self) -> list[str]:
        """The names of the parameters holding a NaN or an infinity (a compiled check)."""
        self._ready()
        return self._updater.nonfinite()

    @property
    def comm_stats(self) -> dict[str, float] | None:
        """Under MPI: gradient-reduction time left exposed per step (None otherwise)."""
        return self._comm.stats if self._comm is not None else None

    # ------------------------------------------------------------ views
    def value(self, ens_or_name) -> np.ndarray:
        """Writable ``(batch, *shape)`` view of an ensemble's values (``(time_steps, batch,
        *shape)`` with time steps)."""
        self._ready()
        return self._view(self.program.buffers.value(self.ensemble(ens_or_name)))

    def grad(self, ens_or_name) -> np.ndarray:
        """Writable view of d loss / d value, shaped as :meth:`value`."""
        self._ready()
        return self._view(self.program.buffers.grad(self.ensemble(ens_or_name)))

    def field(self, ens_or_name, name: str) -> np.ndarray:
        """Writable view of a neuron field's buffer: the field's array, with a leading batch
        dimension for a ``Batch`` field (e.g. a pooling arg-max or a dropout mask), and a
        leading time dimension before it with time steps."""
        self._ready()
        return self._view(self.program.buffers.field(self.ensemble(ens_or_name), name))

    def _view(self, buf) -> np.ndarray:
        array = self._memory[buf]
        if buf.batched and self.time_steps > 1:
            return array.reshape(self.time_steps, self.batch_size, *array.shape[1:])
        return array

    @property
    def loss(self) -> float:
        """The summed loss of every loss ensemble for the current batch."""
        return float(sum(e.loss for e in self.ensembles
                         if isinstance(e, NormalizationEnsemble) and e.is_loss))

    @property
    def state(self) -> dict[str, np.ndarray]:
        """Named non-learned arrays that persist across batches (a batch norm's
        ``"bn1.running_mean"``), live: writing one changes the net."""
        return {k: v for e in self.ensembles if isinstance(e, NormalizationEnsemble)
                for k, v in e.state.items()}

    def predict(self, x, output=None) -> np.ndarray:
        """A ``Phase.TEST`` forward over the samples ``x`` (``(n, *input_shape)``, any
        ``n``, ``batch_size`` at a time) fed to the net's one input ensemble; returns a new
        float32 array ``(n, *output.shape)`` of ``output``'s values (an ensemble or its
        name; default: the input of the first loss layer, else the last ensemble added).
        Data sources are not touched; the net's values are left as the last batch's."""
        return predict(self, x, output)

    # ------------------------------------------------------------ checkpoints
    def save(self, path) -> None:
        """Write a snapshot to ``path`` atomically: parameters, solver state and progress,
        ``state``, the random generators and every data source's position (see
        :mod:`latte.runtime.checkpoint`; collective under MPI, rank 0 writes). Nothing is
        written when an array is not finite (:class:`~latte.errors.TrainingError`)."""
        self._ready()
        checkpoint.save(self, path)

    def load(self, path) -> None:
        """Restore what :meth:`save` wrote, after checking the whole file: a damaged,
        foreign or incomplete one is a :class:`~latte.errors.DataError` naming the path,
        and leaves the net as it was."""
        self._ready()
        checkpoint.load(self, path)
