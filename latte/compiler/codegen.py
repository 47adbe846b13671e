"""Codegen: loop IR -> LLVM IR (llvmlite.ir).

Each kernel becomes an internal function taking its buffers as ``noalias``
pointers; a *segment* (consecutive kernels run without returning to Python) is an exported
function ``void seg(ptr* buffers)`` that loads the pointers from the runtime's buffer table
and calls its kernels. Kernels that differ only in the buffers they touch (VGG's repeated
3x3 convolutions, ResNet's repeated blocks) share one function (which LLVM's inliner may
still copy into its callers). Float arithmetic carries ``reassoc contract`` so that
reductions vectorize. A loop storing zeros to consecutive elements is one ``memset`` (LLVM
would find it too, after its loop passes had gone through every such loop).

With ``LATTE_CHECK_BOUNDS=1`` every load, store and GEMM operand block is checked against
its buffer: at compile time where its offset is affine and lies inside the buffer for every
value the enclosing loops give their variables (their constant bounds alone, guards
ignored: a proof that needs nothing else), else at run time, where an access outside it is
skipped (a load gives 0) and records the access site (kernel and buffer) in
``BOUNDS_SITE`` and its offset in ``BOUNDS_OFFSET``, which the executor reads after each
segment. The checks change the IR, hence the cache key.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os

from llvmlite import ir

from latte.compiler import mathfn, microkernel
from latte.compiler.fingerprint import kernel_buffers, shape
from latte.compiler.ir import (
    TID,
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    BoolOp,
    Buffer,
    Call,
    Compare,
    Const,
    Expr,
    Gemm,
    If,
    Kernel,
    Load,
    Loop,
    LoopKind,
    Ref,
    Select,
    UnaryOp,
    Var,
    accesses,
    statements,
    touched,
    walk,
)
from latte.errors import CompileError

F32, I32, I64, I1 = ir.FloatType(), ir.IntType(32), ir.IntType(64), ir.IntType(1)
I8P = ir.IntType(8).as_pointer()
PTR = ir.PointerType(F32)
FAST = ("reassoc", "contract", "nsz")
LINE = 8        # i64 per cache line: the stealing counters lie a line apart
STEAL_MAX = 64  # iterations per thread up to which a parallel loop's threads steal
SGEMM, SGEMV = "scipy_cblas_sgemm", "scipy_cblas_sgemv"
BOUNDS_SITE, BOUNDS_OFFSET = "latte_bounds_site", "latte_bounds_offset"
_FCMP = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "==", "!=": "!="}


def _elem_type(buf: Buffer):
    return I32 if buf.dtype == "int32" else F32


class ModuleBuilder:
    """Builds one LLVM module of segments over a fixed buffer table."""

    def __init__(self, buffer_index: dict[Buffer, int], threads: int = 1, name: str = "latte"):
        self.module = ir.Module(name=name)
        self.buffer_index = buffer_index
        self.threads = threads
        self._kernels = 0
        self._shared: dict[str, ir.Function] = {}   # kernel structure -> its function
        self._tiled: dict[tuple, ir.Function] = {}   # a tiled product's shape -> its function
        self.check_bounds = check_bounds()
        self._sites: dict[str, ir.GlobalVariable] = {}
        if self.check_bounds:
            for name, ty in ((BOUNDS_SITE, I8P), (BOUNDS_OFFSET, I64)):
                var = ir.GlobalVariable(self.module, ty, name)
                var.initializer = ir.Constant(ty, None)

    def site(self, text: str) -> ir.Constant:
        """A pointer to the constant C string ``text`` (one global per distinct text)."""
        var = self._sites.get(text)
        if var is None:
            data = bytearray(text.encode()) + b"\0"
            ty = ir.ArrayType(ir.IntType(8), len(data))
            var = self._sites[text] = ir.GlobalVariable(self.module, ty, f"site{len(self._sites)}")
            var.global_constant, var.linkage = True, "private"
            var.initializer = ir.Constant(ty, data)
        return var.bitcast(I8P)

    def declare(self, name: str, ret, args) -> ir.Function:
        fn = self.module.globals.get(name)
        return fn if fn is not None else ir.Function(self.module, ir.FunctionType(ret, args), name)

    def add_segment(self, name: str, kernels: list[Kernel]) -> str:
        """An exported ``void name(ptr* buffers)`` that runs ``kernels`` in order."""
        seg = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR.as_pointer()]), name)
        builder = ir.IRBuilder(seg.append_basic_block("entry"))
        for kernel in kernels:
            bufs = kernel_buffers(kernel)
            fn = self._kernel(kernel, bufs)
            args = []
            for b in bufs:
                slot = builder.gep(seg.args[0], [ir.Constant(I64, self.buffer_index[b])], inbounds=True)
                args.append(builder.load(slot, align=8))
            builder.call(fn, args)
        builder.ret_void()
        return name

    def _kernel(self, kernel: Kernel, bufs: list[Buffer]) -> ir.Function:
        """The function running ``kernel`` over the pointers ``bufs``: one already emitted
        for a kernel of the same :func:`shape` or a new one."""
        key = shape(kernel, self.check_bounds)
        fn = self._shared.get(key)
        if fn is None:
            self._kernels += 1
            fn = self.function(f"k{self._kernels}_{_mangle(kernel.name)}", len(bufs), [])
            _KernelEmitter(self, fn, dict(zip(bufs, fn.args)), kernel).emit()
            self._shared[key] = fn
        return fn

    def tiled_product(self, g: Gemm) -> ir.Function:
        """The register-tiled product ``g`` as a function of its A, B and C pointers (and its
        epilogue's operands'), one per module for all products alike (never inlined:
        compiled once)."""
        key = tiled_key(g)
        fn = self._tiled.get(key)
        if fn is None:
            ops = len(g.operands())
            fn = self._tiled[key] = self.function(f"tiled{len(self._tiled)}", 3 + ops, [])
            fn.attributes.add("noinline")
            vec = ir.VectorType(F32, g.panel[2])
            fma = self.declare(f"llvm.fma.v{vec.count}f32", vec, [vec] * 3)
            emitter = _KernelEmitter(self, fn, {}, None)
            microkernel.emit(emitter.b, g, *fn.args[:3], fma, emitter.counted, list(fn.args[3:]))
            if g.stream:   # its non-temporal stores seen before the caller's next one
                emitter.b.call(self.declare("llvm.x86.sse.sfence", ir.VoidType(), []), [])
            emitter.b.ret_void()
        return fn

    def function(self, name: str, n_buffers: int, ints: list[str]) -> ir.Function:
        """An internal ``void name(ptr noalias x n_buffers, i64 ints...)``."""
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR] * n_buffers
                                                      + [I64] * len(ints)), name)
        fn.linkage = "internal"
        for arg in fn.args[:n_buffers]:
            arg.add_attribute("noalias")
        for arg, n in zip(fn.args[n_buffers:], ints):
            arg.name = n
        return fn


def tiled_key(g: Gemm) -> tuple:
    """What the register-tiled product ``g``'s function is made from."""
    return (g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.alpha, g.beta, g.trans_a, g.trans_b, g.packed,
            g.panel, g.k_block, microkernel.epilogue_key(g), g.c_stored, g.stream)


