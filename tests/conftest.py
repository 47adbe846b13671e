"""Shared fixtures: a private compile cache per test session, in which every compiled
kernel is verified after every pipeline step (``LATTE_VERIFY=steps``)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    """``--fuzz N`` runs N random differential cases (tests/test_fuzz.py); ``--fuzz-seed``
    reruns the listed cases only."""
    parser.addoption("--fuzz", type=int, default=None,
                     help="number of random differential cases (default $LATTE_FUZZ or 200)")
    parser.addoption("--fuzz-seed", default=None, help="comma-separated case seeds to run")


@pytest.fixture(autouse=True, scope="session")
def latte_cache_dir(tmp_path_factory):
    """Point LATTE_CACHE_DIR at a per-session temporary directory; verify every step."""
    path = tmp_path_factory.mktemp("latte-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LATTE_CACHE_DIR", str(path))
        mp.setenv("LATTE_VERIFY", "steps")
        yield path
