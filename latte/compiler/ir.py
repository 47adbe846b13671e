"""The loop IR used from synthesis to codegen: one module of frozen dataclasses.

Index expressions are :class:`Affine` wherever possible: isl, the GEMM matcher and tiling
read their coefficients. Buffers are objects keyed by ``(owner, field)``; their names are
only for printing.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


class Node:
    """Base of every IR node."""

    def __getstate__(self) -> dict:
        """The fields, without what a node remembers of itself (``_children``, ``_offset``,
        a kernel's ``_shape``, what :func:`remembered` keeps: remade when asked for), for a
        stored program."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class Expr(Node):
    """Base of expressions."""


class Stmt(Node):
    """Base of statements."""


TID = "_tid"   # the thread number inside a parallel loop (0 outside): indexes per-thread buffers
# a GEMM epilogue's row and column of the product's block, and its element of C
EPI_ROW, EPI_COL, EPI_C = "epi.i", "epi.j", "epi.c"


# ---------------------------------------------------------------- buffers

@dataclass(frozen=True, eq=False)
class Buffer:
    """A contiguous array. ``key`` identifies it (``(owner, field)``); ``name`` is for display."""

    key: tuple
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"      # "float32" or "int32"
    batched: bool = False       # leading dim is the batch

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __repr__(self) -> str:
        return f"Buffer({self.name}, {self.shape})"


# ---------------------------------------------------------------- expressions

@dataclass(frozen=True)
class Affine(Expr):
    """``const + sum(coef * var)`` over integer loop variables."""

    terms: tuple[tuple[str, int], ...] = ()
    const: int = 0

    @staticmethod
    def of(var: str | None = None, coef: int = 1, const: int = 0) -> Affine:
        return Affine(((var, coef),) if var and coef else (), const)

    @staticmethod
    def build(coeffs: dict[str, int], const: int = 0) -> Affine:
        return Affine(tuple(sorted((v, c) for v, c in coeffs.items() if c)), int(const))

    @property
    def coeffs(self) -> dict[str, int]:
        return dict(self.terms)

    def coef(self, var: str) -> int:
        return self.coeffs.get(var, 0)

    @property
    def vars(self) -> frozenset[str]:
        return frozenset(v for v, _ in self.terms)

    def __add__(self, other: Affine | int) -> Affine:
        if isinstance(other, int):
            return Affine(self.terms, self.const + other)
        c = self.coeffs
        for v, k in other.terms:
            c[v] = c.get(v, 0) + k
        return Affine.build(c, self.const + other.const)

    def __sub__(self, other: Affine | int) -> Affine:
        return self + (other * -1)

    def __mul__(self, k: int) -> Affine:
        return Affine.build({v: c * k for v, c in self.terms}, self.const * k)

    def bounds(self, ranges: dict[str, tuple[int, int]]) -> tuple[int, int]:
        """The least and greatest value when each variable runs over ``ranges[var] =
        (first, last)``."""
        lo = hi = self.const
        for v, c in self.terms:
            ends = (c * ranges[v][0], c * ranges[v][1])
            lo, hi = lo + min(ends), hi + max(ends)
        return lo, hi

    def substitute(self, var: str, repl: Affine) -> Affine:
        c = self.coeffs
        k = c.pop(var, 0)
        return Affine.build(c, self.const) + repl * k if k else self


@dataclass(frozen=True)
class Const(Expr):
    value: float | int


@dataclass(frozen=True)
class Var(Expr):
    """A loop variable (int) or a local scalar (float)."""

    name: str


@dataclass(frozen=True)
class Ref(Node):
    """``buffer[index]`` where ``index`` addresses ``view``, a row-major reshape of the buffer."""

    buffer: Buffer
    index: tuple[Expr, ...]
    view: tuple[int, ...]

    def offset(self) -> Affine | None:
        """The flat element offset, if every index entry is affine (remembered: the ref
        never changes)."""
        if "_offset" not in self.__dict__:
            off = Affine()
            for idx, extent in zip(self.index, self.view):
                if not isinstance(idx, Affine):
                    off = None
                    break
                off = off * extent + idx
            object.__setattr__(self, "_offset", off)
        return self.__dict__["_offset"]


@dataclass(frozen=True)
class Load(Expr):
    ref: Ref


@dataclass(frozen=True)
class BinOp(Expr):
    op: str          # + - * / // % max min
    lhs: Expr
    rhs: Expr


@dataclass(frozen=True)
class UnaryOp(Expr):
    op: str          # neg not
    operand: Expr


@dataclass(frozen=True)
class Compare(Expr):
    op: str          # < <= > >= == !=
    lhs: Expr
    rhs: Expr


@dataclass(frozen=True)
class BoolOp(Expr):
    op: str          # and or
    values: tuple[Expr, ...]


@dataclass(frozen=True)
class Call(Expr):
    fn: str          # exp log tanh sqrt abs
    args: tuple[Expr, ...]


@dataclass(frozen=True)
class Select(Expr):
    cond: Expr
    if_true: Expr
    if_false: Expr


def to_affine(e: Expr) -> Affine | None:
    """``e`` as an affine form over integer loop variables, if it is one."""
    if isinstance(e, Affine):
        return e
    if isinstance(e, Const) and isinstance(e.value, int):
        return Affine((), e.value)
    if isinstance(e, Var):
        return Affine.of(e.name)
    if isinstance(e, BinOp) and e.op in "+-*":
        a, b = to_affine(e.lhs), to_affine(e.rhs)
        if a is None or b is None:
            return None
        if e.op == "+":
            return a + b
        if e.op == "-":
            return a - b
        if not a.terms:
            return b * a.const
        if not b.terms:
            return a * b.const
    return None


# ---------------------------------------------------------------- statements

@dataclass(frozen=True)
class Loc:
    """Where a statement comes from: its neuron's source file and line (errors name it)."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Block(Stmt):
    stmts: tuple[Stmt, ...] = ()


@dataclass(frozen=True)
class Assign(Stmt):
    target: Ref | Var
    value: Expr
    loc: Loc | None = field(default=None, compare=False)


@dataclass(frozen=True)
class AugAssign(Stmt):
    target: Ref | Var
    op: str          # + - * /
    value: Expr
    loc: Loc | None = field(default=None, compare=False)


@dataclass(frozen=True)
class If(Stmt):
    cond: Expr
    then: Block
    orelse: Block = Block()
    loc: Loc | None = field(default=None, compare=False)


class LoopKind(enum.Enum):
    SERIAL = "serial"
    PARALLEL = "parallel"
    TILE_OUTER = "tile_outer"
    TILE_INNER = "tile_inner"


@dataclass(frozen=True)
class Axis:
    """What a loop iterates: ``dim`` of ``ensemble`` (``dim == -1``: the batch)."""

    ensemble: Any = field(compare=False)
    dim: int
    ensemble_name: str = ""

    def __str__(self) -> str:
        return f"{self.ensemble_name}.{'batch' if self.dim < 0 else self.dim}"


@dataclass(frozen=True)
class Loop(Stmt):
    var: str
    start: int
    stop: int
    body: Block
    kind: LoopKind = LoopKind.SERIAL
    axis: Axis | None = None
    meta: tuple = ()   # (key, value) pairs for later passes, e.g. dependence distance
    loc: Loc | None = field(default=None, compare=False)

    @property
    def extent(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Gemm(Stmt):
    """``C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C`` on row-major slices.

    ``a``, ``b``, ``c`` are element offsets (affine in enclosing loop variables) into the
    buffers; ``ld*`` are leading dimensions as in CBLAS. ``panel`` = ``(rows, cols, lanes)``
    when B is packed in panels (:mod:`latte.compiler.passes.pack`): ``op(B)`` stored from
    ``b_off`` as ``[ceil(n / cols)][k][cols]``, the last panel zero-padded (``ldb`` is
    ``cols``, ``trans_b`` False), and the product computed ``rows x cols`` at a time in
    vectors of ``lanes`` floats (:mod:`latte.compiler.microkernel`) instead of by BLAS.
    With ``packed`` False the tiled product reads B in place (rows ``ldb`` apart), or, with
    ``trans_b``, computes ``rows x cols`` dot products along ``k`` at a time; a ``k_block``
    runs B in place ``k_block`` rows at a time (0: all of ``k`` at once). A tiled product
    with an ``epilogue`` runs it on each element of its block as it stores it: the nest
    ``for EPI_ROW in range(m): for EPI_COL in range(n): ...`` of element-wise assignments
    (a bias, a batch norm, a residual add, a ReLU) in which ``Var(EPI_C)`` is the element
    of C, ``alpha * product + beta * C``, and whatever it holds last is stored to C
    (:mod:`latte.compiler.passes.epilogue`); with ``c_stored`` False, C's values are not
    stored once the epilogue has run (a test forward's intermediate that nothing reads);
    with ``stream`` (the alignment of their addresses), its full vectors past the caches
    (:mod:`latte.compiler.passes.stream`).
    """

    m: int
    n: int
    k: int
    a_buf: Buffer
    a_off: Affine
    lda: int
    trans_a: bool
    b_buf: Buffer
    b_off: Affine
    ldb: int
    trans_b: bool
    c_buf: Buffer
    c_off: Affine
    ldc: int
    alpha: float = 1.0
    beta: float = 1.0
    panel: tuple[int, int, int] = ()
    packed: bool = True
    epilogue: Block | None = None
    c_stored: bool = True
    k_block: int = 0
    stream: int = 0

    @property
    def b_rows(self) -> int:
        """Rows of B's block as stored (``ldb`` apart)."""
        if self.panel and self.packed:
            return -(-self.n // self.panel[1]) * self.k
        return self.n if self.trans_b else self.k

    def epilogue_body(self) -> tuple:
        """The statements the epilogue runs on each element (none without one)."""
        if self.epilogue is None:
            return ()
        (rows,) = self.epilogue.stmts
        (cols,) = rows.body.stmts
        return cols.body.stmts

    def operands(self) -> tuple[tuple[Buffer, Affine, int, int], ...]:
        """The buffers the epilogue reads and writes, each ``(buffer, offset of its element
        for the block's (0, 0), step per row, step per column)``, once each, in order."""
        return remembered(self, "_operands", lambda: tuple(dict.fromkeys(
            operand(n) for s in self.epilogue_body() for n in walk(s) if isinstance(n, Ref))))


def operand(ref: Ref) -> tuple[Buffer, Affine, int, int]:
    """A ref of a GEMM epilogue as the operand it reads or writes (:meth:`Gemm.operands`)."""
    off = ref.offset()
    return (ref.buffer, Affine.build({v: c for v, c in off.terms if v not in (EPI_ROW, EPI_COL)},
                                     off.const), off.coef(EPI_ROW), off.coef(EPI_COL))


@dataclass(frozen=True)
class Kernel(Node):
    """One ensemble's code for one phase (forward, backward, ...)."""

    name: str
    body: Block
    ensemble: Any = field(compare=False, default=None)
    phase: str = ""


# ---------------------------------------------------------------- traversal

@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def children(node: Node) -> tuple[Node, ...]:
    """Direct child nodes, in field order (remembered by the node: nodes never change)."""
    kids = node.__dict__.get("_children")
    if kids is None:
        kids = []
        for name in _field_names(type(node)):
            val = getattr(node, name)
            if isinstance(val, Node):
                kids.append(val)
            elif isinstance(val, tuple):
                kids.extend(v for v in val if isinstance(v, Node))
        kids = tuple(kids)
        object.__setattr__(node, "_children", kids)
    return kids


def walk(node: Node) -> Iterator[Node]:
    """Every node below ``node`` (pre-order), ``node`` included. Iterative: nested
    generators would pass each node up through every level of the tree."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(children(n)))


def map_children(node: Node, fn: Callable[[Node], Node]) -> Node:
    """``node`` with ``fn`` applied to each direct child (the same object if none changed)."""
    changes = {}
    for name in _field_names(type(node)):
        val = getattr(node, name)
        if isinstance(val, Node):
            new = fn(val)
        elif isinstance(val, tuple) and any(isinstance(v, Node) for v in val):
            new = tuple(fn(v) if isinstance(v, Node) else v for v in val)
            if all(a is b for a, b in zip(new, val)):
                continue
        else:
            continue
        if new is not val:
            changes[name] = new
    return dataclasses.replace(node, **changes) if changes else node


def rewrite(node: Node, fn: Callable[[Node], Node | None]) -> Node:
    """Bottom-up rewrite: children first, then ``fn(node)`` (``None`` keeps the node)."""
    if not isinstance(node, Affine):
        node = map_children(node, lambda c: rewrite(c, fn))
    out = fn(node)
    return node if out is None else out


def statements(node: Node) -> list[Node]:
    """``node`` and every statement below it, pre-order: loops, blocks and branches are
    entered, expressions are not (they hold no statements)."""
    if isinstance(node, Block):
        return [node, *(x for s in node.stmts for x in statements(s))]
    if isinstance(node, Loop):
        return [node, *statements(node.body)]
    if isinstance(node, If):
        return [node, *statements(node.then), *statements(node.orelse)]
    return [node]


def rewrite_statements(node: Node, fn: Callable[[Node], Node | None]) -> Node:
    """:func:`rewrite` over statements alone (see :func:`statements`): children first, then
    ``fn(node)`` (``None`` keeps the node); expressions are left as they are."""
    if isinstance(node, (Block, Loop, If)):
        node = map_children(node, lambda c: rewrite_statements(c, fn))
    out = fn(node)
    return node if out is None else out


def substitute(node: Node, mapping: dict[str, Affine]) -> Node:
    """``node`` with free loop variables replaced by affine forms, without capture: a loop
    that rebinds a replaced variable shadows it, and a loop whose variable occurs in a
    replacement is renamed first."""
    if not mapping:
        return node
    if isinstance(node, Loop):
        inner = {v: a for v, a in mapping.items() if v != node.var}
        if any(node.var in a.vars for a in inner.values()):
            taken = {node.var, *inner, *(v for a in inner.values() for v in a.vars)}
            taken |= {n.var for n in walk(node.body) if isinstance(n, Loop)}
            fresh = next(f"{node.var}_{k}" for k in range(1, len(taken) + 2)
                         if f"{node.var}_{k}" not in taken)
            body = substitute(node.body, {node.var: Affine.of(fresh)})
            node = dataclasses.replace(node, var=fresh, body=body)
        return map_children(node, lambda c: substitute(c, inner))
    if isinstance(node, Affine):   # simultaneous: {x: y, y: x} swaps
        if not node.vars & mapping.keys():
            return node
        out = Affine.build({v: c for v, c in node.terms if v not in mapping}, node.const)
        for v, c in node.terms:
            if v in mapping:
                out = out + mapping[v] * c
        return out
    if isinstance(node, Var) and node.name in mapping:
        return mapping[node.name]
    return map_children(node, lambda c: substitute(c, mapping))


@dataclass(frozen=True)
class Access:
    """One memory access below a node: a ref, or one operand block of a GEMM."""

    buffer: Buffer
    offset: Affine | None                   # flat element offset (None: not affine)
    written: bool
    index: tuple | None = None              # a ref's index (None for a GEMM operand)
    block: tuple[tuple[int, int], ...] = ()  # a GEMM operand's (stride, extent) of rows, cols
    view: tuple[int, ...] = ()              # a ref's view
    loops: tuple[tuple[str, int, int], ...] = ()   # (var, start, stop) of the loops around it

    @property
    def span(self) -> int:
        """Elements between the first and last of a GEMM block (0 for a ref)."""
        return sum(stride * (extent - 1) for stride, extent in self.block)

    def ranges(self) -> dict[str, tuple[int, int]]:
        """The first and last value of each loop variable around the access."""
        return {v: (start, stop - 1) for v, start, stop in self.loops}


def accesses(node: Node) -> list[Access]:
    """Every buffer access below ``node`` (``node`` included), each once, in execution
    order of the tree: refs and GEMM operand blocks, each with the loops around it. A
    statement's target is one written access (a ``+=`` also reads it); identity is
    positional, so value-equal refs in the target and the value are reported apart. The
    node remembers its list (nodes never change)."""
    def visit() -> tuple[Access, ...]:
        out: list[Access] = []
        _visit_accesses(node, (), out)
        return tuple(out)
    return list(remembered(node, "_accesses", visit))


def _ref_access(r: Ref, written: bool, loops: tuple, out: list[Access]) -> None:
    out.append(Access(r.buffer, r.offset(), written, r.index, view=r.view, loops=loops))
    for idx in r.index:
        _visit_accesses(idx, loops, out)


def _visit_accesses(n: Node, loops: tuple, out: list[Access]) -> None:
    """:func:`accesses` below ``n`` into ``out`` (module functions: nested ones that call
    each other would make every list cyclic garbage)."""
    if isinstance(n, Loop):
        loops = (*loops, (n.var, n.start, n.stop))
    if isinstance(n, (Assign, AugAssign)) and isinstance(n.target, Ref):
        _visit_accesses(n.value, loops, out)
        _ref_access(n.target, True, loops, out)
        return
    if isinstance(n, Ref):
        _ref_access(n, False, loops, out)
        return
    if isinstance(n, Gemm):
        a_rows, a_cols = (n.k, n.m) if n.trans_a else (n.m, n.k)
        b_cols = n.ldb if n.panel and n.packed else n.k if n.trans_b else n.n
        out.extend((
            Access(n.a_buf, n.a_off, False, block=((n.lda, a_rows), (1, a_cols)), loops=loops),
            Access(n.b_buf, n.b_off, False, block=((n.ldb, n.b_rows), (1, b_cols)),
                   loops=loops),
            Access(n.c_buf, n.c_off, True, block=((n.ldc, n.m), (1, n.n)), loops=loops)))
    for c in children(n):
        _visit_accesses(c, loops, out)


def touched(node: Node) -> frozenset[Buffer]:
    """The buffers of :func:`accesses` below ``node``, without building the accesses (each
    node remembers its set: nodes never change, and most outlive the pass that asked)."""
    def find() -> frozenset[Buffer]:
        if isinstance(node, Gemm):
            return frozenset(a.buffer for a in accesses(node))
        found = frozenset().union(*map(touched, children(node)))
        return found | {node.buffer} if isinstance(node, Ref) else found
    return remembered(node, "_touched", find)


def remembered(owner, name: str, compute: Callable):
    """``compute()``, kept on ``owner`` (a frozen dataclass: it never changes) as ``name``
    and found there the next time. Pickled nodes leave such attributes out."""
    found = owner.__dict__.get(name)
    if found is None:
        found = compute()
        object.__setattr__(owner, name, found)
    return found


def refs(node: Node) -> Iterator[Ref]:
    return (n for n in walk(node) if isinstance(n, Ref))


def written_refs(node: Node) -> Iterator[Ref]:
    """Refs that statements below ``node`` store to."""
    for n in walk(node):
        if isinstance(n, (Assign, AugAssign)) and isinstance(n.target, Ref):
            yield n.target


class NameGen:
    """Fresh variable names: ``_n``, ``_d0``, ``_i0_1``..."""

    def __init__(self):
        self.used: set[str] = set()

    def __call__(self, base: str) -> str:
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name
