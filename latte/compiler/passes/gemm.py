"""GEMM pattern matching on the loop IR (paper section 5.3, figures 8-9).

One rule: a perfect loop nest around ``C[c] += A[a] * B[b]`` with affine offsets. Each loop
variable is classified by the refs it indexes: C and A only -> M, C and B only -> N, A and B
only -> K, all three -> a loop kept around the call. Variables of one class that walk memory
contiguously are collapsed into one dimension; transposes and leading dimensions follow
from the strides. Nothing here looks at layer types or names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from latte.compiler.ir import Affine, AugAssign, BinOp, Block, Gemm, Kernel, Load, Loop, Ref

MIN_FLOPS = 4096   # below this a loop nest beats the call overhead


def match_gemm(kernel: Kernel) -> Kernel:
    """Replace every matching multiply-accumulate nest by a :class:`Gemm`."""
    return replace(kernel, body=_block(kernel.body))


def _block(block: Block) -> Block:
    return Block(tuple(match_nest(s) for s in block.stmts))


def match_nest(s):
    """``s`` with its multiply-accumulate nests (at any depth) replaced by GEMMs."""
    if not isinstance(s, Loop):
        return s
    chain, inner = [s], s
    while len(inner.body.stmts) == 1 and isinstance(inner.body.stmts[0], Loop):
        inner = inner.body.stmts[0]
        chain.append(inner)
    if len(inner.body.stmts) == 1:
        out = _match(chain, inner.body.stmts[0])
        if out is not None:
            return out
    return replace(s, body=_block(s.body))


@dataclass
class _Dim:
    extent: int
    strides: dict[str, int]     # role (c, a, b) -> element stride


def _operands(stmt):
    if not (isinstance(stmt, AugAssign) and stmt.op == "+" and isinstance(stmt.target, Ref)):
        return None
    v = stmt.value
    if not (isinstance(v, BinOp) and v.op == "*" and isinstance(v.lhs, Load)
            and isinstance(v.rhs, Load) and isinstance(v.lhs.ref, Ref) and isinstance(v.rhs.ref, Ref)):
        return None
    c, a, b = stmt.target, v.lhs.ref, v.rhs.ref
    if any(r.buffer.dtype != "float32" for r in (c, a, b)) or c.buffer in (a.buffer, b.buffer):
        return None
    offs = {"c": c.offset(), "a": a.offset(), "b": b.offset()}
    if any(o is None for o in offs.values()):
        return None
    return {"c": c.buffer, "a": a.buffer, "b": b.buffer}, offs


def _collapse(vars_: list[Loop], roles: tuple[str, str], offs) -> tuple[_Dim, list[Loop]]:
    """Fold variables of one class into one dimension where memory is contiguous."""
    if not vars_:
        return _Dim(1, {r: 0 for r in roles}), []
    vars_ = sorted(vars_, key=lambda lp: abs(offs[roles[0]].coef(lp.var)))
    first = vars_[0]
    dim = _Dim(first.extent, {r: offs[r].coef(first.var) for r in roles})
    rest = []
    for lp in vars_[1:]:
        if all(offs[r].coef(lp.var) == dim.strides[r] * dim.extent for r in roles):
            dim.extent *= lp.extent
        else:
            rest.append(lp)
    return dim, rest


def _match(chain: list[Loop], stmt):
    ops = _operands(stmt)
    if ops is None or any(lp.start != 0 for lp in chain):
        return None
    bufs, offs = ops
    classes: dict[str, list[Loop]] = {"m": [], "n": [], "k": [], "batch": []}
    for lp in chain:
        used = tuple(offs[r].coef(lp.var) != 0 for r in "cab")
        cls = {(True, True, False): "m", (True, False, True): "n", (False, True, True): "k",
               (True, True, True): "batch"}.get(used)
        if cls is None:
            return None
        classes[cls].append(lp)
    m, rest_m = _collapse(classes["m"], ("c", "a"), offs)
    n, rest_n = _collapse(classes["n"], ("c", "b"), offs)
    k, rest_k = _collapse(classes["k"], ("a", "b"), offs)
    if m.extent * n.extent * k.extent * 2 < MIN_FLOPS:
        return None
    if n.extent > 1 and n.strides["c"] != 1:   # compute C^T = B^T A^T instead
        if not (m.extent == 1 or m.strides["c"] == 1):
            return None
        m, n = _Dim(n.extent, {"c": n.strides["c"], "a": n.strides["b"]}), \
            _Dim(m.extent, {"c": m.strides["c"], "b": m.strides["a"]})
        k = _Dim(k.extent, {"a": k.strides["b"], "b": k.strides["a"]})
        bufs = {"c": bufs["c"], "a": bufs["b"], "b": bufs["a"]}
        offs = {"c": offs["c"], "a": offs["b"], "b": offs["a"]}
    layout = _layout(m, n, k)
    if layout is None:
        return None
    (lda, trans_a), (ldb, trans_b), ldc = layout
    inner = {lp.var for lp in classes["m"] + classes["n"] + classes["k"]} - {
        lp.var for lp in rest_m + rest_n + rest_k}
    base = {r: Affine.build({v: c for v, c in offs[r].terms if v not in inner}, offs[r].const)
            for r in "cab"}
    gemm = Gemm(m.extent, n.extent, k.extent, bufs["a"], base["a"], lda, trans_a,
                bufs["b"], base["b"], ldb, trans_b, bufs["c"], base["c"], ldc)
    body = Block((gemm,))
    outer = [lp for lp in chain if lp.var not in inner]
    for lp in reversed(outer):
        body = Block((replace(lp, body=body),))
    return body.stmts[0]


def _layout(m: _Dim, n: _Dim, k: _Dim):
    """CBLAS row-major leading dimensions and transposes, or None if not expressible."""
    ldc = m.strides["c"] if m.extent > 1 else n.extent
    if ldc < n.extent:
        return None
    if k.extent == 1 or k.strides["a"] == 1:
        a = (m.strides["a"] if m.extent > 1 else k.extent, False)
        ok_a = a[0] >= k.extent
    elif m.extent == 1 or m.strides["a"] == 1:
        a = (k.strides["a"], True)
        ok_a = a[0] >= m.extent
    else:
        return None
    if n.extent == 1 or n.strides["b"] == 1:
        b = (k.strides["b"] if k.extent > 1 else n.extent, False)
        ok_b = b[0] >= n.extent
    elif k.extent == 1 or k.strides["b"] == 1:
        b = (n.strides["b"], True)
        ok_b = b[0] >= k.extent
    else:
        return None
    if not (ok_a and ok_b) or min(a[0], b[0], ldc) < 1:
        return None
    return a, b, ldc
