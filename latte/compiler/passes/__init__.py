"""Loop-IR passes, one per module; each is a function ``Kernel -> Kernel``."""

from latte.compiler.passes.dead_grads import prune_dead_gradients
from latte.compiler.passes.distribute import distribute_loops
from latte.compiler.passes.gemm import match_gemm

__all__ = ["distribute_loops", "match_gemm", "prune_dead_gradients"]