# what a tiled product's function costs LLVM, in the characters of a kernel shape that cost
# as much (fitted to ResNet-50's and VGG-16's modules on an AMD EPYC)
TILED_COST = 5000


def split(segments: list, parts: int) -> list[list]:
    """``segments`` in at most ``parts`` groups of about equal LLVM work, each group's in
    their order, for one module each: a kernel shape costs the length of its IR once per
    group that runs it, a tiled product :data:`TILED_COST` once per group that calls it (a
    group already holding it takes another caller for less). Each segment (largest first)
    joins the group it adds least to;
    then a segment moves to another group while that lowers the largest group's work (a
    test forward that shares its kernels with the training forward joins it once the
    backward has taken the other group). With bounds checks every module would define the
    checks' globals: one group."""
    if parts <= 1 or check_bounds():
        return [list(segments)]
    work: dict = {}   # a kernel shape or tiled product -> its cost
    shapes = []
    for seg in segments:
        mine = set()
        for kernel in seg.kernels:
            work[shape(kernel, False)] = len(shape(kernel, False))
            mine.add(shape(kernel, False))
            for g in statements(kernel.body):
                if isinstance(g, Gemm) and g.panel:
                    work[tiled_key(g)] = TILED_COST
                    mine.add(tiled_key(g))
        shapes.append(mine)
    group = [-1] * len(segments)   # -1: not placed yet
    held = [dict.fromkeys(work, 0) for _ in range(parts)]   # group -> element -> its users
    load = [0] * parts

    def place(i: int, g: int, step: int) -> None:
        """Segment ``i`` into group ``g`` (``step`` 1) or out of it (-1)."""
        for x in shapes[i]:
            held[g][x] += step
            if held[g][x] == (1 if step > 0 else 0):
                load[g] += step * work[x]
        group[i] = g if step > 0 else -1

    def cost(i: int, g: int) -> tuple[int, int]:
        """The largest group's work, then all groups' together, with segment ``i`` in ``g``."""
        was = group[i]
        if was >= 0:
            place(i, was, -1)
        place(i, g, 1)
        out = max(load), sum(load)
        place(i, g, -1)
        if was >= 0:
            place(i, was, 1)
        return out

    for i in sorted(range(len(segments)), key=lambda i: -sum(work[x] for x in shapes[i])):
        place(i, min(range(parts), key=lambda g: cost(i, g)), 1)
    improved = True
    while improved:
        improved = False
        for i, g in itertools.product(range(len(segments)), range(parts)):
            if cost(i, g) < (max(load), sum(load)):
                place(i, group[i], -1)
                place(i, g, 1)
                improved = True
    return [[seg for seg, g in zip(segments, group) if g == k] for k in range(parts)
            if k in group]


