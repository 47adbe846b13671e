"""Loop-IR passes on hand-built IR: loop distribution and GEMM matching, checked by an
interpreter that runs the IR before and after on numpy arrays."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from helpers import WeightedSumLoss, fill

from latte import Batch, Ensemble, Net, Neuron, Param, add_connections
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
    Gemm,
    If,
    Kernel,
    Load,
    Loop,
    LoopKind,
    Ref,
    Select,
    Var,
    walk,
)
from latte.compiler.passes import distribute_loops, match_gemm
from latte.compiler.passes.coalesce import coalesce_loops
from latte.compiler.passes.fuse import merge_pointwise
from latte.compiler.passes.guards import split_guards
from latte.compiler.passes.localize import _gemm_row, keep_in_locals
from latte.compiler.passes.time_hoist import hoist_param_grads
from latte.stdlib import (
    AddLayer,
    BatchNormLayer,
    ConvolutionLayer,
    MaxPoolingLayer,
    MemoryDataLayer,
    ReLULayer,
)

# ---------------------------------------------------------------- a tiny IR interpreter


def _affine(a: Affine, env) -> int:
    return a.const + sum(c * env[v] for v, c in a.terms)


def _offset(ref: Ref, env) -> int:
    off = ref.offset()
    assert off is not None
    return _affine(off, env)


def _expr(e, mem, env):
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Affine):
        return _affine(e, env)
    if isinstance(e, Load):
        return mem[e.ref.buffer][_offset(e.ref, env)]
    if isinstance(e, BinOp):
        a, b = _expr(e.lhs, mem, env), _expr(e.rhs, mem, env)
        return {"+": a + b, "-": a - b, "*": a * b}[e.op]
    if isinstance(e, Compare):
        a, b = _expr(e.lhs, mem, env), _expr(e.rhs, mem, env)
        return {"<": a < b, ">=": a >= b, ">": a > b, "==": a == b}[e.op]
    if isinstance(e, BoolOp):
        return all(_expr(v, mem, env) for v in e.values)
    if isinstance(e, Select):   # the branch not taken is not evaluated (it may lie outside)
        return _expr(e.if_true if _expr(e.cond, mem, env) else e.if_false, mem, env)
    raise NotImplementedError(type(e).__name__)


def _gemm(g: Gemm, mem, env) -> None:
    """CBLAS row-major sgemm semantics on flat arrays; fancy indexing checks the bounds."""
    i, p = np.arange(g.m)[:, None], np.arange(g.k)[None, :]
    a = mem[g.a_buf][_affine(g.a_off, env) + (p * g.lda + i if g.trans_a else i * g.lda + p)]
    p, j = np.arange(g.k)[:, None], np.arange(g.n)[None, :]
    b = mem[g.b_buf][_affine(g.b_off, env) + (j * g.ldb + p if g.trans_b else p * g.ldb + j)]
    c = _affine(g.c_off, env) + np.arange(g.m)[:, None] * g.ldc + np.arange(g.n)[None, :]
    assert len(np.unique(c)) == c.size  # C entries do not overlap
    mem[g.c_buf][c] = g.alpha * (a @ b) + g.beta * mem[g.c_buf][c]


def run(node, mem, env=None) -> None:
    """Execute ``node`` on ``mem`` (buffer -> flat float64 array)."""
    env = {} if env is None else env
    if isinstance(node, Kernel):
        run(node.body, mem, env)
    elif isinstance(node, Block):
        for s in node.stmts:
            run(s, mem, env)
    elif isinstance(node, Loop):
        for v in range(node.start, node.stop):
            env[node.var] = v
            run(node.body, mem, env)
        env.pop(node.var, None)
    elif isinstance(node, Gemm):
        _gemm(node, mem, env)
    elif isinstance(node, If):
        run(node.then if _expr(node.cond, mem, env) else node.orelse, mem, env)
    elif isinstance(node, (Assign, AugAssign)):
        value = _expr(node.value, mem, env)
        if isinstance(node, AugAssign):
            value = _expr(BinOp(node.op, Load(node.target) if isinstance(node.target, Ref)
                                else node.target, Const(value)), mem, env)
        if isinstance(node.target, Var):
            env[node.target.name] = value
        else:
            mem[node.target.buffer][_offset(node.target, env)] = value
    else:
        raise NotImplementedError(type(node).__name__)


def _buf(name: str, *shape: int) -> Buffer:
    return Buffer((name,), name, shape)


def _ref(buf: Buffer, *vars_: str | Affine) -> Ref:
    return Ref(buf, tuple(Affine.of(v) if isinstance(v, str) else v for v in vars_), buf.shape)


def _nest(order, extents: dict[str, int], stmt) -> Kernel:
    body = Block((stmt,))
    for v in reversed(order):
        body = Block((Loop(v, 0, extents[v], body),))
    return Kernel("test", body)


def _random_memory(kernel: Kernel, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    bufs = {r.buffer for r in walk(kernel) if isinstance(r, Ref)}
    return {b: rng.standard_normal(b.size) for b in sorted(bufs, key=lambda b: b.name)}


def _same_result(before: Kernel, after: Kernel) -> None:
    mem = _random_memory(before)
    out = {b: a.copy() for b, a in mem.items()}
    run(before, mem)
    run(after, out)
    for b in mem:
        np.testing.assert_allclose(out[b], mem[b], rtol=1e-12, atol=1e-12, err_msg=b.name)


def _gemms(kernel: Kernel) -> list[Gemm]:
    return [n for n in walk(kernel) if isinstance(n, Gemm)]


# ---------------------------------------------------------------- GEMM matching

M, N, K = 8, 12, 24   # 2*M*N*K is above the matcher's size threshold
EXTENTS = {"i": M, "j": N, "k": K}


def _matmul(order, trans_a=False, trans_b=False, trans_c=False) -> Kernel:
    """``C[i, j] += A[i, k] * B[k, j]`` with each operand stored plain or transposed."""
    a = _ref(_buf("A", K, M), "k", "i") if trans_a else _ref(_buf("A", M, K), "i", "k")
    b = _ref(_buf("B", N, K), "j", "k") if trans_b else _ref(_buf("B", K, N), "k", "j")
    c = _ref(_buf("C", N, M), "j", "i") if trans_c else _ref(_buf("C", M, N), "i", "j")
    return _nest(order, EXTENTS, AugAssign(c, "+", BinOp("*", Load(a), Load(b))))


def _numpy_matmul(kernel: Kernel, trans_a, trans_b, trans_c) -> tuple[dict, dict]:
    mem = _random_memory(kernel)
    by_name = {b.name: b for b in mem}
    a = mem[by_name["A"]].reshape(K, M).T if trans_a else mem[by_name["A"]].reshape(M, K)
    b = mem[by_name["B"]].reshape(N, K).T if trans_b else mem[by_name["B"]].reshape(K, N)
    c = mem[by_name["C"]].reshape(N, M).T if trans_c else mem[by_name["C"]].reshape(M, N)
    expected = c + a @ b
    return mem, (expected.T if trans_c else expected).reshape(-1)


@pytest.mark.parametrize("order", ["".join(p) for p in itertools.permutations("ijk")])
def test_matmul_matches_in_every_loop_order(order):
    kernel = match_gemm(_matmul(order))
    assert kernel.body.stmts and all(isinstance(s, Gemm) for s in kernel.body.stmts)
    (g,) = kernel.body.stmts
    assert (g.m, g.n, g.k) == (M, N, K)
    assert (g.trans_a, g.trans_b) == (False, False)
    assert (g.lda, g.ldb, g.ldc) == (K, N, N)
    assert (g.a_buf.name, g.b_buf.name, g.c_buf.name) == ("A", "B", "C")
    assert g.a_off == g.b_off == g.c_off == Affine()
    assert (g.alpha, g.beta) == (1.0, 1.0)


@pytest.mark.parametrize("order", ["ijk", "kji", "jki"])
@pytest.mark.parametrize("trans", list(itertools.product([False, True], repeat=3)),
                         ids=lambda t: "".join("T" if x else "N" for x in t))
def test_transposed_layouts_compute_the_product(order, trans):
    kernel = _matmul(order, *trans)
    matched = match_gemm(kernel)
    (g,) = _gemms(matched)
    assert g.m * g.n * g.k == M * N * K
    mem, expected = _numpy_matmul(kernel, *trans)
    run(matched, mem)
    c = next(b for b in mem if b.name == "C")
    np.testing.assert_allclose(mem[c], expected, rtol=1e-12)


def test_transposed_a_operand():
    (g,) = _gemms(match_gemm(_matmul("ijk", trans_a=True)))
    assert (g.m, g.n, g.k, g.trans_a, g.trans_b, g.lda, g.ldb, g.ldc) == (M, N, K, True, False,
                                                                          M, N, N)


def test_transposed_c_swaps_operands():
    (g,) = _gemms(match_gemm(_matmul("ijk", trans_c=True)))
    # C^T[j, i] = sum_k B^T[j, k] A^T[k, i]
    assert (g.m, g.n, g.k) == (N, M, K)
    assert (g.a_buf.name, g.b_buf.name, g.ldc) == ("B", "A", M)


def test_batch_dims_fold_into_m_or_stay_outside():
    n_batch = 3
    x, w = _buf("x", n_batch, M, K), _buf("w", N, K)
    y = _buf("y", n_batch, M, N)
    extents = {"b": n_batch, **EXTENTS}
    # FC: the batch walks x and y contiguously with i, so it folds into m
    fc = _nest("bijk", extents, AugAssign(_ref(y, "b", "i", "j"), "+",
                                          BinOp("*", Load(_ref(x, "b", "i", "k")),
                                                Load(_ref(w, "j", "k")))))
    matched = match_gemm(fc)
    (g,) = matched.body.stmts
    assert isinstance(g, Gemm) and (g.m, g.n, g.k, g.trans_b) == (n_batch * M, N, K, True)
    _same_result(fc, matched)
    # a per-item B: one GEMM per batch item, under the batch loop
    wb = _buf("wb", n_batch, K, N)
    bmm = _nest("bijk", extents, AugAssign(_ref(y, "b", "i", "j"), "+",
                                           BinOp("*", Load(_ref(x, "b", "i", "k")),
                                                 Load(_ref(wb, "b", "k", "j")))))
    matched = match_gemm(bmm)
    (outer,) = matched.body.stmts
    assert isinstance(outer, Loop) and outer.var == "b"
    (g,) = outer.body.stmts
    assert isinstance(g, Gemm) and (g.m, g.n, g.k) == (M, N, K)
    assert g.c_off == Affine.of("b", M * N) and g.b_off == Affine.of("b", K * N)
    _same_result(bmm, matched)


def test_elementwise_nest_does_not_match():
    a, b, c = _buf("A", M, N), _buf("B", M, N), _buf("C", M, N)
    kernel = _nest("ij", EXTENTS, AugAssign(_ref(c, "i", "j"), "+",
                                            BinOp("*", Load(_ref(a, "i", "j")),
                                                  Load(_ref(b, "i", "j")))))
    assert match_gemm(kernel) == kernel


def test_non_gemm_shapes_are_left_alone():
    (acc,) = [n for n in walk(_matmul("ijk")) if isinstance(n, AugAssign)]
    assign = _nest("ijk", EXTENTS, Assign(acc.target, acc.value))
    assert match_gemm(assign) == assign                # '=' is not an accumulation
    small = {"i": 2, "j": 3, "k": 4}
    tiny = _nest("ijk", small, AugAssign(_ref(_buf("C", 2, 3), "i", "j"), "+",
                                         BinOp("*", Load(_ref(_buf("A", 2, 4), "i", "k")),
                                               Load(_ref(_buf("B", 4, 3), "k", "j")))))
    assert match_gemm(tiny) == tiny                    # below the size threshold
    (loop,) = _matmul("ijk").body.stmts
    shifted = Kernel("t", Block((Loop("i", 1, M, loop.body),)))
    assert match_gemm(shifted) == shifted              # loops must start at 0


# ---------------------------------------------------------------- loop distribution

def test_distribution_splits_a_neuron_body_for_gemm():
    n_batch, n_out, n_in = 8, 16, 32
    x, w = _buf("x", n_batch, n_in), _buf("w", n_out, n_in)
    bias, y = _buf("bias", n_out, 1), _buf("y", n_batch, n_out)
    dot = Loop("i", 0, n_in, Block((AugAssign(_ref(y, "n", "d"), "+",
                                              BinOp("*", Load(_ref(w, "d", "i")),
                                                    Load(_ref(x, "n", "i")))),)))
    add_bias = AugAssign(_ref(y, "n", "d"), "+", Load(_ref(bias, "d", Affine())))
    kernel = Kernel("fc", Block((Loop("n", 0, n_batch, Block((
        Loop("d", 0, n_out, Block((dot, add_bias))),))),)))
    assert not _gemms(match_gemm(kernel))  # the bias statement hides the pattern
    dist = distribute_loops(kernel)
    assert len(dist.body.stmts) == 2 and all(isinstance(s, Loop) for s in dist.body.stmts)
    _same_result(kernel, dist)
    matched = match_gemm(dist)
    assert isinstance(matched.body.stmts[0], Gemm) and isinstance(matched.body.stmts[1], Loop)
    _same_result(kernel, matched)


def test_distribution_keeps_statements_linked_by_a_local():
    x, y, z = _buf("x", 4), _buf("y", 4), _buf("z", 4)
    t = Var("t")
    body = Block((Assign(t, BinOp("*", Load(_ref(x, "n")), Const(2.0))),
                  AugAssign(_ref(y, "n"), "+", t),
                  AugAssign(_ref(z, "n"), "+", Load(_ref(x, "n")))))
    kernel = Kernel("k", Block((Loop("n", 0, 4, body),)))
    dist = distribute_loops(kernel)
    assert [len(s.body.stmts) for s in dist.body.stmts] == [2, 1]
    _same_result(kernel, dist)


def test_distribution_refuses_a_carried_dependence():
    x, y, z = _buf("x", 5), _buf("y", 6), _buf("z", 5)
    body = Block((Assign(_ref(y, "n"), Load(_ref(x, "n"))),
                  Assign(_ref(z, "n"), Load(_ref(y, Affine.of("n", 1, 1))))))  # reads y[n+1]
    kernel = Kernel("k", Block((Loop("n", 0, 5, body),)))
    assert distribute_loops(kernel) == kernel


# ---------------------------------------------------------------- line buffers
def test_line_buffers_take_gemm_offsets_apart_only_when_rows_are_unambiguous():
    """A GEMM operand's flat offset into (batch, channels, rows, cols) = (2, 4, 8, 5): rows
    move with the tile variable, by whole rows or (one tile per image) whole planes; an
    offset that could be a channel (a constant plane, a channel loop) is refused."""
    buf = Buffer(("t", "value"), "t.value", (2, 4, 8, 5), batched=True)
    item, plane, row = 160, 40, 5

    def off(terms, const=0):
        return Affine.build({"n": item, **terms}, const)
    assert _gemm_row(off({"t": 2 * row}, -row), "n", "t", buf) == Affine.build({"t": 2}, -1)
    assert _gemm_row(off({"t": plane}), "n", "t", buf) == Affine.build({"t": 8})
    assert _gemm_row(off({}, plane), "n", "t", buf) is None          # channel 1, or row 8?
    assert _gemm_row(off({"c": plane}), "n", "t", buf) is None       # a channel loop
    assert _gemm_row(off({"t": 3}), "n", "t", buf) is None           # not whole rows
    assert _gemm_row(Affine.build({"n": 1}), "n", "t", buf) is None  # not per batch item


def _stored_then_read(*later) -> tuple[Kernel, Buffer]:
    """``for i: for j: t[i, j] = 2 x[i, j]; y[i, j] = t[i, j] + z[i, j]`` and ``later``."""
    t, x, y, z = (_buf(n, 3, 4) for n in "txyz")
    stmts = (Assign(_ref(t, "i", "j"), BinOp("*", Const(2.0), Load(_ref(x, "i", "j")))),
             Assign(_ref(y, "i", "j"), BinOp("+", Load(_ref(t, "i", "j")), Load(_ref(z, "i", "j")))),
             *(s(t, y) for s in later))
    return Kernel("k", Block((Loop("i", 0, 3, Block((Loop("j", 0, 4, Block(stmts)),))),))), t


def test_an_intermediate_read_back_at_once_is_kept_in_a_local():
    """A store whose element only the next straight-line statements read (a batch norm's
    output before the add) becomes a local; every other reader keeps the buffer."""
    again = lambda t, y: AugAssign(_ref(y, "i", "j"), "*", Load(_ref(t, "i", "j")))  # noqa: E731
    for later in [(), (again,)]:
        kernel, t = _stored_then_read(*later)
        kept = keep_in_locals(kernel, {t})
        assert t not in {r.buffer for r in walk(kept) if isinstance(r, Ref)}
        assert Var("_lv0") in list(walk(kept))
        mem = _random_memory(kernel)
        out = {b: a.copy() for b, a in mem.items()}
        run(kernel, mem)
        run(kept, out)
        for b in mem:
            if b is not t:
                np.testing.assert_array_equal(out[b], mem[b], err_msg=b.name)
    kernel, t = _stored_then_read()
    assert keep_in_locals(kernel, set()) is kernel                        # not a candidate
    for later in [
        lambda t, y: Assign(_ref(y, "i", "j"), Load(_ref(t, "i", Affine.of("j", -1, 3)))),  # another element
        lambda t, y: AugAssign(_ref(t, "i", "j"), "+", Const(1.0)),     # stored again
        lambda t, y: Loop("k", 0, 2, Block((                             # read in a loop
            AugAssign(_ref(y, "i", "j"), "+", Load(_ref(t, "i", "j"))),))),
    ]:
        kernel, t = _stored_then_read(later)
        assert keep_in_locals(kernel, {t}) is kernel
    kernel, t = _stored_then_read()   # read in another nest too
    other = Loop("i", 0, 3, Block((Assign(_ref(t, "i", Affine()), Const(0.0)),)))
    kernel = Kernel("k", Block((*kernel.body.stmts, other)))
    assert keep_in_locals(kernel, {t}) is kernel


def test_substitute_avoids_name_capture():
    from latte.compiler.ir import Affine, Assign, Block, Buffer, Loop, Ref, Var, substitute
    buf = Buffer(("t", "b"), "b", (64,))
    # for j: b[i + j] = j, with i := j + 1: the loop's j must not capture the new j
    body = Loop("j", 0, 4, Block((Assign(Ref(buf, (Affine.build({"i": 1, "j": 1}),), (64,)), Var("j")),)))
    out = substitute(body, {"i": Affine.of("j", 1, 1)})
    inner = out.body.stmts[0]
    assert out.var != "j"
    assert inner.target.index[0] == Affine.build({"j": 1, out.var: 1}, 1)
    assert inner.value == Affine.of(out.var)
    # a loop that rebinds a replaced variable shadows it
    shadow = substitute(Loop("i", 0, 2, Block((Assign(Ref(buf, (Affine.of("i"),), (64,)), Var("i")),))),
                        {"i": Affine.of("k")})
    assert shadow.body.stmts[0].target.index[0] == Affine.of("i")
    # simultaneous: a swap is a swap
    assert substitute(Affine.build({"x": 1, "y": 2}), {"x": Affine.of("y"), "y": Affine.of("x")}) \
        == Affine.build({"y": 1, "x": 2})


class _PartialSums(Neuron):
    """``s`` sums the running partial sums of the inputs: the second statement reads the
    value the first one is still accumulating, at the same index in every iteration."""

    s: Batch

    def forward(self):
        for i in range(len(self.inputs[0])):
            self.value += self.inputs[0][i]
            self.s += self.value
        self.value = self.s

    def backward(self):
        for i in range(len(self.inputs[0])):
            self.grad_inputs[0][i] += self.grad * (len(self.inputs[0]) - i)


@pytest.mark.parametrize("opt_level", (0, 1, 3))
def test_distribution_keeps_statements_that_share_an_element_across_iterations(opt_level):
    net = Net(2, opt_level=opt_level, num_threads=1, seed=1)
    x = MemoryDataLayer(net, "x", (4,))
    e = Ensemble(net, "e", _PartialSums, (3,), s=np.zeros((3, 1), np.float32))
    add_connections(net, x, e, lambda o: (range(4),))
    net.init()
    xv = fill(net, x, np.random.default_rng(0))
    net.forward()
    want = np.cumsum(xv, axis=1).sum(axis=1)
    np.testing.assert_allclose(net.value(e), np.repeat(want[:, None], 3, axis=1), rtol=1e-5)


# ---------------------------------------------------------------- time_hoist

def _step_nest(op: str, value_of) -> tuple[Loop, dict, Buffer]:
    """A time loop's batch nest ``grad_w[i] <op>= value_of(x[t-1][n, i], g[t][n, i])``
    over a step of 2 items (3 steps), and its views."""
    rows, steps = 2, 3
    x = Buffer(("x", "value"), "x.value", (rows * steps, 4), batched=True)
    g = Buffer(("e", "grad"), "e.grad", (rows * steps, 4), batched=True)
    xv = Buffer(("step", x, -1), "x.value[t-1]", (rows, 4), batched=True)
    gv = Buffer(("step", g, 0), "e.grad[t]", (rows, 4), batched=True)
    w = Buffer(("e", "grad_w"), "e.grad_w", (4,))
    index = (Affine.of("n"), Affine.of("i"))
    value = value_of(Load(Ref(xv, index, (rows, 4))), Load(Ref(gv, index, (rows, 4))))
    body = Block((AugAssign(Ref(w, (Affine.of("i"),), (4,)), op, value),))
    nest = Loop("n", 0, rows, Block((Loop("i", 0, 4, body),)), axis=Axis(None, -1))
    return nest, {xv: (x, -1), gv: (g, 0)}, w


def test_time_hoist_moves_sums_that_vanish_at_step_0_over_all_steps():
    nest, views, w = _step_nest("+", lambda x, g: BinOp("*", x, g))
    kept, hoisted = hoist_param_grads(Kernel("e.backward", Block((nest,))), frozenset({w}),
                                      frozenset({_base(views, "e.grad")}), views, 3)
    assert not kept.body.stmts
    (loop,) = hoisted.body.stmts
    assert (loop.start, loop.stop) == (0, 4)   # steps 1..2, x at rows 0..3, g at rows 2..5
    rows = {r.buffer.name: r.index[0] for r in walk(loop) if isinstance(r, Ref)}
    assert rows == {"x.value": Affine.of("n"), "e.grad": Affine.of("n", 1, 2),
                    "e.grad_w": Affine.of("i")}


@pytest.mark.parametrize("op, value_of", [
    ("+", lambda x, g: BinOp("+", x, g)),   # x[t-1] no factor: step 0 would add g
    ("*", lambda x, g: g),                   # a product over steps is no sum
], ids=["not-a-factor", "not-a-sum"])
def test_time_hoist_keeps_what_it_cannot_prove(op, value_of):
    nest, views, w = _step_nest(op, value_of)
    kept, hoisted = hoist_param_grads(Kernel("e.backward", Block((nest,))), frozenset({w}),
                                      frozenset({_base(views, "e.grad")}), views, 3)
    assert kept.body.stmts == (nest,) and not hoisted.body.stmts


def _base(views: dict, name: str) -> Buffer:
    return next(base for base, _ in views.values() if base.name == name)


def _over_cx(stmt) -> Loop:
    return _nest(["c", "x"], {"c": 4, "x": 8}, stmt).body.stmts[0]


_X, _Y, _Z, _S = _buf("x", 4, 8), _buf("y", 4, 8), _buf("z", 4, 8), _buf("s", 4)
_DOUBLE = _over_cx(Assign(_ref(_Y, "c", "x"), BinOp("*", Const(2.0), Load(_ref(_X, "c", "x")))))


@pytest.mark.parametrize("first,second,merges", [
    # y = 2 x, then z = y + x at the same element: one nest
    (_DOUBLE, _over_cx(Assign(_ref(_Z, "c", "x"),
                              BinOp("+", Load(_ref(_Y, "c", "x")), Load(_ref(_X, "c", "x"))))), True),
    # y = 2 x, then y = y * y in place: one nest
    (_DOUBLE, _over_cx(Assign(_ref(_Y, "c", "x"),
                              BinOp("*", Load(_ref(_Y, "c", "x")), Load(_ref(_Y, "c", "x"))))), True),
    # a row sum s[c] += x, then x = x * s[c]: iterations share s[c], refused
    (_over_cx(AugAssign(_ref(_S, "c"), "+", Load(_ref(_X, "c", "x")))),
     _over_cx(Assign(_ref(_X, "c", "x"), BinOp("*", Load(_ref(_X, "c", "x")), Load(_ref(_S, "c"))))),
     False),
    # y = 2 x, then x = y's row reversed: refused
    (_DOUBLE, _over_cx(Assign(_ref(_X, "c", "x"), Load(_ref(_Y, "c", Affine.build({"x": -1}, 7))))),
     False),
], ids=["add", "in-place", "reduction", "reversed"])
def test_pointwise_nests_merge_only_where_each_iteration_owns_its_elements(first, second, merges):
    merged = merge_pointwise((first, second))
    assert len(merged) == (1 if merges else 2)
    _same_result(Kernel("test", Block((first, second))), Kernel("test", Block(merged)))


def test_pointwise_nests_merge_inside_the_arm_of_an_if():
    """A skewed group runs its members under tests on the tile: nests in one arm merge."""
    add = _over_cx(Assign(_ref(_Z, "c", "x"),
                          BinOp("+", Load(_ref(_Y, "c", "x")), Load(_ref(_X, "c", "x")))))
    guarded = If(Compare("<", Affine.of("t"), Const(3)), Block((_DOUBLE, add)))
    (merged,) = merge_pointwise((guarded,))
    assert len(merged.then.stmts) == 1
    for t in (0, 5):   # the arm runs, and it does not
        before, after = (Kernel("test", Block((Loop("t", t, t + 1, Block((s,))),)))
                         for s in (guarded, merged))
        _same_result(before, after)


# ---------------------------------------------------------------- unswitching


class GatedNeuron(Neuron):
    """Adds ``w[k] * x[k]`` for the ``k`` below the item's gate (the same for every neuron),
    then a term chosen by the gate and passed through a local to the next statement."""

    w: Param

    def forward(self):
        g = self.inputs[1][0]
        for k in range(len(self.w)):
            if g > k:
                t = self.w[k] * self.inputs[0][k]
                self.value += t
        if g > 2.5:
            s = self.inputs[0][0] * 2.0
        else:
            s = self.inputs[0][1]
        self.value += s


def _gated(level: int, threads: int) -> Net:
    net = Net(4, opt_level=level, num_threads=threads, seed=1)
    x = MemoryDataLayer(net, "x", (6,))
    gate = MemoryDataLayer(net, "gate", (1,))
    ens = Ensemble(net, "gated", GatedNeuron, (5,), w=np.arange(30, dtype=np.float32).reshape(5, 6) / 7)
    add_connections(net, x, ens, lambda i: (range(6),))
    add_connections(net, gate, ens, lambda i: (0,))
    WeightedSumLoss(net, "loss", ens)
    net.init()
    net.value("x")[...] = np.random.default_rng(0).standard_normal((4, 6))
    net.value("gate")[:, 0] = [0.0, 2.0, 3.0, 6.0]
    net.forward()
    net.backward()
    return net


def _under_test(kernel: Kernel) -> bool:
    """Does a neuron loop of ``kernel`` run inside an ``if``?"""
    return any(isinstance(n, If) and any(isinstance(lp, Loop) and lp.axis is not None
                                         and lp.axis.dim >= 0 for lp in walk(n.then))
               for n in walk(kernel.body))


@pytest.mark.parametrize("level,threads", [(1, 1), (2, 2), (3, 2)])
def test_unswitching_runs_an_items_tests_once_and_computes_the_same(level, threads):
    base, opt = _gated(0, 1), _gated(level, threads)
    plan = next(p for p in opt.program.plans if p.ensemble.name == "gated")
    assert _under_test(plan.kernels["forward"]) and _under_test(plan.kernels["backward"])
    np.testing.assert_allclose(opt.value("gated"), base.value("gated"), rtol=1e-6)
    np.testing.assert_allclose(opt.grad("x"), base.grad("x"), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(opt.params[0].grad, base.params[0].grad, rtol=1e-6, atol=1e-6)


def test_unswitching_leaves_index_guards_to_the_window_passes():
    """A padded convolution's guards test loop indices alone: its loops keep their order."""
    net = Net(1, opt_level=1)
    x = MemoryDataLayer(net, "x", (2, 5, 5))
    ConvolutionLayer("conv", net, x, 3, 3, 1, 1)
    net.init()
    plan = next(p for p in net.program.plans if p.ensemble.name == "conv")
    assert not any(_under_test(k) for k in plan.kernels.values())


