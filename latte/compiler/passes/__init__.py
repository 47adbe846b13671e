"""Loop-IR passes, one per module; each is a function ``Kernel -> Kernel``."""

from latte.compiler.passes.data_copy import copy_windows
from latte.compiler.passes.dead_grads import prune_dead_gradients
from latte.compiler.passes.distribute import distribute_loops
from latte.compiler.passes.fuse import fuse_nests
from latte.compiler.passes.gemm import match_gemm
from latte.compiler.passes.localize import drop_stores, keep_in_locals, localize
from latte.compiler.passes.parallel import parallelize
from latte.compiler.passes.tiling import tile_loops
from latte.compiler.passes.zero_init import fold_zero_init

__all__ = ["copy_windows", "distribute_loops", "drop_stores", "fold_zero_init", "fuse_nests",
           "keep_in_locals", "localize", "match_gemm", "parallelize", "prune_dead_gradients", "tile_loops"]
