"""A zoo net (or the MLP of ``benchmarks/mlp.py``) compiled under two or more settings of a
compiler variable, timed alternately in one process: the ratios of code paths without the
drift between separate runs.

    python benchmarks/ab.py resnet50 [--var LATTE_PACK --values 0 1] [--mode inference]
                            [--threads 2] [--repeat 15] [--avx2]
    python benchmarks/ab.py mlp --mode training --var LATTE_DOT
    python benchmarks/ab.py lstm --mode training --var LATTE_PACK
    python benchmarks/ab.py vgg16 --var LATTE_STREAM --layers

Each net is compiled with ``--var`` set to each of ``--values`` (two or more; the compiler
reads these variables as it compiles), then they run in turn, ``--repeat`` times each (a
batch-1 test forward, or a batch-16 forward and backward; the MLP at its batch of 128), and
the medians and their ratios to the first setting's are printed. ``lstm`` and ``gru`` are
the nets of ``benchmarks/lstm.py``, in training a forward and a backward through their 50
steps; ``vgg_mini`` is ``benchmarks/vgg_mini.py``'s (batch 64, training: forward and backward).
``--layers`` (zoo nets) compiles them with one native segment per ensemble or fused group
and prints, per segment, its median milliseconds and share of the machine's peak under each
setting (``latte run --profile``'s rows, measured alternately too). ``--avx2`` compiles
for an AVX2 host on this one (``LATTE_TARGET=avx2``: LLVM's target
without AVX-512, tiles for 16 registers of 256 bits, OpenBLAS's Haswell kernels).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("net")
    ap.add_argument("--var", default="LATTE_PACK")
    ap.add_argument("--values", nargs="+", default=["0", "1"],
                    help="two or more settings; each one's ratio is taken against the first")
    ap.add_argument("--mode", choices=["inference", "training"], default="inference")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--avx2", action="store_true")
    ap.add_argument("--layers", action="store_true", help="zoo nets: each segment's time too")
    args = ap.parse_args()
    if len(args.values) < 2:
        ap.error("--values takes two or more settings")
    if args.net == "vgg_mini" and args.mode != "training":
        ap.error("vgg_mini runs in --mode training (its data layer has no test set)")
    if args.layers and args.net in ("mlp", "vgg_mini", "lstm", "gru"):
        ap.error("--layers times the zoo nets")
    if args.avx2:   # before anything is compiled
        os.environ["LATTE_TARGET"] = "avx2"
    from lstm import latte_net as latte_rnn  # noqa: PLC0415
    from mlp import BATCH, latte_mlp  # noqa: PLC0415
    from vgg_mini import latte_vgg_mini  # noqa: PLC0415
    from zoo import MODES, latte_net  # noqa: PLC0415

    from latte import Phase  # noqa: PLC0415

    training = args.mode == "training"
    runs, nets = {}, {}
    for value in args.values:
        os.environ[args.var] = value
        net = nets[value] = (
            latte_mlp(BATCH, args.threads) if args.net == "mlp"
            else latte_vgg_mini(args.threads) if args.net == "vgg_mini"
            else latte_rnn(args.net, args.threads) if args.net in ("lstm", "gru")
            else latte_net(args.net, 224, MODES[args.mode], training, args.threads,
                           profile=args.layers)[0])
        runs[value] = ((lambda n=net: (n.forward(), n.backward())) if training
                       else (lambda n=net: n.forward(Phase.TEST)))
    for fn in runs.values():
        fn(), fn()
    times = {value: [] for value in runs}
    rows = {value: {} for value in runs}   # per setting, segment -> ms of each run
    phases = ("forward", "backward") if training else ("test",)
    for _ in range(args.repeat):
        for value, fn in runs.items():
            if args.layers:
                nets[value].profile.reset()
            start = time.perf_counter()
            fn()
            times[value].append(time.perf_counter() - start)
            if args.layers:
                for row, ms in nets[value].profile.ms_per_call().items():
                    rows[value].setdefault(row, []).append(sum(ms[p] for p in phases))
    ms = {value: statistics.median(t) * 1e3 for value, t in times.items()}
    print(f"{args.net} {args.mode}, {args.threads} threads, median of {args.repeat}; "
          f"{machine()}{'; compiled as for AVX2' if args.avx2 else ''}")
    for value in args.values:
        print(f"  {args.var}={value}: {ms[value]:.1f} ms")
    first = args.values[0]
    for value in args.values[1:]:
        print(f"  {args.var}={first} / {args.var}={value}: {ms[first] / ms[value]:.3f}")
    if args.layers:
        print(_segments(args, nets, rows, phases))


def _segments(args, nets: dict, rows: dict, phases: tuple[str, ...]) -> str:
    """Per segment (in the first setting's order), its median ms and % of the peak under
    each setting."""
    from latte.compiler.machine import peak  # noqa: PLC0415

    top = peak().at(args.threads) * 1e9
    names = list(rows[args.values[0]])
    width = max(len(n) for n in names)
    lines = [f"  {'segment':<{width}} " + " ".join(f"{args.var + '=' + v:>24}" for v in args.values)]
    for name in names:
        cells = []
        for value in args.values:
            ms = statistics.median(rows[value].get(name, [0.0]))
            flops = sum(nets[value].profile.flops.get(name, {}).get(p, 0) for p in phases)
            share = f"{flops / (ms / 1e3) / top:6.1%}" if flops and ms else "     -"
            cells.append(f"{ms:>14.3f} ms {share}")
        lines.append(f"  {name:<{width}} " + " ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
