"""Runs solvers' compiled updates on a net's parameters.

The update of each rule (:class:`~latte.compiler.update.UpdateRule`) is compiled the first
time it runs and kept; its table points at the net's value and gradient buffers, at each
parameter's state arrays (``Parameter.state``, shared by every rule that names the same
state) and at its own per-step scalars.
"""

from __future__ import annotations

import ctypes
import math
from typing import Callable

import numpy as np

from latte.aligned import aligned_zeros
from latte.compiler import Buffer, Segment
from latte.compiler.update import (
    ParamBuffers,
    UpdateCode,
    UpdateRule,
    partial_sum_offsets,
    reduction_code,
    update_code,
)
from latte.runtime.executor import Executor, NativeCode

CLIP_EPS = 1e-6   # torch's clip_grad_norm_: scale = max_norm / (norm + 1e-6)


class _Compiled:
    """One :class:`UpdateCode` and its table; ``owned`` holds the arrays no one else has
    (scalars, partial sums), by buffer key."""

    def __init__(self, code: UpdateCode, resolve: Callable[[Buffer], np.ndarray | None]):
        self.code = code
        self.owned: dict[tuple, np.ndarray] = {}
        arrays = []
        for buf in code.buffers:
            arr = resolve(buf)
            if arr is None:
                arr = self.owned[buf.key] = aligned_zeros(buf.shape, np.float32)
            arrays.append(arr)
        self.table = (ctypes.c_void_p * max(1, len(arrays)))(*[a.ctypes.data for a in arrays])
        self.native = NativeCode(code.library, code.segments, self.table)

    def segment(self, name: str) -> Segment:
        return next(s for s in self.code.segments if s.name == name)


class Updater:
    """A net's solver updates and the reductions around them (clipping norm, finite check)."""

    def __init__(self, params: list, buffers: list[ParamBuffers], memory, executor: Executor,
                 threads: int, opt_level: int, split: bool):
        self.params, self.buffers, self.memory, self.executor = params, buffers, memory, executor
        self.threads, self.opt_level, self.split = threads, opt_level, split
        self._index = {p.name: i for i, p in enumerate(params)}
        self._updates: dict[UpdateRule, _Compiled] = {}
        self._starts = partial_sum_offsets([b.value.size for b in buffers])[:-1]
        self._reductions: _Compiled | None = None

    def _compiled(self, code: UpdateCode) -> _Compiled:
        return _Compiled(code, self._array)

    def _array(self, buf: Buffer) -> np.ndarray | None:
        """The array of ``buf`` if someone has it: the net's own buffer (a value or a
        gradient) or a parameter's state array."""
        if buf in self.memory.arrays:
            return self.memory.arrays[buf]
        if buf.key[0] == "update" and len(buf.key) == 3:
            return self.params[self._index[buf.key[1]]].solver_state(buf.key[2])
        return None

    def compile(self, rule: UpdateRule) -> _Compiled:
        """The compiled update of ``rule`` (compiled on first use), and the reductions."""
        self._reduction()
        upd = self._updates.get(rule)
        if upd is None:
            upd = self._updates[rule] = self._compiled(
                update_code(rule, self.buffers, self.threads, self.opt_level, self.split))
        return upd

    def update(self, rule: UpdateRule, columns: dict[str, float | np.ndarray],
               clip: float | None = None) -> None:
        """One step of ``rule``: ``columns`` gives every scalar but ``clip`` (a float for
        all parameters or one value per parameter); ``clip`` scales the gradients so that
        their global L2 norm is at most ``clip``."""
        upd = self.compile(rule)
        if not self.params:
            return
        scal = upd.owned[("update", "scalars")]
        for j, name in enumerate(rule.columns):
            if name != "clip":
                scal[:len(self.params), j] = columns[name]
        scale = 1.0
        if clip is not None:
            norm = self.grad_norm()
            scale = min(1.0, clip / (norm + CLIP_EPS))
        scal[:, rule.columns.index("clip")] = scale
        self.executor.update(upd.native, upd.code.segments)

    def _reduction(self) -> _Compiled:
        if self._reductions is None:
            self._reductions = self._compiled(
                reduction_code(self.buffers, self.threads, self.opt_level))
        return self._reductions

    def _reduce(self, name: str, last: bool = False) -> np.ndarray:
        """Run the reduction ``name``; one float64 sum per parameter."""
        red = self._reduction()
        self.executor.update(red.native, [red.segment(name)], last=last)
        parts = red.owned[("update", name)]
        if not self._starts:
            return np.zeros(0)
        return np.add.reduceat(parts, self._starts, dtype=np.float64)

    def grad_norm(self) -> float:
        """The global L2 norm of every parameter gradient (compiled partial sums, added in
        float64)."""
        return math.sqrt(float(self._reduce("grad_norm").sum()))

    def nonfinite(self) -> list[str]:
        """The names of the parameters holding a NaN or an infinity."""
        sums = self._reduce("finite_check")
        return [p.name for p, s in zip(self.params, sums) if not math.isfinite(s)]
