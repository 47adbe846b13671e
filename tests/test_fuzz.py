"""Random differential testing (latte.fuzz): random neurons and nets, every optimized level
against level 0 and level 0 against the reference interpreter.

``pytest tests/test_fuzz.py --fuzz N`` (or ``LATTE_FUZZ=N``) runs cases 0..N-1 (default 300);
``--fuzz-seed S[,S...]`` reruns the listed cases. Cases of one configuration (batch size,
threads, level) share a net, so one compile covers many of them.
"""

from __future__ import annotations

import os
import zlib

import pytest
from helpers import WeightedSumLoss

from latte.fuzz.harness import check_cases, groups

GROUP = 12   # cases per net


def _seeds(config) -> list[int]:
    if config.getoption("--fuzz-seed"):
        return [int(s) for s in config.getoption("--fuzz-seed").split(",")]
    n = config.getoption("--fuzz")
    return list(range(n if n is not None else int(os.environ.get("LATTE_FUZZ", "300"))))


def pytest_generate_tests(metafunc):
    if "cases" in metafunc.fixturenames:
        found = groups(_seeds(metafunc.config), GROUP)
        metafunc.parametrize("cases", found, ids=[f"cases{g[0]}+{len(g) - 1}" for g in found])


def _loss(net, name, ens):
    WeightedSumLoss(net, name, ens, seed=zlib.crc32(name.encode()))  # the same in any net


def test_random_nets(cases):
    found = check_cases(cases, loss=_loss)
    if found:
        seeds = sorted({m.seed for m in found if m.seed is not None})
        lines = [str(m) for m in found[:12]]
        lines += [f"rerun one case: pytest tests/test_fuzz.py --fuzz-seed {s}" for s in seeds]
        lines.append("rerun the whole net: pytest tests/test_fuzz.py --fuzz-seed "
                     + ",".join(map(str, cases)))
        pytest.fail("\n".join(lines), pytrace=False)
