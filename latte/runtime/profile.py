"""Per-ensemble wall time, measured by a profiling executor (``Net(..., profile=True)``).

Like Caffe's per-layer ``time`` breakdown: the net is compiled with one native segment per
ensemble (or fused group) and phase, and the executor times each step with
:func:`time.perf_counter`, attributing it to the ensemble(s) whose kernels the step runs.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Columns of a profile: the phases a step can run in (``test`` is a forward in Phase.TEST).
PHASES = ("forward", "backward", "update", "test")
#: Phases that make up one training iteration.
TRAIN = ("forward", "backward", "update")


class Profile:
    """Seconds per row (an ensemble's name, or a runtime step such as ``(data)``) and phase,
    and how many times each phase ran; :meth:`ms_per_call` turns them into per-iteration
    numbers. :meth:`reset` after warm-up iterations to measure steady state."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = {}
        self.calls: dict[str, int] = dict.fromkeys(PHASES, 0)

    def reset(self) -> None:
        """Forget everything measured so far."""
        self.seconds.clear()
        self.calls = dict.fromkeys(PHASES, 0)

    def add(self, row: str, phase: str, seconds: float) -> None:
        """Charge ``seconds`` of ``phase`` to ``row``."""
        cols = self.seconds.get(row)
        if cols is None:
            cols = self.seconds[row] = dict.fromkeys(PHASES, 0.0)
        cols[phase] += seconds

    def count(self, phase: str) -> None:
        """One more run of ``phase`` (the divisor of :meth:`ms_per_call`)."""
        self.calls[phase] += 1

    def ms_per_call(self) -> dict[str, dict[str, float]]:
        """Per row, milliseconds per run of each phase (0 for a phase that never ran)."""
        return {row: {p: s * 1e3 / self.calls[p] if self.calls[p] else 0.0
                      for p, s in cols.items()} for row, cols in self.seconds.items()}

    def total_ms(self, phases: Iterable[str] = TRAIN) -> float:
        """Milliseconds per iteration summed over every row and the given phases."""
        return sum(cols[p] for cols in self.ms_per_call().values() for p in phases)

    def format(self) -> str:
        """The table ``latte run --profile`` prints: per row, forward and backward
        milliseconds per training iteration and the row's share of the iteration's total
        (the SGD update and data loading are rows of their own; "-" where a row has no
        time in a phase)."""
        ms = self.ms_per_call()
        total = self.total_ms()
        rows = [(row, c) for row, c in ms.items() if any(c[p] for p in TRAIN)]
        width = max([len(row) for row, _ in rows] + [len("ensemble"), 24])

        def cell(value: float) -> str:   # a row with no step in a phase shows "-"
            return f"{value:>9.3f}" if value else f"{'-':>9}"

        lines = [f"per ensemble, ms per training iteration ({self.calls['forward']} iterations):",
                 f"  {'ensemble':<{width}} {'forward':>9} {'backward':>9} {'total':>9} {'share':>7}"]
        for row, c in rows:
            tot = sum(c[p] for p in TRAIN)
            lines.append(f"  {row:<{width}} {cell(c['forward'])} {cell(c['backward'])} "
                         f"{tot:>9.3f} {tot / total if total else 0.0:>7.1%}")
        fwd, bwd = (sum(c[p] for _, c in rows) for p in ("forward", "backward"))
        lines.append(f"  {'total':<{width}} {fwd:>9.3f} {bwd:>9.3f} {total:>9.3f} "
                     f"{1.0 if total else 0.0:>7.1%}")
        if self.calls["test"]:
            test = sum(c["test"] for c in ms.values())
            lines.append(f"  test-phase forward, not in the table: {test:.3f} ms per call "
                         f"({self.calls['test']} calls)")
        return "\n".join(lines)
