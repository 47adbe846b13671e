"""Loop-IR passes, one per module; each is a function ``Kernel -> Kernel``."""

from latte.compiler.passes.dead_grads import prune_dead_gradients
from latte.compiler.passes.distribute import distribute_loops
from latte.compiler.passes.gemm import match_gemm
from latte.compiler.passes.zero_init import fold_zero_init

__all__ = ["distribute_loops", "fold_zero_init", "match_gemm", "prune_dead_gradients"]