def check_bounds() -> bool:
    """Whether ``LATTE_CHECK_BOUNDS`` asks for run-time bounds checks."""
    return os.environ.get("LATTE_CHECK_BOUNDS", "") not in ("", "0")


def _zeroed(s: Loop) -> Ref | None:
    """The ref that ``s`` fills with zeros, one element per iteration, consecutive
    (``for v in range(...): ref[... + v] = 0.0``), or None."""
    if len(s.body.stmts) != 1:
        return None
    st = s.body.stmts[0]
    if not (isinstance(st, Assign) and isinstance(st.target, Ref) and isinstance(st.value, Const)
            and st.value.value == 0 and math.copysign(1.0, st.value.value) > 0):
        return None
    offset = st.target.offset()
    return st.target if offset is not None and offset.coef(s.var) == 1 else None


def _mangle(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


class _KernelEmitter:
    def __init__(self, mb: ModuleBuilder, fn: ir.Function, args: dict[Buffer, ir.Argument],
                 kernel: Kernel | None):
        self.mb, self.fn, self.args, self.kernel = mb, fn, args, kernel
        self.entry = fn.append_basic_block("entry")
        self.b = ir.IRBuilder(self.entry)
        self.loop_vars: dict[str, ir.Value] = {TID: ir.Constant(I64, 0)}
        self.ranges: dict[str, tuple[int, int]] = {TID: (0, 0)}   # loop var -> (first, last)
        self.locals: dict[str, ir.Value] = {}
        # per nested region (loop body, branch arm): an affine offset's variable part ->
        # its value, computed once where it dominates the region's later accesses
        self.offsets: list[dict[tuple, ir.Value]] = [{}]

    @contextlib.contextmanager
    def region(self):
        """Code emitted inside runs in a nested region: offsets computed there do not
        dominate what follows it."""
        self.offsets.append({})
        try:
            yield
        finally:
            self.offsets.pop()

    def emit(self):
        self.block(self.kernel.body)
        self.b.ret_void()

    # ------------------------------------------------------------ statements
    def block(self, block: Block):
        for s in block.stmts:
            self.stmt(s)

    def stmt(self, s):
        if isinstance(s, Loop):
            self.loop(s)
        elif isinstance(s, Block):
            self.block(s)
        elif isinstance(s, If):
            cond = self.cond(s.cond)
            with self.b.if_else(cond) as (then, orelse):
                with then, self.region():
                    self.block(s.then)
                with orelse, self.region():
                    self.block(s.orelse)
        elif isinstance(s, Assign):
            self.store(s.target, self.expr(s.value))
        elif isinstance(s, AugAssign):
            cur = self.expr(Load(s.target) if isinstance(s.target, Ref) else s.target)
            self.store(s.target, self.arith(s.op, cur, self.expr(s.value)))
        elif isinstance(s, Gemm):
            self.gemm(s)
        else:
            raise CompileError(f"codegen: unexpected statement {type(s).__name__}")

    def loop(self, s: Loop):
        if s.kind is LoopKind.PARALLEL and self.mb.threads > 1:
            self.parallel(s)
            return
        zeroed = None if self.mb.check_bounds else _zeroed(s)
        if zeroed is not None:
            self.zero(zeroed, s.var, ir.Constant(I64, s.start), ir.Constant(I64, s.stop))
            return
        self.ranges[s.var] = (s.start, s.stop - 1)
        self.counted(s.var, ir.Constant(I64, s.start), ir.Constant(I64, s.stop),
                     lambda iv: self.block(s.body))
        del self.ranges[s.var]

    def zero(self, ref: Ref, var: str, lo: ir.Value, hi: ir.Value) -> None:
        """``ref = 0`` for ``var`` from ``lo`` to ``hi`` (:func:`_zeroed`) as one ``memset``:
        LLVM would find it in the loop, after putting every such loop through its loop
        passes (a net's gradient zeroing holds hundreds)."""
        self.loop_vars[var] = lo
        first = self.pointer(ref, self.flat_index(ref))
        del self.loop_vars[var]
        size = self.b.mul(self.b.sub(hi, lo), ir.Constant(I64, 4))   # float32 or int32
        memset = self.mb.declare("llvm.memset.p0i8.i64", ir.VoidType(),
                                 [I8P, ir.IntType(8), I64, I1])
        self.b.call(memset, [self.b.bitcast(first, I8P), ir.Constant(ir.IntType(8), 0), size,
                             ir.Constant(I1, 0)])

    def counted(self, name: str, lo: ir.Value, hi: ir.Value, body) -> None:
        """``for name in range(lo, hi): body(iv)`` with ``name`` bound to ``iv`` inside."""
        b = self.b
        pre = b.block
        header = self.fn.append_basic_block(f"{name}.head")
        block = self.fn.append_basic_block(f"{name}.body")
        exit_ = self.fn.append_basic_block(f"{name}.exit")
        b.branch(header)
        b.position_at_end(header)
        iv = b.phi(I64, name=name)
        iv.add_incoming(lo, pre)
        b.cbranch(b.icmp_signed("<", iv, hi), block, exit_)
        b.position_at_end(block)
        self.loop_vars[name] = iv
        with self.region():
            body(iv)
        del self.loop_vars[name]
        nxt = b.add(iv, ir.Constant(I64, 1), name=f"{name}.next", flags=("nsw", "nuw"))
        iv.add_incoming(nxt, b.block)
        b.branch(header)
        b.position_at_end(exit_)

    def parallel(self, s: Loop) -> None:
        """Outline the flat loop over ``s`` and its collapsed inner loops into a function that
        runs one static chunk, and call it on every thread through ``GOMP_parallel``. A loop
        of a few iterations per thread whose body does not read the thread number (no
        per-thread buffers: any thread may run any iteration, with the same results) is
        shared by stealing (:meth:`_steal`): a thread that a slower core, an interrupt or
        another process holds back leaves its last iterations to the others."""
        loops = [s]
        for _ in range(dict(s.meta).get("collapse", 1) - 1):
            loops.append(loops[-1].body.stmts[0])
        total = 1
        for lp in loops:
            total *= lp.extent
        used = touched(s)   # the context carries these alone
        bufs = [b for b in self.args if b in used]
        outer = [v for v in self.loop_vars if v != TID]
        mb = self.mb
        mb._kernels += 1
        name = f"{self.fn.name}_par{mb._kernels}"
        body_fn = mb.function(name, len(bufs), outer + ["lo", "hi", TID])
        inner = _KernelEmitter(mb, body_fn, dict(zip(bufs, body_fn.args)), self.kernel)
        ints = body_fn.args[len(bufs):]
        inner.loop_vars = dict(zip(outer + [TID], list(ints[:len(outer)]) + [ints[-1]]))
        inner.ranges = {**{v: self.ranges[v] for v in outer}, TID: (0, mb.threads - 1),
                        **{lp.var: (lp.start, lp.start + lp.extent - 1) for lp in loops}}

        def one(flat):
            for lp in reversed(loops):
                ext = ir.Constant(I64, lp.extent)
                idx = inner.b.urem(flat, ext) if lp is not loops[0] else flat
                inner.loop_vars[lp.var] = inner.b.add(idx, ir.Constant(I64, lp.start))
                flat = inner.b.udiv(flat, ext)
            inner.block(loops[-1].body)

        zeroed = None if mb.check_bounds or len(loops) > 1 else _zeroed(s)
        if zeroed is not None:
            start = ir.Constant(I64, s.start)
            inner.zero(zeroed, s.var, inner.b.add(ints[-3], start), inner.b.add(ints[-2], start))
        else:
            inner.counted(f"{s.var}.flat", ints[-3], ints[-2], one)
        inner.b.ret_void()
        # the trampoline GOMP calls on each thread: unpack the context, run this thread's chunk
        tramp = ir.Function(mb.module, ir.FunctionType(ir.VoidType(), [I8P]), name + "_omp")
        tramp.linkage = "internal"
        tb = ir.IRBuilder(tramp.append_basic_block("entry"))
        ctx = tb.bitcast(tramp.args[0], I64.as_pointer())
        vals = [tb.load(tb.gep(ctx, [ir.Constant(I64, i)])) for i in range(len(bufs) + len(outer))]
        tid = tb.sext(tb.call(mb.declare("omp_get_thread_num", I32, []), []), I64)
        args = [tb.inttoptr(v, PTR) for v in vals[:len(bufs)]] + vals[len(bufs):]
        steal = mb.threads < total <= STEAL_MAX * mb.threads and not _uses_tid(s)
        nvals = len(bufs) + len(outer)
        if steal:
            self._steal(tramp, tb, ctx, nvals, total, body_fn, args, tid)
        else:
            nth = tb.sext(tb.call(mb.declare("omp_get_num_threads", I32, []), []), I64)
            n = ir.Constant(I64, total)
            lo = tb.udiv(tb.mul(n, tid), nth)
            hi = tb.udiv(tb.mul(n, tb.add(tid, ir.Constant(I64, 1))), nth)
            tb.call(body_fn, args + [lo, hi, tid])
            tb.ret_void()
        # here: fill the context and fork
        b = self.b
        with b.goto_block(self.entry):
            b.position_at_start(self.entry)
            slots = b.alloca(ir.ArrayType(I64, max(1, nvals + (LINE * mb.threads if steal else 0))))
        for i, v in enumerate([b.ptrtoint(self.args[x], I64) for x in bufs]
                              + [self.loop_vars[v] for v in outer]):
            b.store(v, b.gep(slots, [ir.Constant(I32, 0), ir.Constant(I32, i)]))
        for o in range(mb.threads if steal else 0):   # each thread's next iteration
            b.store(ir.Constant(I64, total * o // mb.threads),
                    b.gep(slots, [ir.Constant(I32, 0), ir.Constant(I32, nvals + LINE * o)]))
        gomp = mb.declare("GOMP_parallel", ir.VoidType(),
                          [ir.FunctionType(ir.VoidType(), [I8P]).as_pointer(), I8P, I32, I32])
        b.call(gomp, [tramp, b.bitcast(slots, I8P), ir.Constant(I32, mb.threads), ir.Constant(I32, 0)])

    def _steal(self, tramp, tb, ctx, nvals: int, total: int, body_fn, args, tid) -> None:
        """The trampoline's body with stealing: each thread runs the iterations of its
        static chunk one at a time, taking each from its chunk's counter (an atomic add;
        the counters start at the chunks' first iterations, in the context after the
        values), then takes what is left of the other threads' chunks the same way."""
        threads = self.mb.threads
        head, take, run, done = (tramp.append_basic_block(x) for x in ("owner", "take", "run", "done"))
        entry = tb.block
        tb.branch(head)
        tb.position_at_end(head)
        j = tb.phi(I64)
        j.add_incoming(ir.Constant(I64, 0), entry)
        tb.cbranch(tb.icmp_signed("<", j, ir.Constant(I64, threads)), take, done)
        tb.position_at_end(take)
        owner = tb.urem(tb.add(tid, j), ir.Constant(I64, threads))
        hi = tb.udiv(tb.mul(ir.Constant(I64, total), tb.add(owner, ir.Constant(I64, 1))),
                     ir.Constant(I64, threads))
        slot = tb.gep(ctx, [tb.add(ir.Constant(I64, nvals), tb.mul(owner, ir.Constant(I64, LINE)))])
        i = tb.atomic_rmw("add", slot, ir.Constant(I64, 1), "monotonic")
        nxt = tb.add(j, ir.Constant(I64, 1))
        more = tb.icmp_signed("<", i, hi)
        j.add_incoming(nxt, take)
        tb.cbranch(more, run, head)
        tb.position_at_end(run)
        tb.call(body_fn, args + [i, tb.add(i, ir.Constant(I64, 1)), tid])
        tb.branch(take)
        tb.position_at_end(done)
        tb.ret_void()

    def store(self, target, value):
        if isinstance(target, Var):
            self.b.store(self.to_float(value), self.local(target.name))
            return
        ty = _elem_type(target.buffer)
        value = self.to_float(value) if ty is F32 else self.to_int(value, ty)
        self.checked(target, lambda ptr: self.b.store(value, ptr, align=4))

    def checked(self, ref: Ref, access):
        """``access(pointer)`` for ``ref``; in bounds-check mode only if the offset lies in the
        buffer (else the site is recorded and a load gives 0)."""
        idx = self.flat_index(ref)
        if not self.mb.check_bounds or self.proven(ref.offset(), ref.buffer):
            return access(self.pointer(ref, idx))
        b = self.b
        ok = b.icmp_unsigned("<", idx, ir.Constant(I64, ref.buffer.size))
        with b.if_else(ok) as (then, orelse):
            with then, self.region():
                value = access(self.pointer(ref, idx))
                then_block = b.block
            with orelse, self.region():
                self.record(ref.buffer, idx)
                else_block = b.block
        if not isinstance(value, ir.LoadInstr):
            return None
        phi = b.phi(value.type)
        phi.add_incoming(value, then_block)
        phi.add_incoming(ir.Constant(value.type, 0), else_block)
        return phi

    def proven(self, offset: Affine | None, buf: Buffer, span: int = 0) -> bool:
        """Whether every element from ``offset`` to ``offset + span`` lies inside ``buf``
        for every value of the enclosing loops' variables (a loop that runs no iteration
        proves nothing)."""
        if offset is None:
            return False
        ranges = [self.ranges.get(v) for v in offset.vars]
        if any(r is None or r[0] > r[1] for r in ranges):
            return False
        lo, hi = offset.bounds(self.ranges)
        return 0 <= lo and hi + span < buf.size

    def record(self, buf: Buffer, offset: ir.Value) -> None:
        """Remember an out-of-bounds access of ``buf`` at ``offset`` for the executor."""
        module = self.mb.module
        text = f"kernel {self.kernel.name}: buffer {buf.name} ({buf.size} elements)"
        self.b.store(self.mb.site(text), module.get_global(BOUNDS_SITE))
        self.b.store(offset, module.get_global(BOUNDS_OFFSET))

    def local(self, name: str) -> ir.Value:
        slot = self.locals.get(name)
        if slot is None:
            with self.b.goto_block(self.entry):
                self.b.position_at_start(self.entry)
                slot = self.locals[name] = self.b.alloca(F32, name=name)
                self.b.store(ir.Constant(F32, 0.0), slot)
        return slot

    def gemm(self, g: Gemm):
        if not self.mb.check_bounds:
            self.sgemm(g)
            return
        b, ok = self.b, ir.Constant(I1, 1)
        blocks = [(a.buffer, a.offset, a.span) for a in accesses(g) if a.index is None]
        blocks += [(buf, base, rows * (g.m - 1) + cols * (g.n - 1))
                   for buf, base, rows, cols in g.operands()]   # the epilogue's
        for buf, offset, span in blocks:   # each block: first and last element inside
            if self.proven(offset, buf, span):
                continue
            first = self.affine(offset)
            last = b.add(first, ir.Constant(I64, span))
            inside = b.and_(b.icmp_unsigned("<", first, ir.Constant(I64, buf.size)),
                            b.icmp_unsigned("<", last, ir.Constant(I64, buf.size)))
            with b.if_then(b.not_(inside)), self.region():
                self.record(buf, last)
            ok = b.and_(ok, inside)
        with b.if_then(ok), self.region():
            self.sgemm(g)

    def sgemm(self, g: Gemm):
        """The code for ``g``: over a packed B, the register-tiled product; else the BLAS
        call, a matrix-vector product where one of M and N is 1 (an FC layer at batch 1:
        OpenBLAS's sgemm runs it at a third of sgemv's speed), else sgemm."""
        ptr = lambda buf, off: self.b.gep(self.args[buf], [self.affine(off)], inbounds=True)  # noqa: E731
        if g.panel:
            ops = [ptr(buf, base) for buf, base, _, _ in g.operands()]
            self.b.call(self.mb.tiled_product(g), [ptr(g.a_buf, g.a_off), ptr(g.b_buf, g.b_off),
                                                   ptr(g.c_buf, g.c_off), *ops])
            return
        c = lambda x: ir.Constant(I32, int(x))  # noqa: E731
        alpha, beta = ir.Constant(F32, g.alpha), ir.Constant(F32, g.beta)
        if g.n == 1 or g.m == 1:
            fn = self.mb.declare(SGEMV, ir.VoidType(),
                                 [I32, I32, I32, I32, F32, PTR, I32, PTR, I32, F32, PTR, I32])
            if g.n == 1:    # c[:, 0] = op(A) @ op(B)[:, 0]; A is stored (k, m) when transposed
                trans, rows, cols, mat, ld = g.trans_a, g.m, g.k, (g.a_buf, g.a_off), g.lda
                vec, inc, inc_c = (g.b_buf, g.b_off), 1 if g.trans_b else g.ldb, g.ldc
            else:           # c[0, :] = op(B)^T @ op(A)[0, :]
                trans, rows, cols, mat, ld = not g.trans_b, g.n, g.k, (g.b_buf, g.b_off), g.ldb
                vec, inc, inc_c = (g.a_buf, g.a_off), g.lda if g.trans_a else 1, 1
            if trans:
                rows, cols = cols, rows
            self.b.call(fn, [c(101), c(112 if trans else 111), c(rows), c(cols), alpha, ptr(*mat),
                             c(ld), ptr(*vec), c(inc), beta, ptr(g.c_buf, g.c_off), c(inc_c)])
            return
        fn = self.mb.declare(SGEMM, ir.VoidType(),
                             [I32, I32, I32, I32, I32, I32, F32, PTR, I32, PTR, I32, F32, PTR, I32])
        self.b.call(fn, [c(101), c(112 if g.trans_a else 111), c(112 if g.trans_b else 111),
                         c(g.m), c(g.n), c(g.k), alpha,
                         ptr(g.a_buf, g.a_off), c(g.lda), ptr(g.b_buf, g.b_off), c(g.ldb),
                         beta, ptr(g.c_buf, g.c_off), c(g.ldc)])

    # ------------------------------------------------------------ expressions
    def affine(self, a: Affine) -> ir.Value:
        """``a``'s value: its variable part computed once in the innermost region that
        holds it and reused (a window's accesses differ in their constants alone), plus
        the constant."""
        if not a.terms:
            return ir.Constant(I64, a.const)
        key = tuple((id(self.loop_vars[var]), coef) for var, coef in a.terms)
        part = next((found[key] for found in reversed(self.offsets) if key in found), None)
        if part is None:
            for var, coef in a.terms:
                term = self.loop_vars[var]
                if coef != 1:
                    term = self.b.mul(term, ir.Constant(I64, coef), flags=("nsw",))
                part = term if part is None else self.b.add(part, term, flags=("nsw",))
            self.offsets[-1][key] = part
        return part if a.const == 0 else self.b.add(part, ir.Constant(I64, a.const), flags=("nsw",))

    def flat_index(self, ref: Ref) -> ir.Value:
        off = ref.offset()
        if off is not None:
            return self.affine(off)
        idx = ir.Constant(I64, 0)
        for e, extent in zip(ref.index, ref.view):
            idx = self.b.add(self.b.mul(idx, ir.Constant(I64, extent)),
                             self.to_int(self.expr(e), I64))
        return idx

    def pointer(self, ref: Ref, idx: ir.Value) -> ir.Value:
        ptr = self.b.gep(self.args[ref.buffer], [idx], inbounds=True)
        ty = _elem_type(ref.buffer)
        return ptr if ty is F32 else self.b.bitcast(ptr, ty.as_pointer())

    def to_float(self, v: ir.Value) -> ir.Value:
        if v.type == F32:
            return v
        if v.type == I1:
            return self.b.uitofp(v, F32)
        return self.b.sitofp(v, F32)

    def to_int(self, v: ir.Value, ty=I64) -> ir.Value:
        if v.type == ty:
            return v
        if isinstance(v.type, ir.IntType):
            return self.b.sext(v, ty) if v.type.width < ty.width else self.b.trunc(v, ty)
        return self.b.fptosi(v, ty)

    def cond(self, e: Expr) -> ir.Value:
        v = self.expr(e)
        if v.type == I1:
            return v
        if v.type == F32:
            return self.b.fcmp_ordered("!=", v, ir.Constant(F32, 0.0))
        return self.b.icmp_signed("!=", v, ir.Constant(v.type, 0))

    def arith(self, op: str, a: ir.Value, c: ir.Value) -> ir.Value:
        b = self.b
        if op in ("/",) or a.type == F32 or c.type == F32:
            a, c = self.to_float(a), self.to_float(c)
            if op == "+":
                return b.fadd(a, c, flags=FAST)
            if op == "-":
                return b.fsub(a, c, flags=FAST)
            if op == "*":
                return b.fmul(a, c, flags=FAST)
            if op == "/":
                return b.fdiv(a, c, flags=FAST)
            if op == "//":
                q = b.fdiv(a, c, flags=FAST)
                return b.call(self.intrinsic("llvm.floor.f32", 1), [q])
            if op == "%":
                return b.fsub(a, b.fmul(c, self.arith("//", a, c), flags=FAST), flags=FAST)
            if op in ("max", "min"):
                return b.select(b.fcmp_ordered(">" if op == "max" else "<", a, c), a, c)
        else:
            a, c = self.to_int(a), self.to_int(c)
            ops = {"+": b.add, "-": b.sub, "*": b.mul}
            if op in ops:
                return ops[op](a, c)
            if op in ("//", "%"):   # Python's: the quotient floors, the remainder has c's sign
                q, r = b.sdiv(a, c), b.srem(a, c)
                zero = ir.Constant(a.type, 0)
                off = b.and_(b.icmp_signed("!=", r, zero),
                             b.icmp_signed("!=", b.icmp_signed("<", r, zero), b.icmp_signed("<", c, zero)))
                if op == "//":
                    return b.sub(q, b.zext(off, a.type))
                return b.add(r, b.select(off, c, zero))
            if op in ("max", "min"):
                return b.select(b.icmp_signed(">" if op == "max" else "<", a, c), a, c)
        raise CompileError(f"codegen: unknown operator {op!r}")

    def intrinsic(self, name: str, nargs: int) -> ir.Function:
        return self.mb.declare(name, F32, [F32] * nargs)

    def expr(self, e: Expr) -> ir.Value:
        b = self.b
        if isinstance(e, Affine):
            return self.affine(e)
        if isinstance(e, Const):
            if isinstance(e.value, int):
                return ir.Constant(I64, e.value)
            return ir.Constant(F32, float(e.value))
        if isinstance(e, Var):
            if e.name in self.loop_vars:
                return self.loop_vars[e.name]
            return b.load(self.local(e.name))
        if isinstance(e, Load):
            if isinstance(e.ref, Var):
                return self.expr(e.ref)
            return self.checked(e.ref, lambda ptr: b.load(ptr, align=4))
        if isinstance(e, BinOp):
            return self.arith(e.op, self.expr(e.lhs), self.expr(e.rhs))
        if isinstance(e, UnaryOp):
            v = self.expr(e.operand)
            if e.op == "not":
                return b.not_(self.cond(e.operand))
            return b.fneg(v, flags=FAST) if v.type == F32 else b.neg(v)
        if isinstance(e, Compare):
            lhs, rhs = self.expr(e.lhs), self.expr(e.rhs)
            if lhs.type == F32 or rhs.type == F32:
                return b.fcmp_ordered(_FCMP[e.op], self.to_float(lhs), self.to_float(rhs))
            return b.icmp_signed(e.op, self.to_int(lhs), self.to_int(rhs))
        if isinstance(e, BoolOp):
            out = self.cond(e.values[0])
            for v in e.values[1:]:
                out = (b.and_ if e.op == "and" else b.or_)(out, self.cond(v))
            return out
        if isinstance(e, Call):
            args = [self.to_float(self.expr(a)) for a in e.args]
            if e.fn in ("exp", "tanh"):
                return b.call(mathfn.function(self.mb.module, e.fn), args)
            name = {"log": "llvm.log.f32", "sqrt": "llvm.sqrt.f32", "abs": "llvm.fabs.f32"}[e.fn]
            return b.call(self.intrinsic(name, 1), args, fastmath=FAST)
        if isinstance(e, Select):
            return self.select(e)
        raise CompileError(f"codegen: unexpected expression {type(e).__name__}")

    def select(self, e: Select) -> ir.Value:
        """Loads in an arm may be out of bounds (padding): branch rather than ``select``."""
        cond = self.cond(e.cond)
        if not any(isinstance(n, Load) for arm in (e.if_true, e.if_false) for n in walk(arm)):
            t, f = self.expr(e.if_true), self.expr(e.if_false)
            if t.type != f.type:
                t, f = self.to_float(t), self.to_float(f)
            return self.b.select(cond, t, f)
        b = self.b
        with b.if_else(cond) as (then, orelse):
            with then, self.region():
                t = self.to_float(self.expr(e.if_true))
                t_block = b.block
            with orelse, self.region():
                f = self.to_float(self.expr(e.if_false))
                f_block = b.block
        phi = b.phi(F32)
        phi.add_incoming(t, t_block)
        phi.add_incoming(f, f_block)
        return phi


def _uses_tid(loop: Loop) -> bool:
    """``loop`` reads the thread number (it indexes per-thread buffers)."""
    return any((isinstance(n, Var) and n.name == TID) or (isinstance(n, Affine) and TID in n.vars)
               for n in walk(loop))