# ---------------------------------------------------------------- index-set splitting

def _padded_window(size: int = 6, window: int = 3, outer: str = "y", inner: str = "i",
                   axis: bool = True) -> Kernel:
    """``out[y] = sum_i x[y + i - 1]`` with ``x`` padded by zeros on both sides."""
    x, out = _buf("x", size), _buf("out", size)
    at = Affine.of(outer) + Affine.of(inner) - 1
    guard = BoolOp("and", (Compare(">=", at, Const(0)), Compare("<", at, Const(size))))
    read = Select(guard, Load(Ref(x, (at,), x.shape)), Const(0.0))
    body = Block((Loop(inner, 0, window, Block((AugAssign(_ref(out, outer), "+", read),))),))
    ax = Axis(None, 0, "out") if axis else None
    return Kernel("window", Block((Loop(outer, 0, size, body, axis=ax),)))


def _selects(node) -> int:
    return sum(isinstance(n, Select) for n in walk(node))


def test_a_padded_window_loop_splits_into_edges_and_a_test_free_interior():
    before = _padded_window()
    after = split_guards(before)
    loops = after.body.stmts
    assert [(lp.start, lp.stop) for lp in loops] == [(0, 1), (1, 5), (5, 6)]
    assert _selects(loops[1]) == 0 and _selects(loops[0]) == _selects(loops[2]) == 1
    _same_result(before, after)


