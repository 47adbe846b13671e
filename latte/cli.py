"""The ``latte`` command: ``latte run NET.py`` trains a net script, ``latte explain NET.py``
prints the compiler's plan for it, ``latte check NET.py`` checks its compiled code, ``latte
export NET.py -o DIR`` writes a C library for inference with it, ``latte plot LOG.csv``
draws a run's training curves."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import runpy
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import latte
import latte.solvers
import latte.solvers.sgd
from latte.check import check
from latte.compiler.explain import explain_program
from latte.errors import DistributedError, LatteError
from latte.export import export
from latte.net import Net
from latte.overrides import OVERRIDES
from latte.plot import plot
from latte.progress import PhaseProfiler, Progress, patched, silent
from latte.runtime import distributed
from latte.streams import outliving_readers, silence


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``latte`` console script; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version or a usage error (status 2)
        return _exit_status(e)
    if args.command == "plot":
        return _act(args, args.log)
    script = os.path.abspath(args.script)
    if not os.path.isfile(script):
        return _fail(f"can't open script {args.script!r}: no such file")
    if distributed.active():
        return _on_every_rank(args, script)
    return _act(args, script)


def _act(args: argparse.Namespace, script: str) -> int:
    try:
        return args.action(args, script)
    except KeyboardInterrupt:
        print("latte: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `latte explain NET.py | head`: stop quietly
        silence(sys.stdout)
        return 1
    except SystemExit as e:  # the script called sys.exit()
        return _exit_status(e)
    except DistributedError as e:
        if e.shared:   # every rank raised it alike: _on_every_rank reports it once
            raise
        return _fail(_describe(e, script), e)
    except Exception as e:
        return _fail(_describe(e, script), e)


def _on_every_rank(args: argparse.Namespace, script: str) -> int:
    """Under ``mpiexec``: run as one rank; a failing rank names itself (see :func:`_fail`)
    and takes the job down with ``Abort``, so no other rank hangs in a reduction. A rank
    that succeeds says so and waits for the others, so that one still waiting for it in a
    collective fails instead of hanging (:func:`distributed.watch_exits`)."""
    rank = distributed.rank()   # initializes MPI before the script runs
    # mpiexec names a killed rank by its PID only: say which PID is which rank
    where = distributed.allgather(f"{rank}={os.getpid()}@{socket.gethostname()}")
    if rank == 0:
        print(f"latte: {len(where)} ranks (rank=pid@host): {' '.join(where)}", file=sys.stderr,
              flush=True)
    distributed.watch_exits()
    try:
        status = _act(args, script)
    except DistributedError as e:   # every rank stops here alike: none needs stopping
        distributed.unwatch()
        return _fail(_describe(e, script), e, ranked=False) if rank == 0 else 1
    if status == 0:
        distributed.finish()
    else:
        print(f"latte: rank {rank} exits with status {status}: stopping every rank",
              file=sys.stderr, flush=True)
        distributed.abort(status)
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="latte", description=__doc__)
    parser.add_argument("--version", action="version", version=f"latte {latte.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run a net script, training with a progress bar",
                              description="Run NET.py as __main__; the options override what "
                                          "the script passes to Net and SolverParameters.")
    run.add_argument("script", metavar="NET.py")
    run.add_argument("--max-epoch", type=_count(0), metavar="N", help="epochs to train")
    run.add_argument("--threads", type=_count(1), metavar="N", help="worker threads")
    run.add_argument("--seed", type=int, metavar="S", help="random seed")
    _add_opt_level(run)
    run.add_argument("--profile", action="store_true",
                     help="print where the time went: compile, forward, backward, update, "
                          "and forward/backward per ensemble")
    again = run.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue from the newest snapshot in the snapshot dir")
    again.add_argument("--overwrite", action="store_true",
                       help="delete another run's snapshots and log in the snapshot dir")
    run.set_defaults(action=_run)

    explain = commands.add_parser("explain", help="compile a net script's net(s) and print "
                                  "the plan, without training")
    explain.add_argument("script", metavar="NET.py")
    _add_opt_level(explain)
    explain.set_defaults(action=_explain)

    check = commands.add_parser("check", help="compare a net script's net at an opt level with "
                                "level 0, and level 0's gradients with finite differences",
                                description="Build NET.py's net(s) twice without training, feed "
                                            "random data, and compare every ensemble's values "
                                            "and gradients at level L with level 0, and level "
                                            "0's gradients with central finite differences. "
                                            "Exit status 1 when any disagree.")
    check.add_argument("script", metavar="NET.py")
    check.add_argument("--opt-level", type=int, choices=range(4), default=3, metavar="L",
                       help="the level to check against level 0 (default 3)")
    check.add_argument("--threads", type=_count(1), metavar="N", help="worker threads")
    check.add_argument("--seed", type=int, default=0, metavar="S",
                       help="seed of the random data and probes (default 0)")
    check.add_argument("--probes", type=_count(1), default=1, metavar="N",
                       help="finite-difference probes per array (default 1)")
    check.set_defaults(action=_check)

    export = commands.add_parser("export", help="write a C library for inference with the "
                                 "script's net: latte_model.h and liblatte_model.so",
                                 description="Build NET.py's net without training, load the "
                                             "snapshot into it, and write DIR/latte_model.h and "
                                             "DIR/liblatte_model.so (with the native libraries "
                                             "it needs beside it): int latte_model_predict("
                                             "const float *input, int n, float *output) runs "
                                             "the test-phase forward as net.predict does.")
    export.add_argument("script", metavar="NET.py")
    export.add_argument("-o", "--output", required=True, metavar="DIR",
                        help="the folder to write (created if needed)")
    export.add_argument("--snapshot", metavar="PATH",
                        help="parameters and state to load (a net.save file); without it the "
                             "weights are those the script initializes")
    export.add_argument("--threads", type=_count(1), metavar="N",
                        help="threads the library runs on")
    _add_opt_level(export)
    export.set_defaults(action=_export)

    plot = commands.add_parser("plot", help="draw a run's training curves from its log.csv",
                               description="Draw the training loss per iteration (from the "
                                           "iterations.csv beside the log, when there is one), "
                                           "the test loss and the test accuracy per epoch "
                                           "into a PNG. Needs matplotlib.")
    plot.add_argument("log", metavar="LOG.csv", help="a log.csv that latte run wrote")
    plot.add_argument("-o", "--output", metavar="PNG",
                      help="the image to write (default: curves.png beside the log)")
    plot.set_defaults(action=_plot)
    return parser


def _add_opt_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--opt-level", type=int, choices=range(4), metavar="L",
                        help="0 plain loops, 1 + GEMM, 2 + tiling/parallel, 3 + fusion")


def _count(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


# ---------------------------------------------------------------- latte run
def _run(args: argparse.Namespace, script: str) -> int:
    profiler = PhaseProfiler() if args.profile else None
    leader = distributed.rank() == 0   # under MPI only rank 0 prints progress
    nets: list[Net] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(outliving_readers())   # `latte run NET.py | head` trains on
        progress = Progress(sys.stderr) if leader else silent
        stack.enter_context(_overrides(max_epoch=args.max_epoch, num_threads=args.threads,
                                       seed=args.seed, opt_level=args.opt_level,
                                       profile=args.profile or None, progress=progress,
                                       resume=args.resume or None,
                                       overwrite=args.overwrite or None, plot=True))
        if leader:
            stack.callback(progress.close)
        if profiler:
            stack.enter_context(profiler.installed())
            stack.enter_context(_tracking(nets))
        start = time.perf_counter()
        _run_script(script)
        elapsed = time.perf_counter() - start
    if profiler and leader:
        profiler.report(elapsed, sys.stderr)
        profiled = [n for n in nets if n.profile is not None
                    and (n.profile.calls["forward"] or n.profile.calls["test"])]
        for i, net in enumerate(profiled):
            if len(profiled) > 1:
                print(f"net {i + 1} of {len(profiled)} (batch size {net.batch_size}):",
                      file=sys.stderr)
            print(net.profile.format(), file=sys.stderr)
    return 0


# ---------------------------------------------------------------- latte explain
def _explain(args: argparse.Namespace, script: str) -> int:
    _print_plans(_built_nets(script, "explain", opt_level=args.opt_level))
    return 0


def _print_plans(nets: list[Net]) -> None:
    for i, net in enumerate(nets):
        net.init()
        if len(nets) > 1:
            print(f"#### net {i + 1} of {len(nets)} (batch size {net.batch_size})")
        print(explain_program(net.program), end="\n\n" if i + 1 < len(nets) else "\n",
              flush=True)


# ---------------------------------------------------------------- latte check
def _check(args: argparse.Namespace, script: str) -> int:
    nets = _built_nets(script, "check", opt_level=args.opt_level, num_threads=args.threads)
    # level 0 runs one segment per ensemble (as when profiling), so a probe can rerun the rest
    refs = _built_nets(script, "check", opt_level=0, num_threads=args.threads, profile=True)
    if len(nets) != len(refs):
        raise LatteError(f"{os.path.basename(script)} built {len(nets)} nets, then {len(refs)}: "
                         "cannot compare its builds")
    failed, suspects = [], []
    for i, (net, ref) in enumerate(zip(nets, refs)):
        if len(nets) > 1:
            print(f"#### net {i + 1} of {len(nets)} (batch size {net.batch_size})")
        report = check(net, ref, seed=args.seed, probes=args.probes)
        print(report.format(), flush=True)
        failed += [r.name for r in report.failed()]
        suspects += [r.name for r in report.rows if r.suspect]
    if failed:
        print(f"latte check: {', '.join(failed)} disagree"
              + (f" (likeliest wrong backward: {', '.join(suspects)})" if suspects else ""),
              file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- latte export
def _export(args: argparse.Namespace, script: str) -> int:
    nets = _built_nets(script, "export", opt_level=args.opt_level, num_threads=args.threads)
    if len(nets) != 1:
        raise LatteError(f"{os.path.basename(script)} builds {len(nets)} nets: latte export "
                         "exports a script that builds one")
    written = export(nets[0], args.output, snapshot=args.snapshot,
                     origin=os.path.basename(script))
    print("wrote " + ", ".join(map(str, written)))
    return 0


# ---------------------------------------------------------------- latte plot
def _plot(args: argparse.Namespace, log: str) -> int:
    print(f"wrote {plot(log, args.output)}")
    return 0


class _Built(BaseException):
    """Stops a script once its nets are built (a BaseException so that the script's own
    ``except Exception`` cannot swallow it)."""


def _built_nets(script: str, what: str, **overrides: Any) -> list[Net]:
    """Run ``script`` with ``overrides`` up to its first ``solve`` or ``Net.forward`` (or
    to its end) and return the nets it built, for ``latte explain`` and ``latte check``."""
    nets: list[Net] = []

    def stop(*_: Any, **__: Any) -> None:
        raise _Built

    with contextlib.ExitStack() as stack:
        stack.enter_context(_overrides(**overrides))
        stack.enter_context(_tracking(nets))
        for owner in (latte.solvers, latte.solvers.sgd):
            stack.enter_context(patched(owner, "solve", stop))
        stack.enter_context(patched(Net, "forward", stop))
        try:
            _run_script(script)
        except _Built:
            pass
    if not nets:
        raise LatteError(f"{os.path.basename(script)} creates no latte.Net: nothing to {what}")
    return nets


@contextlib.contextmanager
def _tracking(nets: list[Net]) -> Iterator[None]:
    """Append every Net constructed inside the block to ``nets``."""
    original = Net.__init__

    @functools.wraps(original)
    def init(self: Net, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self not in nets:
            nets.append(self)

    with patched(Net, "__init__", init):
        yield


# ---------------------------------------------------------------- helpers
def _run_script(script: str) -> None:
    """Execute ``script`` as ``__main__`` with its own argv and its folder on sys.path."""
    argv, path = sys.argv[:], sys.path[:]
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path


@contextlib.contextmanager
def _overrides(**values: Any) -> Iterator[None]:
    """Set the given (non-None) OVERRIDES for the duration of the block."""
    saved = dict(OVERRIDES)
    OVERRIDES.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        OVERRIDES.clear()
        OVERRIDES.update(saved)


def _describe(exc: BaseException, script: str) -> str:
    """The message for an error from the script, with the script line that led to it."""
    message = str(exc) if isinstance(exc, LatteError) else f"{type(exc).__name__}: {exc}"
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__)
             if os.path.abspath(f.filename) == script]
    if lines:
        message += f" (from {os.path.basename(script)}, line {lines[-1]})"
    if not isinstance(exc, LatteError):
        message += "; set LATTE_TRACEBACK=1 to see the traceback"
    return message


def _fail(message: str, exc: BaseException | None = None, ranked: bool = True) -> int:
    """Print ``message`` as one paragraph (naming this rank under MPI when ``ranked``)."""
    if exc is not None and os.environ.get("LATTE_TRACEBACK", "") not in ("", "0"):
        traceback.print_exception(exc)
    paragraph = re.sub(r"\s*\n\s*", " ", message.strip())
    if distributed.active() and ranked:
        paragraph = f"rank {distributed.rank()} failed: {paragraph}"
    print(f"latte: error: {paragraph}", file=sys.stderr, flush=True)
    return 1


def _exit_status(exit: SystemExit) -> int:
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)
    return 1
