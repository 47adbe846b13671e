"""Streamed stores: a tiled product that writes far more than the caches hold, doing few
multiply-adds per element it writes, stores its tiles past the caches.

A first convolution over an RGB image (VGG's conv1_1: 27 multiply-adds per output, 12.8 MB
written per 224x224 image) is bound by its stores: each line written is first read from
memory (the core owns it before writing) and evicts another, often dirty, on its way. A
non-temporal store writes the line to memory without reading it or filling the caches.
Where the product does at most ``2 * lanes`` multiply-adds per element (then at peak it
writes a byte or more a cycle per core; at 32 and more the product's own work hides the
stores), the block of C it writes, over the loops that move it, is larger than the L2s of
all threads (it leaves them before anything reads it), and the program's buffers outgrow
the L3 (else they all stay there from one run to the next, the product's lines too: LeNet's
15 MiB ran slower streamed), :mod:`latte.compiler.microkernel` stores its full vectors
non-temporally and fences them before the product returns (a block that takes turns in a
smaller buffer, a fused group's line buffer, stays). Only where every vector it stores is
provably aligned to its width (a vector store across two lines cannot stream): C's offset
and leading dimension multiples of ``lanes`` in a buffer that starts on a 64-byte boundary
(every buffer but a window into a join's, :mod:`latte.aligned`). ``LATTE_STREAM=0`` turns
it off.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

from latte.aligned import ALIGN
from latte.compiler.buffers import BufferPlan
from latte.compiler.ir import Block, Gemm, If, Kernel, Loop

#: Stream the stores of every tiled product that stores C whole, whatever its size, work and
#: alignment (LLVM splits a vector store it cannot prove aligned): the random tester's nets
#: are too small to stream otherwise.
EVERY = False


def store_budget(bufs: BufferPlan, sizes: dict[int, int]) -> int | None:
    """The bytes a product may write over its loops before its stores stream: the L2s of
    all threads where the buffers of the program (``bufs``; their windows share memory)
    outgrow the L3 (``sizes``: one core's caches by level), else None (nothing streams)."""
    if os.environ.get("LATTE_STREAM") == "0":
        return None
    memory = 4 * sum(b.size for b in bufs.buffers.values() if b not in bufs.windows)
    return bufs.threads * sizes[2] if EVERY or memory > sizes[3] else None


def stream_stores(kernel: Kernel, bufs: BufferPlan, budget: int | None) -> Kernel:
    """``kernel`` with its store-bound tiled products streaming their stores (``stream``:
    the alignment their vectors' addresses are known to have; see the module) where they
    write more than ``budget`` bytes (:func:`store_budget`; None: none streams)."""
    if budget is None:
        return kernel
    body = _block(kernel.body, {}, bufs, budget)
    return kernel if body is kernel.body else replace(kernel, body=body)


def _block(block: Block, loops: dict[str, int], bufs: BufferPlan, caches: int) -> Block:
    stmts = tuple(_stmt(s, loops, bufs, caches) for s in block.stmts)
    return block if all(a is b for a, b in zip(stmts, block.stmts)) else Block(stmts)


def _stmt(s, loops: dict[str, int], bufs: BufferPlan, caches: int):
    if isinstance(s, Loop):
        body = _block(s.body, {**loops, s.var: s.extent}, bufs, caches)
        return s if body is s.body else replace(s, body=body)
    if isinstance(s, If):
        then, orelse = _block(s.then, loops, bufs, caches), _block(s.orelse, loops, bufs, caches)
        return s if then is s.then and orelse is s.orelse else replace(s, then=then, orelse=orelse)
    if isinstance(s, Gemm):
        align = _stream_alignment(s, loops, bufs, caches)
        return replace(s, stream=align) if align else s
    return s


def _stream_alignment(g: Gemm, loops: dict[str, int], bufs: BufferPlan, caches: int) -> int:
    """The alignment in bytes of ``g``'s vector stores if they should stream, else 0: a tiled
    product of C stored whole (no ``beta``, no blocks of ``k``), bound by its stores,
    writing more than ``caches`` bytes over ``loops`` (variable -> extent), each full vector
    aligned to its width (with :data:`EVERY`, any such product)."""
    if not g.panel or g.trans_b or g.beta != 0.0 or g.k_block not in (0, g.k):
        return 0
    _, cols, lanes = g.panel
    if g.c_buf.dtype != "float32":
        return 0
    base = 4 if g.c_buf in bufs.windows else ALIGN
    steps = math.gcd(g.c_off.const, g.ldc, cols, lanes, *(c for _, c in g.c_off.terms))
    align = min(base, 4 * (steps & -steps))   # the largest power of two dividing them all
    if EVERY:
        return align
    if align < 4 * lanes or g.k > 2 * lanes:
        return 0
    written = g.m * g.n   # over the loops that move C's block, at most C's buffer (a line
    for var in g.c_off.vars:   # buffer's blocks take turns in it)
        written *= loops.get(var, 1)
    return align if 4 * min(written, g.c_buf.size) > caches else 0
