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


def test_digits_mlp(tmp_path):
    pytest.importorskip("sklearn")
    env = dict(os.environ)
    env.setdefault("LATTE_CACHE_DIR", str(tmp_path / "cache"))   # conftest sets a session one
    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(EXAMPLES / "digits_mlp.py")], env=env,
                            capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.95
    assert elapsed < 60
