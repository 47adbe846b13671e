"""The examples train to their advertised accuracy, quickly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run_example(name: str, tmp_path) -> tuple[str, float]:
    """Run ``examples/<name>`` in a fresh interpreter; its stdout and wall time."""
    env = dict(os.environ)
    env.setdefault("LATTE_CACHE_DIR", str(tmp_path / "cache"))   # conftest sets a session one
    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(EXAMPLES / name)], env=env,
                            capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    return result.stdout, elapsed


def _accuracy(stdout: str) -> float:
    return float(re.search(r"test accuracy: ([0-9.]+)", stdout).group(1))


def test_digits_mlp(tmp_path):
    pytest.importorskip("sklearn")
    stdout, elapsed = _run_example("digits_mlp.py", tmp_path)
    assert _accuracy(stdout) >= 0.95
    assert elapsed < 60


def test_lenet(tmp_path):
    pytest.importorskip("sklearn")
    stdout, elapsed = _run_example("lenet.py", tmp_path)   # the full 20 epochs
    assert _accuracy(stdout) >= 0.97
    assert elapsed < 60


def test_vgg_micro(tmp_path):
    stdout, elapsed = _run_example("vgg_micro.py", tmp_path)
    assert re.search(r"[0-9.]+ ms per training iteration", stdout)
    assert elapsed < 60
