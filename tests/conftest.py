"""Shared fixtures: a private compile cache per test session."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    """``--fuzz N`` runs N random differential cases (tests/test_fuzz.py); ``--fuzz-seed``
    reruns the listed cases only."""
    parser.addoption("--fuzz", type=int, default=None,
                     help="number of random differential cases (default $LATTE_FUZZ or 300)")
    parser.addoption("--fuzz-seed", default=None, help="comma-separated case seeds to run")


@pytest.fixture(autouse=True, scope="session")
def latte_cache_dir(tmp_path_factory):
    """Point LATTE_CACHE_DIR at a per-session temporary directory."""
    path = tmp_path_factory.mktemp("latte-cache")
    old = os.environ.get("LATTE_CACHE_DIR")
    os.environ["LATTE_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("LATTE_CACHE_DIR", None)
    else:
        os.environ["LATTE_CACHE_DIR"] = old
