"""What the compiler produces: segments of native code, host steps, and the per-ensemble plan."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from latte.aligned import ALIGN
from latte.compiler.buffers import BufferPlan
from latte.compiler.fingerprint import kernel_buffers
from latte.compiler.ir import Kernel, accesses
from latte.compiler.jit import CodeLibrary
from latte.compiler.mapping import ConnAccess, fit_index_map
from latte.lang import Ensemble, NormalizationEnsemble


@dataclass(frozen=True)
class Segment:
    """Consecutive kernels compiled into one native function."""

    name: str
    kernels: tuple[Kernel, ...]


@dataclass(frozen=True)
class HostStep:
    """A normalization ensemble's array code, run by the runtime between segments."""

    ensemble: NormalizationEnsemble
    phase: str


@dataclass(frozen=True)
class TimeSteps:
    """Steps run once per time step, t = 0..T-1 (backward: T-1..0). Before each step the
    runtime points every step view (``views``: view, buffer, shift) at that step's rows."""

    name: str
    steps: tuple
    reverse: bool
    views: tuple
    ensembles: tuple = ()   # the loop's ensembles, in run order


# the plan kernel of a time loop's ensemble that runs once after its backward loop
AFTER_LOOP = "after_loop"
# the plan kernels of a time loop's ensemble that run once before its loop, per phase
BEFORE_LOOP = {"forward": "before_forward_loop", "backward": "before_backward_loop"}


def flat_steps(steps) -> list:
    """``steps`` with each :class:`TimeSteps` replaced by the steps it runs."""
    out = []
    for s in steps:
        out += flat_steps(s.steps) if isinstance(s, TimeSteps) else [s]
    return out


@dataclass
class EnsemblePlan:
    """What the compiler decided for one ensemble (``latte explain`` prints it)."""

    ensemble: Ensemble
    accesses: list[ConnAccess]
    kernels: dict[str, Kernel] = field(default_factory=dict)

    def param_shared_dims(self) -> dict[str, tuple[int, ...]]:
        """Per parameter, the sink dims along which all neurons share one vector."""
        out = {}
        for f in self.ensemble.params:
            fit = fit_index_map(self.ensemble, f)
            out[f.name] = tuple(d for d in range(len(self.ensemble.shape))
                                if all(a.coef(f"%{d}") == 0 for a in fit))
        return out


@dataclass
class Program:
    """A compiled net: buffers, the step lists of each phase, and the native code."""

    buffers: BufferPlan
    forward: list
    backward: list
    test: list            # the forward of Phase.TEST (fused intermediates in line buffers)
    params: list[tuple[Ensemble, str]]
    plans: list[EnsemblePlan]
    opt_level: int
    library: CodeLibrary | None = None
    groups: list = field(default_factory=list)   # fused groups (opt level 3)
    test_groups: list = field(default_factory=list)   # fused in the test forward alone
    budget: int = 0                               # bytes a tile's working set may use
    fused_steps: list = field(default_factory=list)   # time-loop ensembles run as one loop
    joins: list = field(default_factory=list)   # concatenations: zero-copy, or why not
    stored: bool = False   # loaded from the disk cache, not compiled (latte.compiler.stored)

    def segments(self) -> list[Segment]:
        """Every native segment, each once (the test forward shares unchanged ones)."""
        forward = flat_steps(self.forward)
        steps = forward + flat_steps(self.backward) + [s for s in flat_steps(self.test)
                                                       if s not in forward]
        return [s for s in steps if isinstance(s, Segment)]

    def buffer_index(self) -> dict:
        """Each buffer's slot in the table the native segments read their pointers from."""
        return {b: i for i, b in enumerate(self.buffers.buffers.values())}

    @functools.cached_property
    def test_values(self) -> frozenset:
        """The values the test forward keeps in the arena (:mod:`latte.compiler.test_values`)."""
        return frozenset(self._test_lifetimes)

    @functools.cached_property
    def _test_lifetimes(self) -> dict:
        from latte.compiler.test_values import test_values  # noqa: PLC0415 (imports this)

        return test_values(self)

    def test_kernels(self) -> list[Kernel]:
        """The test forward's kernels in the order they run (a time loop's once)."""
        return [k for s in flat_steps(self.test) if isinstance(s, Segment) for k in s.kernels]

    @functools.cached_property
    def transient_layout(self) -> dict:
        """Where each shareable transient buffer lies in the arena, ``(start, end)`` in bytes
        (placed once: a stored program holds it, so a warm init need not walk its kernels):
        kernels run one at a time, so a buffer need only stay apart from those a kernel of its
        own also uses; each takes the lowest place that does (first fit, in plan order). VGG-16's
        Winograd layers so transform their weights into one 16 MiB block, warm in cache from the
        layer before, instead of one each (1.05x its batch-1 inference on an Intel Xeon;
        ``latte explain`` prints the arena's size). The test forward's :attr:`test_values`
        share it too, each in use by the test kernels from its first to its last."""
        transient = self.buffers.transient
        users: dict = {}     # buffer -> the kernels using it
        filled: dict = {}    # buffer -> does every kernel using it write it
        for seg in self.segments():
            for kernel in seg.kernels:
                written = {a.buffer for a in accesses(kernel.body) if a.written}
                for buf in kernel_buffers(kernel):
                    if buf in transient:
                        users.setdefault(buf, set()).add(id(kernel))
                        filled[buf] = filled.get(buf, True) and buf in written
        order = self.test_kernels()
        for buf, span in self._test_lifetimes.items():
            users[buf], filled[buf] = {id(order[i]) for i in span}, True
        placed: dict = {}
        for buf in [b for b in users if filled[b]]:
            taken = sorted(span for other, span in placed.items() if users[other] & users[buf])
            size, at = -(-buf.size * 4 // ALIGN) * ALIGN, 0
            for start, end in taken:
                if at + size <= start:
                    break
                at = max(at, end)
            placed[buf] = (at, at + size)
        return placed
