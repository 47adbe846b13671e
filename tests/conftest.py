"""Shared fixtures: a private compile cache per test session."""

from __future__ import annotations

import os

import pytest


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