def test_splitting_leaves_window_loops_and_rebound_variables_whole():
    window = _padded_window(axis=False)   # a neuron's own loop (no ensemble dimension)
    assert split_guards(window) == window
    shadowed = _padded_window(inner="y")   # the inner loop rebinds the outer variable
    assert split_guards(shadowed) == shadowed


def test_splitting_keeps_a_test_that_holds_nowhere_whole_on_the_loop():
    """A window wider than the input: no index has every read inside, so nothing splits."""
    before = _padded_window(size=3, window=5)
    after = split_guards(before)
    assert after == before
    _same_result(before, after)


def _tiled_window(per_row: bool = False) -> Kernel:
    """A skewed fused group's stride-2 window read through padding, in tiles of 2 output
    rows: ``out[2t + r] = sum_i x[4t + 2r + i - 5]`` over ``t`` (the tile loop) and ``r``
    (the first two tiles read padding in every row). With ``per_row`` the test sits in an
    ``if`` around the window's loop (a gather's test per row)."""
    size, tiles = 12, 4
    x, out = _buf("x", size), _buf("out", 2 * tiles)
    at = Affine.of("t", 4) + Affine.of("r", 2) + Affine.of("i") - 5
    guard = BoolOp("and", (Compare(">=", at, Const(0)), Compare("<", at, Const(size))))
    row = _ref(out, Affine.of("t", 2) + Affine.of("r"))
    if per_row:
        read = Load(Ref(x, (at,), x.shape))
        window = If(guard, Block((Loop("i", 0, 3, Block((AugAssign(row, "+", read),))),)))
    else:
        read = Select(guard, Load(Ref(x, (at,), x.shape)), Const(0.0))
        window = Loop("i", 0, 3, Block((AugAssign(row, "+", read),)))
    rows = Loop("r", 0, 2, Block((window,)), kind=LoopKind.TILE_INNER, axis=Axis(None, 0, "out"))
    tile = Loop("t", 0, tiles, Block((rows,)), kind=LoopKind.TILE_OUTER,
                axis=Axis(None, 0, "out"))
    return Kernel("tiled", Block((tile,)))


