"""IR verification: every affine buffer index stays inside its buffer.

Run after synthesis, so that an out-of-range index in a neuron body (``self.weights[i + 1]``
over the whole vector) is a compile error naming the ensemble and field, never a wild read
or a segfault at run time. Refs under an ``if`` or a conditional expression (padding
guards, the neuron's own ``if``) are not checked: their condition may keep them in range.
"""

from __future__ import annotations

from latte.compiler.ir import Affine, Block, If, Kernel, Load, Loop, Node, Ref, Select, children
from latte.errors import CompileError


def verify_bounds(kernel: Kernel) -> None:
    """Raise :class:`CompileError` if an unguarded affine index can leave its buffer."""
    _visit(kernel.body, {}, kernel)


def _visit(node: Node, loops: dict, kernel: Kernel) -> None:
    if isinstance(node, (If, Select)):
        return  # conditional accesses: the condition may keep them in range
    if isinstance(node, Loop):
        if node.start >= node.stop:
            return
        _visit(node.body, {**loops, node.var: (node.start, node.stop - 1)}, kernel)
        return
    if isinstance(node, Ref):
        for dim, (idx, extent) in enumerate(zip(node.index, node.view)):
            if isinstance(idx, Affine) and idx.vars <= loops.keys():
                lo, hi = idx.bounds(loops)
                if lo < 0 or hi >= extent:
                    raise CompileError(
                        f"{kernel.name}: index {lo}..{hi} of dimension {dim} of "
                        f"{node.buffer.name} is outside its size {extent} (shape {node.view}); "
                        "check the loop bounds and indices in the neuron body")
    for child in children(node):
        if isinstance(child, (Node, Block, Load)):
            _visit(child, loops, kernel)
