"""The latte compiler. :func:`compile_net` (``pipeline.py``) runs the pipeline, a declared
list of named steps.

Set ``LATTE_DUMP=ir`` (every step), ``LATTE_DUMP=ir:STEP`` (one step, e.g. ``ir:tile_loops``)
or ``LATTE_DUMP=llvm`` (comma-separated) to print the loop IR after steps and the LLVM IR.
"""

from latte.compiler.ir import Buffer, Const, walk
from latte.compiler.pipeline import STEPS, compile_net
from latte.compiler.printer import format_ir
from latte.compiler.program import (
    EnsemblePlan,
    HostStep,
    Program,
    Segment,
    TimeSteps,
    flat_steps,
)

__all__ = ["Program", "Segment", "HostStep", "TimeSteps", "flat_steps", "EnsemblePlan", "STEPS",
           "compile_net", "format_ir",
           "Buffer", "Const", "walk"]