def _per_tile_tests(loop: Loop) -> list:
    """The ``if`` statements in ``loop``'s body that test its variable alone."""
    return [n for n in walk(loop.body) if isinstance(n, If)
            and {m.lhs for m in walk(n.cond) if isinstance(m, Compare)} == {Affine.of(loop.var)}]


def test_a_test_on_the_tile_index_is_decided_once_per_tile():
    """No row of a tile reads inside on every tile, so the rows cannot split; from the
    third tile on every read is inside: the nest runs as ``if t >= 2: <no tests> else:
    <the nest>``."""
    before = _tiled_window()
    after = split_guards(before)
    (tile,) = after.body.stmts
    (versioned,) = tile.body.stmts
    assert versioned.cond == Compare(">=", Affine.of("t"), Const(2))
    assert _selects(versioned.then) == 0 and _selects(versioned.orelse) == 1
    _same_result(before, after)


def test_a_test_per_row_is_not_worth_a_copy_of_the_nest():
    after = split_guards(_tiled_window(per_row=True))
    assert not _per_tile_tests(after.body.stmts[0])


def _pooled(opt_level: int, shape: tuple, relu: bool = False) -> Net:
    """A padded 3x3 stride-2 max-pool (after a ReLU), its forward and backward run."""
    net = Net(2, opt_level=opt_level, num_threads=2 if opt_level >= 2 else 1)
    x = MemoryDataLayer(net, "x", shape)
    WeightedSumLoss(net, "loss", MaxPoolingLayer(
        "pool", net, ReLULayer("relu", net, x) if relu else x, 3, 2, 1))
    net.init()
    fill(net, x, np.random.default_rng(3))
    net.forward()
    net.backward()
    return net


