"""Solver update kernels: a solver's per-element rule -> one compiled loop per parameter,
plus the reductions the runtime needs around an update (the gradients' global L2 norm for
clipping, a finite check of the parameters).

A rule is a Python function over :class:`Value` s (symbolic floats), traced once:
``rule(param, grad, state, k) -> {"param": ..., "<state>": ...}`` where ``grad`` is the
gradient as the rule sees it (``grad * clip + l2 * param``: clipped, then the L2 term),
``state`` holds the parameter's state buffers (Adam's ``exp_avg``...) and ``k`` the
per-step scalars, one row per parameter, that the runtime writes before each update
(:data:`COLUMNS` first: ``lr`` is ``lr * lr_mult``, ``l2`` ``regu_coef * decay_mult``).
Every new value is computed from the old ones before any is stored.

Update code has a buffer table of its own (:class:`UpdateCode`): the parameters' value
and gradient buffers of the net's program, the state buffers, and the scalars; it is
compiled the first time a net meets a solver, through the same disk cache as the net.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from latte.compiler.fingerprint import fingerprint
from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    Buffer,
    Call,
    Const,
    Expr,
    Kernel,
    Load,
    Loop,
    Ref,
    UnaryOp,
    Var,
    accesses,
    rewrite,
)
from latte.compiler.jit import CodeLibrary, target
from latte.compiler.passes.parallel import MIN_FLAT, parallel
from latte.compiler.pipeline import llvm_ir
from latte.compiler.program import Segment
from latte.compiler.synthesis import zero_loop
from latte.compiler.verify import verify_kernel

COLUMNS = ("lr", "mom", "l2", "clip")   # every rule's first scalars (``mom``: momentum)
CHUNK = 256                             # elements per partial sum of a reduction


class Value:
    """A float of the per-element update: arithmetic on it builds IR."""

    __slots__ = ("expr",)
    __hash__ = None

    def __init__(self, expr: Expr):
        self.expr = expr

    def _op(self, op: str, other, swap: bool = False) -> Value:
        other = other.expr if isinstance(other, Value) else Const(float(other))
        return Value(BinOp(op, other, self.expr) if swap else BinOp(op, self.expr, other))

    def __add__(self, o): return self._op("+", o)
    def __radd__(self, o): return self._op("+", o, True)
    def __sub__(self, o): return self._op("-", o)
    def __rsub__(self, o): return self._op("-", o, True)
    def __mul__(self, o): return self._op("*", o)
    def __rmul__(self, o): return self._op("*", o, True)
    def __truediv__(self, o): return self._op("/", o)
    def __rtruediv__(self, o): return self._op("/", o, True)
    def __neg__(self): return Value(UnaryOp("neg", self.expr))


def sqrt(x: Value) -> Value:
    """The square root of a :class:`Value` (in a rule)."""
    return Value(Call("sqrt", (x.expr,)))


@dataclass(frozen=True)
class UpdateRule:
    """A solver's update: ``fn(param, grad, state, k)`` (see the module docstring) over the
    state buffers ``state`` and the per-step scalars ``COLUMNS + scalars``. ``name`` names
    the kernels (``sgd`` -> ``sgd_update``, the profile's row)."""

    name: str
    state: tuple[str, ...]
    scalars: tuple[str, ...]
    fn: Callable[..., dict[str, Value]]

    def __post_init__(self):
        taken = {"value", "state", "param", "grad"} & set(self.state)   # snapshot keys, inputs
        if taken:
            raise ValueError(f"update rule {self.name!r}: state names {sorted(taken)} are taken")

    @property
    def columns(self) -> tuple[str, ...]:
        return COLUMNS + self.scalars

    def trace(self) -> tuple[tuple[str, Expr], ...]:
        """The new values, as IR over ``Var("param")``, ``Var("grad")``, ``Var("s_<state>")``
        and ``Var("k_<scalar>")``."""
        state = SimpleNamespace(**{s: Value(Var(f"s_{s}")) for s in self.state})
        k = SimpleNamespace(**{c: Value(Var(f"k_{c}")) for c in self.columns})
        out = self.fn(Value(Var("param")), Value(Var("grad")), state, k)
        unknown = set(out) - {"param", *self.state}
        if unknown:
            raise ValueError(f"update rule {self.name!r} assigns {sorted(unknown)}: only "
                             f"'param' and its state {list(self.state)} can be updated")
        return tuple((name, out[name].expr) for name in ("param", *self.state) if name in out)


@dataclass(frozen=True)
class ParamBuffers:
    """One parameter as update code sees it."""

    name: str
    value: Buffer
    grad: Buffer


@dataclass
class UpdateCode:
    """Native segments over their own buffer table: ``buffers`` in slot order."""

    segments: list[Segment]
    buffers: list[Buffer]
    library: CodeLibrary


def state_buffer(p: ParamBuffers, state: str) -> Buffer:
    return Buffer(("update", p.name, state), f"{p.name}.{state}", p.value.shape)


def scalars_buffer(n_params: int, n_columns: int) -> Buffer:
    return Buffer(("update", "scalars"), "update.scalars", (max(1, n_params), n_columns))


def update_code(rule: UpdateRule, params: list[ParamBuffers], threads: int, opt_level: int,
                split: bool) -> UpdateCode:
    """The compiled update of ``rule`` for ``params``: one segment (one per parameter when
    ``split``, so each can wait for its own gradient's reduction over ranks)."""
    traced = rule.trace()
    scal = scalars_buffer(len(params), len(rule.columns))
    kernels = [_update_kernel(rule, traced, p, i, scal, threads) for i, p in enumerate(params)]
    segments = ([Segment(f"update{i}", (k,)) for i, k in enumerate(kernels)] if split
                else [Segment("update", tuple(kernels))])
    return jit(segments, threads, opt_level)


def _update_kernel(rule: UpdateRule, traced, p: ParamBuffers, row: int, scal: Buffer,
                   threads: int) -> Kernel:
    var = "_u"
    i = Affine.of(var)
    ref = lambda buf: Ref(buf, (i,), (buf.size,))  # noqa: E731
    targets = {"param": ref(p.value), **{s: ref(state_buffer(p, s)) for s in rule.state}}
    scalar = {f"k_{c}": Load(Ref(scal, (Affine((), row * scal.shape[1] + j),), (scal.size,)))
              for j, c in enumerate(rule.columns)}
    names = {"param": Var("_p"), "grad": Var("_g"), **scalar,
             **{f"s_{s}": Load(targets[s]) for s in rule.state}}
    # the gradient the rule sees: clipped, then the L2 term
    body = [Assign(Var("_p"), Load(targets["param"])),
            Assign(Var("_g"), BinOp("+", BinOp("*", Load(ref(p.grad)), scalar["k_clip"]),
                                    BinOp("*", scalar["k_l2"], Var("_p"))))]
    bind = lambda n: names[n.name] if isinstance(n, Var) else None  # noqa: E731
    body += [Assign(Var(f"_new_{name}"), rewrite(e, bind)) for name, e in traced]
    body += [Assign(targets[name], Var(f"_new_{name}")) for name, _ in traced]
    loop = Loop(var, 0, p.value.size, Block(tuple(body)))
    if threads > 1 and loop.extent >= MIN_FLAT:   # each iteration updates its own element
        loop = parallel(loop, 1)
    return Kernel(f"{rule.name}_update", Block((loop,)), None, "update")


def reduction_code(params: list[ParamBuffers], threads: int, opt_level: int) -> UpdateCode:
    """Two segments of partial sums, ``CHUNK`` elements each, parameter after parameter:
    ``grad_norm`` sums the gradients' squares into ``partial_sums(params)`` (the runtime
    adds them in float64 for the clipping norm), ``finite_check`` sums ``value * 0`` into
    another such buffer (0 for a finite parameter, NaN else)."""
    norm = _partial_sums("grad_norm", [p.grad for p in params], lambda x: BinOp("*", x, x),
                         threads)
    check = _partial_sums("finite_check", [p.value for p in params],
                          lambda x: BinOp("*", x, Const(0.0)), threads)
    return jit([Segment("grad_norm", (norm,)), Segment("finite_check", (check,))],
               threads, opt_level)


def partial_sum_offsets(sizes: list[int]) -> list[int]:
    """Where each buffer's partial sums start (and, last, how many there are in all)."""
    out = [0]
    for n in sizes:
        out.append(out[-1] + -(-n // CHUNK))
    return out


def _partial_sums(name: str, bufs: list[Buffer], fn: Callable[[Expr], Expr],
                  threads: int) -> Kernel:
    offsets = partial_sum_offsets([b.size for b in bufs])
    parts = Buffer(("update", name), f"{name}.partial", (max(1, offsets[-1]),))
    stmts = [zero_loop(parts, "_z")]
    for b, base, var in zip(bufs, offsets, (f"_r{i}" for i in range(len(bufs)))):
        full, tail = divmod(b.size, CHUNK)

        def add(slot: Affine, idx: Affine, b: Buffer = b) -> AugAssign:
            return AugAssign(Ref(parts, (slot,), (parts.size,)), "+",
                             fn(Load(Ref(b, (idx,), (b.size,)))))

        if full:
            c, j = Affine.of(var), Affine.of(f"{var}j")
            inner = Loop(f"{var}j", 0, CHUNK, Block((add(c + base, c * CHUNK + j),)))
            loop = Loop(var, 0, full, Block((inner,)))
            # each chunk adds into its own partial sum: chunks may run on any thread
            stmts.append(parallel(loop, 1) if threads > 1 and b.size >= MIN_FLAT else loop)
        if tail:
            t = Affine.of(f"{var}t")
            stmts.append(Loop(f"{var}t", full * CHUNK, b.size,
                              Block((add(Affine((), base + full), t),))))
    return Kernel(name, Block(tuple(stmts)), None, "update")


def jit(segments: list[Segment], threads: int, opt_level: int) -> UpdateCode:
    """Verify and compile ``segments`` over a table of the buffers they use (in order of
    first use), through the disk cache; opt level 0 compiles at LLVM O1 like the net."""
    index: dict[Buffer, int] = {}
    for seg in segments:
        for kernel in seg.kernels:
            verify_kernel(kernel)
            for a in accesses(kernel.body):
                index.setdefault(a.buffer, len(index))
    library = target().library(fingerprint(segments, index, threads),
                               lambda parts: llvm_ir(segments, index, threads, parts),
                               speed=1 if opt_level == 0 else 3)
    return UpdateCode(segments, list(index), library)
