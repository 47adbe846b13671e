"""Generated code is byte-identical across processes: the loop IR, the LLVM IR and the cache
key of a net do not depend on ``PYTHONHASHSEED``, on object addresses or on the order in
which nets are built (otherwise the disk cache misses in every new process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("net_worker.py")


def _compile(tmp_path: Path, tag: str, hash_seed: int, nets: list[str], junk: int,
             timings_from: str | None = None) -> dict:
    """Compile ``nets`` into an empty cache in a fresh process; its reports by net name.
    ``timings_from``: a cache whose measurements (``*.json``: the products timed against
    BLAS, made once per machine) the process starts with, and no compiled code: timed anew
    on a busy machine, a product can choose the other way and change the IR."""
    cache = tmp_path / tag
    cache.mkdir()
    for timing in (tmp_path / timings_from).glob("*.json") if timings_from else ():
        shutil.copy(timing, cache)
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed), LATTE_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, str(WORKER), *nets, "--junk", str(junk)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["net"]: r for r in reports}


def test_generated_code_is_identical_across_processes(tmp_path):
    a = _compile(tmp_path, "a", 1, ["lenet", "vgg_block"], junk=0)
    b = _compile(tmp_path, "b", 2024, ["vgg_block", "lenet"], junk=50_000, timings_from="a")
    assert a["vgg_block"]["groups"] >= 1, "the VGG block should fuse at opt level 3"
    for net in ("lenet", "vgg_block"):
        assert not a[net]["from_cache"] and not b[net]["from_cache"]
        for what in ("loop_ir", "llvm_ir", "key", "results"):
            assert a[net][what] == b[net][what], f"{net}: {what} differs between processes"