def test_a_fused_pooling_after_a_relu_computes_the_same_without_tests_in_inner_tiles():
    """ReLU then a padded 3x3 stride-2 max-pool (ResNet's stem) fuse tile by tile; the
    pool's reads test the tile index, decided once per tile."""
    shape = (8, 64, 64)   # tiles of 2 pooled rows
    base, opt = _pooled(0, shape, relu=True), _pooled(3, shape, relu=True)
    (group,) = opt.program.groups
    assert [p.ensemble.name for p in group.plans] == ["relu", "pool"]
    for phase in ("forward", "backward"):
        kernel = group.owner(phase).kernels[phase]
        tiles = [n for n in walk(kernel.body) if isinstance(n, Loop)
                 and n.kind is LoopKind.TILE_OUTER]
        assert any(_selects(n.then) < _selects(n.orelse)
                   for t in tiles for n in _per_tile_tests(t)), phase
    np.testing.assert_array_equal(opt.value("pool"), base.value("pool"))
    np.testing.assert_array_equal(opt.grad("x"), base.grad("x"))


@pytest.mark.parametrize("level", [1, 2, 3])
def test_a_padded_pooling_runs_its_interior_without_tests_and_computes_the_same(level):
    base, opt = _pooled(0, (3, 9, 10)), _pooled(level, (3, 9, 10))
    plan = next(p for p in opt.program.plans if p.ensemble.name == "pool")
    for kernel in (plan.kernels["forward"], plan.kernels["backward"]):
        assert any(isinstance(n, Loop) and n.axis is not None and n.extent > 1
                   and not any(isinstance(m, Compare) and m.op in (">=", "<")
                               for m in walk(n))
                   and any(isinstance(m, Load) for m in walk(n)) for n in walk(kernel.body))
    np.testing.assert_array_equal(opt.value("pool"), base.value("pool"))
    np.testing.assert_array_equal(opt.grad("x"), base.grad("x"))


