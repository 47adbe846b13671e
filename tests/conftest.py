"""Shared fixtures: a private compile cache per test session, in which every compiled
kernel is verified after every pipeline step (``LATTE_VERIFY=steps``); the random tester's
cases checked in a worker process beside the other tests, and their tests run last."""

from __future__ import annotations

import pytest
from helpers import fuzz_case


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


def pytest_collection_modifyitems(items):
    """The random tester's cases last: their checks, started with the session
    (:func:`fuzz_ahead`), run beside the other tests meanwhile."""
    items.sort(key=lambda item: fuzz_case(item) is not None)


@pytest.fixture(autouse=True, scope="session")
def fuzz_ahead(latte_cache_dir, request):
    """The selected random cases' checks (tests/test_fuzz.py's ``Ahead``), started in a
    worker process once the cache is set up; None when no case is selected."""
    items = [item for item in request.session.items if fuzz_case(item) is not None]
    if not items:
        yield None
        return
    ahead = items[0].module.Ahead([fuzz_case(item) for item in items])
    yield ahead
    ahead.close()
