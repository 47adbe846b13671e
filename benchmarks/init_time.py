"""Cold and warm ``net.init()`` of VGG-16, ResNet-50 and LeNet, each in a fresh process.

    python benchmarks/init_time.py [--nets vgg16 resnet50 lenet] [--threads 2] [--repeat 3]
    python benchmarks/init_time.py --modules 2 16 [--nets vgg16 resnet50]

VGG-16 is the paper's: 13 3x3 convolutions (64-64, 128-128, 256 x3, 512 x3, 512 x3, each
followed by a ReLU, a 2x2 max pooling after each block) and 3 fully connected layers
(4096, 4096, 1000), batch 2, 224x224x3 images, stdlib layers, opt level 3. ResNet-50 is
the zoo's (``latte.zoo.resnet50``, batch norm, 1000 classes) at the same batch and size. LeNet is
Caffe's at batch 64 (``benchmarks/lenet.py``). Each net gets a private, empty cache
directory; the first worker compiles (cold), the next ``--repeat`` find the program and
its code in the cache (warm: the compiler does not run). The table gives the cold time and
the median warm time of ``net.init()`` alone (building the layers, which draws the random
weights, is not counted).

``--modules N ...`` times the LLVM side of a cold compile instead: each net's program (as
``net.init()`` makes it) is cut into N modules as ``LATTE_COMPILE_JOBS=N`` would, and each
module is built and compiled in turn in one process; the longest module is what N cores
compiling side by side wait for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import OtherLoad, emit, machine, table  # noqa: E402

VGG16 = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


def vgg16(threads: int):
    """VGG-16 (configuration D) at batch 2 on 224x224 images, not yet initialized."""
    import numpy as np  # noqa: PLC0415

    from latte import Net  # noqa: PLC0415
    from latte.stdlib import (  # noqa: PLC0415
        ArrayDataLayer,
        ConvolutionLayer,
        FullyConnectedLayer,
        MaxPoolingLayer,
        ReLULayer,
        SoftmaxLossLayer,
    )

    net = Net(2, num_threads=threads, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 224, 224)).astype(np.float32)
    data, label = ArrayDataLayer(net, (x, rng.integers(0, 1000, 2)), shuffle=False)
    top = data
    for b, block in enumerate(VGG16, 1):
        for i, channels in enumerate(block, 1):
            conv = ConvolutionLayer(f"conv{b}_{i}", net, top, channels, 3, pad=1)
            top = ReLULayer(f"relu{b}_{i}", net, conv)
        top = MaxPoolingLayer(f"pool{b}", net, top, 2)
    for i, width in enumerate((4096, 4096), 6):
        top = ReLULayer(f"relu{i}", net, FullyConnectedLayer(f"fc{i}", net, top, width))
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc8", net, top, 1000), label)
    return net


def resnet50(threads: int):
    """ResNet-50 (``latte.zoo``) at batch 2 on 224x224 images with a softmax loss."""
    import numpy as np  # noqa: PLC0415

    from latte import Net  # noqa: PLC0415
    from latte.stdlib import ArrayDataLayer, SoftmaxLossLayer  # noqa: PLC0415
    from latte.zoo import resnet50 as zoo_resnet50  # noqa: PLC0415

    net = Net(2, num_threads=threads, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 224, 224)).astype(np.float32)
    data, label = ArrayDataLayer(net, (x, rng.integers(0, 1000, 2)), shuffle=False)
    SoftmaxLossLayer("loss", net, zoo_resnet50(net, data, 1000), label)
    return net


def lenet(threads: int):
    from lenet import latte_lenet  # noqa: PLC0415

    return latte_lenet(threads, init=False)


NETS = {"vgg16": vgg16, "resnet50": resnet50, "lenet": lenet}


def worker(name: str, threads: int) -> None:
    net = NETS[name](threads)
    start = time.perf_counter()
    net.init()
    emit({"init_s": time.perf_counter() - start, "from_cache": net.program.library.from_cache,
          "stored": net.program.stored})


def module_times(name: str, threads: int, parts: list[int]) -> list[list[str]]:
    """Per count of modules: how many the program makes, the longest one's and all
    modules' seconds to build and compile (one after another, here)."""
    from latte.compiler.jit import target  # noqa: PLC0415
    from latte.compiler.pipeline import llvm_ir  # noqa: PLC0415

    net = NETS[name](threads)
    net.init()
    program, rows = net.program, []
    for n in parts:
        times = []
        for module in llvm_ir(program.segments(), program.buffer_index(), threads, n):
            start = time.perf_counter()
            target().object(module(), 3)
            times.append(time.perf_counter() - start)
        rows.append([name, str(n), str(len(times)), f"{max(times):.2f}", f"{sum(times):.2f}"])
    return rows


def run(name: str, threads: int, cache: str) -> dict:
    env = dict(os.environ, LATTE_CACHE_DIR=cache, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, __file__, "--worker", name, "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"[{name} worker failed]\n{out.stderr[-2000:]}")
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default=None, help="internal: time one net.init()")
    ap.add_argument("--nets", nargs="*", default=list(NETS), choices=list(NETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="warm runs per net")
    ap.add_argument("--modules", type=int, nargs="*", default=None,
                    help="time each of N modules' LLVM compile in turn, per N")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat takes 1 or more warm runs (the table gives their median)")
    if args.worker:
        return worker(args.worker, args.threads)
    load, rows = OtherLoad(), []
    if args.modules:
        for name in args.nets:
            rows += module_times(name, args.threads, args.modules)
        print(f"LLVM modules built and compiled one after another, {args.threads} threads, "
              f"opt level 3; {machine()}")
        print(table(rows, ["net", "modules asked", "modules", "longest s", "all s"]))
        print(load.note())
        return None
    for name in args.nets:
        cache = tempfile.mkdtemp(prefix="latte-init-")
        try:
            cold = run(name, args.threads, cache)
            warm = [run(name, args.threads, cache) for _ in range(args.repeat)]
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        hits, stored = sum(w["from_cache"] for w in warm), sum(w["stored"] for w in warm)
        rows.append([name, f"{cold['init_s']:.2f}",
                     f"{statistics.median(w['init_s'] for w in warm):.2f}",
                     f"{hits}/{len(warm)}", f"{stored}/{len(warm)}"])
    print(f"net.init() in fresh processes, {args.threads} threads, opt level 3; "
          f"{machine()}")
    print(table(rows, ["net", "cold s", "warm s (median)", "warm runs: code from cache",
                       "program stored"]))
    print(load.note())


if __name__ == "__main__":
    main()