# ---------------------------------------------------------------- loop coalescing

def _affine_nest(loops, stmt) -> Kernel:
    """``stmt`` under ``loops``: (var, start, stop) outermost first (serial loops)."""
    body = Block((stmt,))
    for var, start, stop in reversed(loops):
        body = Block((Loop(var, start, stop, body),))
    return Kernel("nest", body)


def _loops(kernel: Kernel) -> list[tuple[str, int, int]]:
    return [(n.var, n.start, n.stop) for n in walk(kernel) if isinstance(n, Loop)]


def _scaled_rows(c: int = 4, h: int = 3, w: int = 5, rows=(0, 3), cols=(0, 5)) -> Kernel:
    """``out[c, y, x] = s[c] * a[c, y, x] + b[c, y, x]``: a batch norm's shape of nest."""
    s, a, b, out = _buf("s", c), _buf("a", c, h, w), _buf("b", c, h, w), _buf("out", c, h, w)
    value = BinOp("+", BinOp("*", Load(_ref(s, "c")), Load(_ref(a, "c", "y", "x"))),
                  Load(_ref(b, "c", "y", "x")))
    return _affine_nest([("c", 0, c), ("y", *rows), ("x", *cols)],
                        Assign(_ref(out, "c", "y", "x"), value))


def test_rows_that_follow_each_other_in_every_buffer_become_one_loop():
    before = _scaled_rows()
    after = coalesce_loops(before)
    # s[c] keeps the channel loop; the rows of a channel are one run of 15
    assert _loops(after) == [("c", 0, 4), ("x", 0, 15)]
    _same_result(before, after)
    rows = _scaled_rows(rows=(1, 3))   # rows 1 and 2 of each channel: still one run
    assert _loops(coalesce_loops(rows)) == [("c", 0, 4), ("x", 0, 10)]
    _same_result(rows, coalesce_loops(rows))


