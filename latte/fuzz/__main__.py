"""``python -m latte.fuzz SEED [SEED...]``: print random cases (configuration, ensembles,
mappings, generated neuron sources). ``pytest tests/test_fuzz.py --fuzz-seed SEED`` checks one."""

from __future__ import annotations

import argparse
import inspect
import sys

from latte import Ensemble, Net
from latte.fuzz.nets import build_case, config


def show(seed: int, derived: float = 0.25) -> None:
    """Print case ``seed`` as the suite builds it (its losses aside)."""
    cfg = config(seed)
    print(f"case {seed}: batch {cfg.batch}, {cfg.time_steps} time step(s), {cfg.threads} "
          f"thread(s), level {cfg.level}")
    net = Net(cfg.batch, time_steps=cfg.time_steps, opt_level=0)
    build_case(net, seed, derived=derived)
    for ens in net.ensembles:
        print(f"  {ens!r}")
        for c in net.connections_into(ens):
            first = c.mapping(*([0] * len(ens.shape)))
            print(f"    <- {c.source.name}: neuron 0 reads {first}, padding {c.padding}"
                  + (", recurrent" if c.recurrent else ""))
    for ens in net.ensembles:
        if isinstance(ens, Ensemble) and ens.neuron_type.__module__.startswith("latte_fuzz"):
            print(f"\n# {ens.name}\n{inspect.getsource(inspect.getmodule(ens.neuron_type))}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m latte.fuzz", description=__doc__)
    parser.add_argument("seeds", type=int, nargs="+")
    parser.add_argument("--derived", type=float, default=0.25,
                        help="fraction of generated neurons without backward (the suite's)")
    args = parser.parse_args(argv)
    for seed in args.seeds:
        show(seed, args.derived)
    return 0


if __name__ == "__main__":
    sys.exit(main())
