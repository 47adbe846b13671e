"""Per-ensemble wall time, measured by a profiling executor (``Net(..., profile=True)``).

Like Caffe's per-layer ``time`` breakdown: the net is compiled with one native segment per
ensemble (or fused group) and phase, and the executor times each step with
:func:`time.perf_counter`, attributing it to the ensemble(s) whose kernels the step runs.
The compiler counts each step's floating-point operations (:mod:`latte.compiler.flops`), so
a row's GFLOP/s is set against the machine's peak (:func:`latte.compiler.machine.peak`:
one core's sgemm speed, measured once per machine, times the net's threads).
"""

from __future__ import annotations

from collections.abc import Iterable

from latte.compiler import machine
from latte.compiler.flops import step_flops
from latte.compiler.machine import Peak
from latte.compiler.program import Program

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
        self.flops: dict[str, dict[str, int]] = {}   # per row and phase, per run
        self.threads = 1

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

    def count_flops(self, program: Program, labels: dict[int, str]) -> None:
        """Take each row's floating-point operations per run of each phase from
        ``program``'s steps (``labels``: a step's row by ``id``), and its thread count."""
        self.threads = program.buffers.threads
        self.flops.clear()
        for phase in ("forward", "backward", "test"):
            for step in getattr(program, phase):
                row = self.flops.setdefault(labels[id(step)], dict.fromkeys(PHASES, 0))
                row[phase] += step_flops(step, program.buffers.time_steps)

    def gflops(self, row: str, phases: Iterable[str]) -> float | None:
        """``row``'s GFLOP/s over ``phases`` (None where it has no operations or no time)."""
        ms = self.ms_per_call().get(row, {})
        flops = sum(self.flops.get(row, {}).get(p, 0) for p in phases)
        seconds = sum(ms.get(p, 0.0) for p in phases) / 1e3
        return flops / seconds / 1e9 if flops and seconds else None

    def format(self, peak: Peak | None = None) -> str:
        """The tables ``latte run --profile`` prints: a line naming the machine and its peak
        (``peak``, else this machine's, measured on first use: :func:`machine.peak`); per
        row, forward and backward milliseconds per training iteration and the row's share
        of the iteration's total (the SGD update and data loading are rows of their own;
        "-" where a row has no time in a phase), then likewise per test-phase forward; each
        row's GFLOP/s (its operations, counted by :mod:`latte.compiler.flops`, over its
        time) and their share of the peak at the net's thread count ("-": none counted)."""
        peak = peak or machine.peak()
        lines = [f"machine: {peak.describe(self.threads)}"]
        if self.calls["forward"]:
            lines += self._table(f"per ensemble, ms per training iteration "
                                 f"({self.calls['forward']} iterations):",
                                 ("forward", "backward"), TRAIN, peak)
        if self.calls["test"]:
            calls = self.calls["test"]
            lines += self._table(f"per ensemble, ms per test-phase forward ({calls} call"
                                 f"{'s' if calls != 1 else ''}):", ("test",), ("test",), peak)
        return "\n".join(lines)

    def _table(self, title: str, columns: tuple[str, ...], phases: tuple[str, ...],
               peak: Peak) -> list[str]:
        """Rows with time in ``phases``: milliseconds per column (and their total over
        ``phases`` where those are more than the columns), share of the table's total,
        GFLOP/s (the columns' operations over the total) and share of the peak."""
        ms = self.ms_per_call()
        rows = [row for row, c in ms.items() if any(c[p] for p in phases)]
        ms["total"] = {p: sum(ms[row][p] for row in rows) for p in PHASES}
        flops = {row: sum(self.flops.get(row, {}).get(p, 0) for p in columns) for row in rows}
        flops["total"] = sum(flops.values())
        summed = columns != phases
        grand = sum(ms["total"][p] for p in phases)
        top = peak.at(self.threads)
        width = max([len(row) for row in rows] + [len("ensemble"), 24])

        def cell(value: float | None, spec: str = "9.3f", empty: int = 9) -> str:
            return format(value, f">{spec}") if value else f"{'-':>{empty}}"

        heads = (*columns, "total") if summed else columns
        lines = [title, f"  {'ensemble':<{width}} " + " ".join(f"{h:>9}" for h in heads)
                 + f" {'share':>7} {'GFLOP/s':>9} {'% peak':>7}"]
        for row in (*rows, "total"):
            tot = sum(ms[row][p] for p in phases)
            rate = flops[row] / tot / 1e6 if flops[row] and tot else None
            cells = [cell(ms[row][p]) for p in columns] + ([f"{tot:>9.3f}"] if summed else [])
            cells += [f"{tot / grand if grand else 0.0:>7.1%}", cell(rate, "9.2f"),
                      cell(rate and rate / top, "7.1%", 7)]
            lines.append(f"  {row:<{width}} " + " ".join(cells))
        return lines
