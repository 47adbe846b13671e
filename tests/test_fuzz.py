"""Random differential testing (latte.fuzz): random neurons and nets, every optimized level
against level 0 and level 0 against the reference interpreter.

``pytest tests/test_fuzz.py --fuzz N`` (or ``LATTE_FUZZ=N``) runs cases 0..N-1 (default 300);
``--fuzz-seed S[,S...]`` reruns the listed cases. Cases of one configuration (batch size,
threads, level) share a net, so one compile covers many of them; the nets are checked in
worker processes, one per core (compiling is most of the time).
"""

from __future__ import annotations

import multiprocessing
import os
import zlib
from concurrent.futures import ProcessPoolExecutor

import pytest
from helpers import WeightedSumLoss

from latte.errors import LatteError
from latte.fuzz.harness import check_cases, groups
from latte.fuzz.invalid import KINDS, invalid_net

GROUP = 1   # cases per net: larger nets compile no faster per case (measured)


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
    if "cases" in metafunc.fixturenames:
        found = groups(_seeds(metafunc.config), GROUP)
        metafunc.parametrize("cases", found, ids=[f"cases{g[0]}+{len(g) - 1}" for g in found])


@pytest.fixture(scope="module")
def checked(request):
    """Every group's mismatches, computed in worker processes as the tests ask for them."""
    pool = ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn"))
    found = groups(_seeds(request.config), GROUP)
    futures = {tuple(g): pool.submit(check_cases, g, loss=_loss) for g in found}
    yield lambda cases: futures[tuple(cases)].result()
    pool.shutdown(cancel_futures=True)


def _loss(net, name, ens):
    WeightedSumLoss(net, name, ens, seed=zlib.crc32(name.encode()))  # the same in any net


def test_random_nets(cases, checked):
    found = checked(cases)
    if found:
        seeds = sorted({m.seed for m in found if m.seed is not None})
        lines = [str(m) for m in found[:12]]
        lines += [f"rerun one case: pytest tests/test_fuzz.py --fuzz-seed {s}" for s in seeds]
        lines.append("rerun the whole net: pytest tests/test_fuzz.py --fuzz-seed "
                     + ",".join(map(str, cases)))
        pytest.fail("\n".join(lines), pytrace=False)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", KINDS)
def test_invalid_programs_are_rejected(kind, seed):
    net, where = invalid_net(kind, seed)
    with pytest.raises(LatteError, match=where):
        net.init()
