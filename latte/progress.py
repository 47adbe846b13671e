"""What ``latte run`` shows while a script trains: the progress bar and epoch lines, and
``--profile``'s wall time per phase."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from tqdm import tqdm

from latte.lang import Phase
from latte.net import Net


def silent(event: str, **info: Any) -> None:
    """The progress callback of ranks other than 0."""


class Progress:
    """``solve``'s progress callback: a tqdm bar per epoch on ``stream`` (when it is a
    terminal), then one summary line per epoch."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.bar: tqdm | None = None
        self.total: int | None = None      # iterations per epoch, once an epoch has run
        self.last_epoch = -1
        self.count = self.images = 0
        self.start = 0.0
        self.rate: float | None = None

    def __call__(self, event: str, **info: Any) -> None:
        if event == "iteration":
            self._iteration(**info)
        elif event == "epoch":
            self._epoch(**info)

    def _iteration(self, epoch: int, loss: float, images: int, iterations: int | None = None,
                   **_: Any) -> None:
        if self.bar is None:
            if epoch <= self.last_epoch:  # another solve() started
                self.total = None
            self.bar = tqdm(total=iterations or self.total, desc=f"epoch {epoch + 1}",
                            unit="it", file=self.stream, leave=False, disable=None,
                            dynamic_ncols=True)
            self.count = self.images = 0
            self.start = time.perf_counter()
        self.count += 1
        self.images += images
        self.rate = self.images / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"loss {loss:.4f}, {self.rate:,.0f} img/s", refresh=False)
        self.bar.update()

    def _epoch(self, epoch: int, accuracy: float | None = None, test_loss: float | None = None,
               train_loss: float | None = None, **_: Any) -> None:
        self.close()
        self.total, self.last_epoch = self.count or self.total, epoch
        parts = [f"train loss {train_loss:.4f}" if train_loss is not None else None,
                 f"test loss {test_loss:.4f}" if test_loss is not None else None,
                 f"test accuracy {accuracy:.2%}" if accuracy is not None else None,
                 f"{self.rate:,.0f} img/s" if self.rate is not None else None]
        print(f"epoch {epoch + 1}: " + ", ".join(p for p in parts if p), file=self.stream,
              flush=True)
        self.count, self.rate = 0, None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PhaseProfiler:
    """``--profile``: exclusive wall time in ``Net.init``/``forward``/``backward``/``update``
    (the per-ensemble table comes from each net's own :class:`~latte.runtime.profile.Profile`,
    which the ``profile`` override switches on)."""

    PHASES = ("compile", "forward (train, incl. data)", "backward", "update",
              "forward (test, incl. data)")

    def __init__(self):
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.calls = dict.fromkeys(self.PHASES, 0)
        self._nested: list[float] = []   # time spent in timed calls inside each open call

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        def compile_phase(net: Net) -> str | None:
            return "compile" if net.program is None else None

        def forward_phase(net: Net, phase: Phase = Phase.TRAIN) -> str:
            return self.PHASES[4] if phase is Phase.TEST else self.PHASES[1]

        with contextlib.ExitStack() as stack:
            for name, phase in (("init", compile_phase), ("forward", forward_phase),
                                ("backward", lambda net: "backward"),
                                ("update", lambda net, *a, **k: "update"),
                                ("compile_update", lambda net, *a, **k: "compile")):
                stack.enter_context(patched(Net, name, self._timed(getattr(Net, name), phase)))
            yield

    def _timed(self, method: Callable, phase: Callable[..., str | None]) -> Callable:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            key = phase(*args, **kwargs)
            self._nested.append(0.0)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                nested = self._nested.pop()
                if self._nested:
                    self._nested[-1] += elapsed
                if key is not None:
                    self.seconds[key] += elapsed - nested
                    self.calls[key] += 1
        return timed

    def report(self, total: float, stream: TextIO) -> None:
        rows = [(p, str(self.calls[p]), self.seconds[p]) for p in self.PHASES if self.calls[p]]
        rows.append(("rest of the script", "-", max(total - sum(self.seconds.values()), 0.0)))
        print(f"profile: {total * 1e3:,.1f} ms in the script (wall time)", file=stream)
        print(f"  {'phase':<28} {'calls':>7} {'total ms':>11} {'ms/call':>9} {'share':>7}",
              file=stream)
        for name, calls, seconds in rows:
            per_call = f"{seconds * 1e3 / int(calls):.3f}" if calls != "-" else "-"
            print(f"  {name:<28} {calls:>7} {seconds * 1e3:>11,.1f} {per_call:>9} "
                  f"{seconds / total if total else 0.0:>7.1%}", file=stream)


@contextlib.contextmanager
def patched(owner: object, name: str, value: object) -> Iterator[None]:
    """``owner.name`` set to ``value`` for the duration of the block."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)
