"""Random differential testing (latte.fuzz): random neurons and nets, every optimized level
against level 0 and level 0 against the reference interpreter.

``pytest tests/test_fuzz.py --fuzz N`` (or ``LATTE_FUZZ=N``) runs cases 0..N-1 (default 300);
``--fuzz-seed S[,S...]`` reruns the listed cases. Each case compiles its own two nets (level 0
and its optimized level: nets of many cases compile no faster per case, measured), in worker
processes, one per core (compiling is nearly all of the time).
"""

from __future__ import annotations

import multiprocessing
import os
import zlib
from concurrent.futures import ProcessPoolExecutor

import pytest
from helpers import WeightedSumLoss

from latte.errors import LatteError
from latte.fuzz.harness import check_cases
from latte.fuzz.invalid import KINDS, invalid_net

DERIVED = 0.25   # the fraction of generated neurons without backward (the compiler derives it)


# cases that found bugs, run whatever --fuzz says (seed: what went wrong)
FIXED = {
    7: "level 3: fusion's planner model crashed (ShapeError) on a neuron reading one row at a "
       "fixed offset of a wide image (a negative 'pad'); fixed in fusion.planner_chain",
    27: "level 3: an LRN-like neuron (one-to-one + channel window over one source) lost the "
        "window's input gradient to zero-init folding (caught when the fold is reverted)",
}


def _seeds(config) -> list[int]:
    if config.getoption("--fuzz-seed"):
        return [int(s) for s in config.getoption("--fuzz-seed").split(",")]
    n = config.getoption("--fuzz")
    n = n if n is not None else int(os.environ.get("LATTE_FUZZ", "300"))
    return sorted(set(range(n)) | set(FIXED))


def pytest_generate_tests(metafunc):
    if "seed" in metafunc.fixturenames and "kind" not in metafunc.fixturenames:
        seeds = _seeds(metafunc.config)
        metafunc.parametrize("seed", seeds, ids=[f"case{s}" for s in seeds])


@pytest.fixture(scope="module")
def checked(request):
    """Every case's mismatches, computed in worker processes as the tests ask for them."""
    pool = ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn"))
    futures = {s: pool.submit(check_cases, [s], loss=_loss, derived=DERIVED)
               for s in _seeds(request.config)}
    yield lambda seed: futures[seed].result()
    pool.shutdown(cancel_futures=True)


def _loss(net, name, ens):
    WeightedSumLoss(net, name, ens, seed=zlib.crc32(name.encode()))  # the same in any net


def test_random_nets(seed, checked):
    found = checked(seed)
    if found:
        lines = [str(m) for m in found[:12]]
        lines.append(f"rerun: pytest tests/test_fuzz.py --fuzz-seed {seed}")
        pytest.fail("\n".join(lines), pytrace=False)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", KINDS)
def test_invalid_programs_are_rejected(kind, seed):
    net, where = invalid_net(kind, seed)
    with pytest.raises(LatteError, match=where):
        net.init()
