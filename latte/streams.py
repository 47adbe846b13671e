"""Standard streams that outlive their reader: ``latte run NET.py | head`` closes the pipe
after a few lines, and training must go on (log, snapshots and curves still written) rather
than die of a ``BrokenPipeError`` in the script's next ``print``."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


class _Guarded:
    """Forwards to ``stream``; when its reader has gone, sends its file descriptor to
    /dev/null (so later writes, buffered or native, land there) and says so once."""

    def __init__(self, stream: TextIO, name: str):
        self._stream, self._name = stream, name
        self.closed_by_reader = False

    def write(self, text: str) -> int:
        return self._guard(self._stream.write, text, default=len(text))

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _guard(self, call, *args: Any, default: Any = None) -> Any:
        try:
            return call(*args)
        except OSError as e:   # BrokenPipeError, or EPIPE as a plain OSError
            if e.errno != errno.EPIPE:
                raise
            self._closed()
            return default

    def _closed(self) -> None:
        silence(self._stream)
        if not self.closed_by_reader:
            self.closed_by_reader = True
            if self._name == "stdout":
                print("latte: standard output was closed by its reader; training continues "
                      "without printing to it", file=sys.stderr, flush=True)


def silence(stream: TextIO) -> None:
    """Send ``stream``'s file descriptor to /dev/null: its reader has gone."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


@contextlib.contextmanager
def outliving_readers() -> Iterator[None]:
    """Within the block, ``sys.stdout`` and ``sys.stderr`` survive a closed pipe."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Guarded(sys.stdout, "stdout"), _Guarded(sys.stderr, "stderr")
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
