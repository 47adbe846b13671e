"""Synthesis: one neuron's kernel IR -> loop nests over ``(batch, *ensemble dims)``.

Paper sections 5.1-5.2. Neuron fields become SoA buffer refs: ``self.value`` is
``value[n, d...]``, a field is read through its (affine) ``index_map``, and
``self.inputs[k][i]`` reads the source buffer through the fitted access relation, so a
shared input (FC) is read in place, without a copy. A loop over a whole input vector is
delinearized into one loop per (merged) source dimension, which keeps every index affine.
A sink dimension a connection floor-divides by ``q`` (a grouped convolution's ``o // q``) is
strip-mined: its loop becomes ``for d_g in range(n/q): for d_i in range(q)`` with ``d = q*d_g
+ d_i`` and ``d // q = d_g``, so that quasi-affine accesses are affine in the loop variables.
"""

from __future__ import annotations

from dataclasses import dataclass

from latte.compiler.autodiff import derived_backward
from latte.compiler.buffers import BufferPlan
from latte.compiler.frontend import NeuronInfo, NeuronRef, parse_method
from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    Axis,
    BinOp,
    Block,
    BoolOp,
    Buffer,
    Compare,
    Const,
    Expr,
    If,
    Kernel,
    Load,
    Loop,
    NameGen,
    Ref,
    Select,
    Var,
    map_children,
    to_affine,
    walk,
)
from latte.compiler.mapping import ConnAccess, DimAccess, fit_index_map, sink_var
from latte.compiler.symbolic import quot_var
from latte.compiler.verify import verify_neuron
from latte.errors import CompileError
from latte.lang import ActivationEnsemble, FieldKind, defines_backward


def neuron_info(ens, accesses: list[ConnAccess]) -> NeuronInfo:
    return NeuronInfo(tuple(a.length for a in accesses),
                      {n: int(_prod(f.vector_shape)) for n, f in ens.fields.items()},
                      frozenset(f.name for f in ens.params))


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def merged_access(access: ConnAccess) -> tuple[tuple[int, ...], tuple[DimAccess, ...]]:
    """Merge source dims read whole and contiguously: FC over a (c, h, w) source reads one
    flat vector. Returns the merged source view (without batch) and the merged accesses."""
    extents = list(access.conn.source.shape)
    dims = list(access.dims)
    j = len(dims) - 1
    while j > 0:
        a, b = dims[j - 1], dims[j]
        if b.step == 1 and b.lo == Affine() and b.length == extents[j] and a.step == 1:
            dims[j - 1:j + 1] = [DimAccess(a.lo * extents[j], 1, a.length * extents[j])]
            extents[j - 1:j + 1] = [extents[j - 1] * extents[j]]
        j -= 1
    return tuple(extents), tuple(dims)


def _index(e: Expr) -> Expr:
    return to_affine(e) or e


def _bounds(lo: Affine, step: int, length: int, box: dict) -> tuple[int, int]:
    """Min and max of ``lo + step * t`` over the sink loops' ``box`` and ``0 <= t < length``
    (``lo`` in the loop variables: exact, the strip-mined halves of a dimension being
    independent where ``d`` and ``d // q`` are not)."""
    lo_min, lo_max = lo.bounds(box)
    span = step * (length - 1)
    return lo_min + min(0, span), lo_max + max(0, span)


@dataclass(frozen=True)
class _Delin:
    """A loop variable over a whole input vector, split into one variable per merged dim."""

    conn: int
    vars: tuple[str | None, ...]   # None where the merged dim has length 1