def test_a_nest_over_whole_buffers_merges_all_the_way_out():
    a, out = _buf("a", 4, 3, 5), _buf("out", 4, 3, 5)
    before = _affine_nest([("c", 0, 4), ("y", 0, 3), ("x", 0, 5)],
                          AugAssign(_ref(out, "c", "y", "x"), "+", Load(_ref(a, "c", "y", "x"))))
    after = coalesce_loops(before)
    assert _loops(after) == [("x", 0, 60)]
    _same_result(before, after)


def test_coalescing_keeps_runs_with_gaps_tests_on_indices_and_collapsed_loops():
    # part of each row (a guard split, a tile): the rows do not follow each other
    part = _scaled_rows(cols=(1, 4))
    assert coalesce_loops(part) == part
    # the column index in a test
    a, out = _buf("a", 3, 5), _buf("out", 3, 5)
    tested = _affine_nest([("y", 0, 3), ("x", 0, 5)], Assign(
        _ref(out, "y", "x"), Select(Compare(">=", Affine.of("x"), Const(1)),
                                    Load(_ref(a, "y", "x")), Const(0.0))))
    assert coalesce_loops(tested) == tested
    # a transposed read: the inner index does not walk the buffer in order
    flipped = _affine_nest([("y", 0, 5), ("x", 0, 5)], Assign(
        _ref(_buf("o", 5, 5), "y", "x"), Load(_ref(_buf("t", 5, 5), "x", "y"))))
    assert coalesce_loops(flipped) == flipped
    # a parallel loop's collapsed nest keeps its shape
    whole = _affine_nest([("y", 0, 3), ("x", 0, 5)], Assign(_ref(out, "y", "x"),
                                                           Load(_ref(a, "y", "x"))))
    par = Kernel("par", Block((dataclasses.replace(
        whole.body.stmts[0], kind=LoopKind.PARALLEL, meta=(("collapse", 2),)),)))
    assert coalesce_loops(par) == par


