"""Settings that ``latte run`` options impose over what a script passes to Net and solvers."""

from __future__ import annotations

OVERRIDES: dict[str, object] = {}


def pick(name: str, given):
    """The command-line value for ``name`` if one was given, else ``given``."""
    return OVERRIDES.get(name, given)