class _Synth:
    def __init__(self, ens, accesses: list[ConnAccess], bufs: BufferPlan, names: NameGen):
        self.ens, self.accesses, self.bufs, self.names = ens, accesses, bufs, names
        self.batch = bufs.batch_size
        self.n = names("_n")
        strips: dict[int, int] = {}
        for a in accesses:
            strips.update(a.quotients())   # analysis left one divisor per dimension
        # per ensemble dimension its loops: (var, extent, meta), outermost first
        self.loops: list[list[tuple[str, int, tuple]]] = []
        self.sink: dict[str, Affine] = {}
        for i, extent in enumerate(ens.shape):
            q = strips.get(i, 1)
            if q == 1:
                v = names(f"_d{i}")
                self.loops.append([(v, extent, ())])
                self.sink[sink_var(i)] = Affine.of(v)
                continue
            g, r = names(f"_d{i}g"), names(f"_d{i}i")
            self.loops.append([(g, extent // q, (("strip", q),)), (r, q, (("strip", q),))])
            self.sink[sink_var(i)] = Affine.build({g: q, r: 1})
            self.sink[quot_var(sink_var(i), q)] = Affine.of(g)
        self.own = tuple(self.sink[sink_var(i)] for i in range(len(ens.shape)))
        self.box = {v: (0, n - 1) for loops in self.loops for v, n, _ in loops}
        self.merged = [merged_access(a) if a.dims is not None else None for a in accesses]
        self.delin: dict[str, _Delin] = {}
        self.index_maps = {name: fit_index_map(ens, f) for name, f in ens.fields.items()}

    def sinkify(self, a: Affine) -> Affine:
        for v in list(a.vars):
            a = a.substitute(v, self.sink[v])
        return a

    # ------------------------------------------------------------ nests
    def neuron_nest(self, body: Block) -> Loop:
        """``for n in batch: for d0...: body`` (a strip-mined dimension has two loops)."""
        for i in reversed(range(len(self.loops))):
            for var, extent, meta in reversed(self.loops[i]):
                body = Block((Loop(var, 0, extent, body, axis=Axis(self.ens, i, self.ens.name),
                                   meta=meta),))
        return Loop(self.n, 0, self.batch, body, axis=Axis(self.ens, -1, self.ens.name))

    def body(self, block: Block) -> Block:
        return Block(tuple(self.stmt(s) for s in block.stmts))

    def stmt(self, s):
        if isinstance(s, Loop):
            return self.loop(s)
        if isinstance(s, If):
            return If(self.expr(s.cond), self.body(s.then), self.body(s.orelse), s.loc)
        if isinstance(s, (Assign, AugAssign)):
            value = self.expr(s.value)
            target, guard = self.target(s.target)
            out = (Assign(target, value, s.loc) if isinstance(s, Assign)
                   else AugAssign(target, s.op, value, s.loc))
            return If(guard, Block((out,)), loc=s.loc) if guard is not None else out
        raise CompileError(f"unexpected statement {type(s).__name__}")

    def loop(self, s: Loop):
        k = self._delinearizable(s)
        if k is None:
            return Loop(s.var, s.start, s.stop, self.body(s.body), loc=s.loc)
        dims = self.merged[k][1]
        tvars = tuple(self.names(f"{s.var}_{g}") if a.length > 1 else None
                      for g, a in enumerate(dims))
        self.delin[s.var] = _Delin(k, tvars)
        inner = self.body(s.body)
        del self.delin[s.var]
        for g in reversed(range(len(dims))):
            if tvars[g] is not None:
                inner = Block((Loop(tvars[g], 0, dims[g].length, inner, meta=(("conn", k),),
                                    loc=s.loc),))
        return inner.stmts[0] if len(inner.stmts) == 1 else inner

    def _delinearizable(self, s: Loop) -> int | None:
        """The connection whose input vector ``s`` walks whole: every indexing use is ``x[i]``
        (other uses read ``i`` as a number)."""
        whole, other = [], False
        for node in walk(s.body):
            if isinstance(node, NeuronRef):
                if node.index == (Var(s.var),):
                    whole.append(node)
                    continue
                other |= any(Var(s.var) in walk(e) for e in node.index)
        conns = {r.conn for r in whole if r.kind in ("input", "grad_input")}
        if other or len(conns) != 1 or s.start != 0:
            return None
        k = conns.pop()
        if self.merged[k] is None or s.stop != self.accesses[k].length:
            return None
        for r in whole:
            if r.kind in ("field", "grad_field") and _prod(self.ens.fields[r.name].vector_shape) != s.stop:
                return None
        return k

    # ------------------------------------------------------------ refs
    def target(self, t) -> tuple[Ref | Var, Expr | None]:
        if isinstance(t, Var):
            return t, None
        return self.ref(t)

    def expr(self, e: Expr) -> Expr:
        """Top-down: neuron refs become buffer loads; a delinearized loop variable used as a
        value becomes its flat position again (an affine form of the per-dim variables)."""
        if isinstance(e, NeuronRef):
            ref, guard = self.ref(e)
            if guard is None:
                return Load(ref)
            pad = self.accesses[e.conn].conn.padding
            return Select(guard, Load(ref), Const(float(pad)))
        if isinstance(e, Var) and e.name in self.delin:
            dl = self.delin[e.name]
            flat = Affine()
            for a, v in zip(self.merged[dl.conn][1], dl.vars):
                flat = flat * a.length + (Affine.of(v) if v else Affine())
            return flat
        if isinstance(e, (Affine, Buffer)):
            return e
        return map_children(e, self.expr)

    def ref(self, r: NeuronRef) -> tuple[Ref, Expr | None]:
        own = (Affine.of(self.n), *self.own)
        view = (self.batch, *self.ens.shape)
        if r.kind == "value":
            return Ref(self.bufs.value(self.ens), own, view), None
        if r.kind == "grad":
            return Ref(self.bufs.grad(self.ens), own, view), None
        if r.kind in ("input", "grad_input"):
            return self.input_ref(r)
        return self.field_ref(r), None

    def field_ref(self, r: NeuronRef) -> Ref:
        f = self.ens.fields[r.name]
        lead = tuple(self.sinkify(a) for a in self.index_maps[r.name])
        lead_shape = f.array.shape[:f.lead_ndim]
        if r.kind == "grad_field":
            buf = self.bufs.field_grad(self.ens, r.name)
        else:
            buf = self.bufs.field(self.ens, r.name)
        if len(r.index) == 1 and isinstance(r.index[0], Var) and r.index[0].name in self.delin:
            dl = self.delin[r.index[0].name]
            dims = self.merged[dl.conn][1]
            vec_view = tuple(a.length for a, v in zip(dims, dl.vars) if v is not None)
            vec_index = tuple(Affine.of(v) for v in dl.vars if v is not None)
        elif len(r.index) == 1:
            vec_view = (_prod(f.vector_shape),)
            vec_index = (_index(self.expr(r.index[0])),)
        elif len(r.index) == len(f.vector_shape):
            vec_view = f.vector_shape
            vec_index = tuple(_index(self.expr(i)) for i in r.index)
        else:
            raise CompileError(f"ensemble {self.ens.name!r}: field {r.name!r} indexed with "
                               f"{len(r.index)} indices; its vector has shape {f.vector_shape}")
        if f.spec.kind is FieldKind.BATCH and r.kind == "field":
            return Ref(buf, (Affine.of(self.n), *lead, *vec_index),
                       (self.batch, *lead_shape, *vec_view))
        return Ref(buf, (*lead, *vec_index), (*lead_shape, *vec_view))

    def input_ref(self, r: NeuronRef) -> tuple[Ref, Expr | None]:
        access = self.accesses[r.conn]
        buf = self.bufs.input(access.conn, r.kind)
        (i_expr,) = r.index
        if access.dims is None:
            return self._gather_ref(access, buf, self.expr(i_expr))
        src_view, dims = self.merged[r.conn]
        if isinstance(i_expr, Var) and i_expr.name in self.delin:
            tvars = self.delin[i_expr.name].vars
            ts = [Affine.of(v) if v else Affine() for v in tvars]
        else:  # a flat index: recover per-dim positions with div/mod
            flat, ts = _index(self.expr(i_expr)), []
            for g in reversed(range(len(dims))):
                n = dims[g].length
                if isinstance(flat, Affine) and not flat.terms:   # a constant: fold it
                    ts.insert(0, Affine((), flat.const % n))
                    flat = Affine((), flat.const // n)
                else:
                    ts.insert(0, BinOp("%", flat, Const(n)))
                    flat = BinOp("//", flat, Const(n))
        index, conds = [], []
        for g, (a, t) in enumerate(zip(dims, ts)):
            lo = self.sinkify(a.lo)
            pos = lo + t * a.step if isinstance(t, Affine) else BinOp("+", lo, BinOp("*", t, Const(a.step)))
            index.append(pos)
            lo_b, hi_b = _bounds(lo, a.step, a.length, self.box)
            if lo_b < 0:
                conds.append(Compare(">=", pos, Const(0)))
            if hi_b >= src_view[g]:
                conds.append(Compare("<", pos, Const(src_view[g])))
        ref = Ref(buf, (Affine.of(self.n), *index), (self.batch, *src_view))
        guard = None if not conds else conds[0] if len(conds) == 1 else BoolOp("and", tuple(conds))
        return ref, guard

    def _gather_ref(self, access: ConnAccess, buf, i: Expr) -> tuple[Ref, Expr | None]:
        table = self.bufs.table(access.conn, access.table.shape)
        sink_flat = Affine()
        for pos, extent in zip(self.own, self.ens.shape):
            sink_flat = sink_flat * extent + pos
        offset = Load(Ref(table, (sink_flat, _index(i)), table.shape))
        ref = Ref(buf, (Affine.of(self.n), offset), (self.batch, access.conn.source.size))
        # with padding the table may hold -1 (its analysis said where): guard every load,
        # so that the verifier proves the access from the table's construction alone
        guard = None if access.conn.padding is None else Compare(">=", offset, Const(0))
        return ref, guard


def synthesize(ens, phase: str, accesses: list[ConnAccess], bufs: BufferPlan) -> Kernel:
    """The loop nest that runs ``ens``'s neuron ``phase`` (forward/backward) for a batch."""
    names = NameGen()
    info = neuron_info(ens, accesses)
    neuron_body = neuron_ir(ens, phase, info)
    for node in walk(neuron_body):
        if isinstance(node, Var):
            names.used.add(node.name)
        elif isinstance(node, Loop):
            names.used.add(node.var)
    verify_neuron(neuron_body, lambda r: _extents(ens, info, r), ens.name, phase)
    synth = _Synth(ens, accesses, bufs, names)
    body = synth.body(neuron_body)
    stmts = []
    if phase == "forward" and not isinstance(ens, ActivationEnsemble):
        stmts.append(zero_loop(bufs.value(ens), names("_z")))
    if body.stmts:
        stmts.append(synth.neuron_nest(body))
    return Kernel(f"{ens.name}.{phase}", Block(tuple(stmts)), ens, phase)


def neuron_ir(ens, phase: str, info: NeuronInfo) -> Block:
    """The neuron-level IR of ``ens``'s ``phase``: its method's, or a derived backward."""
    if phase == "backward" and not defines_backward(ens.neuron_type):
        return derived_backward(ens, info)
    return parse_method(ens.neuron_type, phase, info)


def _extents(ens, info: NeuronInfo, r: NeuronRef) -> tuple[int, ...]:
    """The extent of each of ``r``'s indices: the input vector's length, a field vector's
    length (one index) or its shape (one index per dimension)."""
    if r.kind in ("input", "grad_input"):
        return (info.input_lengths[r.conn],)
    if len(r.index) == 1:
        return (info.field_lengths[r.name],)
    shape = ens.fields[r.name].vector_shape
    if len(r.index) != len(shape):
        raise CompileError(f"ensemble {ens.name!r}: field {r.name!r} indexed with "
                           f"{len(r.index)} indices; its vector has shape {shape}")
    return tuple(shape)


def zero_loop(buf, var: str) -> Loop:
    """``buf[:] = 0`` as one flat loop."""
    return Loop(var, 0, buf.size, Block((Assign(Ref(buf, (Affine.of(var),), (buf.size,)),
                                                Const(0.0)),)))