@pytest.mark.parametrize("level", [1, 2, 3])
def test_short_rows_of_an_elementwise_group_run_as_one_loop_and_compute_the_same(level):
    """Batch norm + add + ReLU on 14 x 28 rows: each channel's rows one loop at every
    level that optimizes, values and gradients equal to level 0's."""
    def built(opt_level):
        net = Net(2, opt_level=opt_level, num_threads=2 if opt_level >= 2 else 1)
        x = MemoryDataLayer(net, "x", (6, 14, 28))
        y = MemoryDataLayer(net, "y", (6, 14, 28))
        bn = BatchNormLayer("bn", net, x)
        WeightedSumLoss(net, "loss", ReLULayer("relu", net, AddLayer("add", net, bn, y)))
        net.init()
        rng = np.random.default_rng(5)
        fill(net, x, rng)
        fill(net, y, rng)
        net.forward()
        net.backward()
        return net

    base, opt = built(0), built(level)
    runs = {n.extent for p in opt.program.plans for k in p.kernels.values()
            for n in walk(k) if isinstance(n, Loop)}
    assert 14 * 28 in runs or 6 * 14 * 28 in runs
    for name in ("relu", "bn"):
        np.testing.assert_allclose(opt.value(name), base.value(name), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(opt.grad("x"), base.grad("x"), rtol=1e-4, atol=1e-5)
