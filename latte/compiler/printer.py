"""Pretty-printer: loop IR as the Python-like pseudo-code of the paper's figures 8-12."""

from __future__ import annotations

from latte.compiler.ir import (
    Affine,
    Assign,
    AugAssign,
    BinOp,
    Block,
    BoolOp,
    Call,
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
    UnaryOp,
    Var,
)
from latte.compiler.microkernel import copied_rows


def fmt_expr(e) -> str:
    if isinstance(e, Affine):
        parts = [v if c == 1 else f"{c}*{v}" for v, c in e.terms]
        if e.const or not parts:
            parts.append(str(e.const))
        return " + ".join(parts).replace("+ -", "- ")
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Ref):
        return f"{e.buffer.name}[{', '.join(fmt_expr(i) for i in e.index)}]"
    if isinstance(e, Load):
        return fmt_expr(e.ref)
    if isinstance(e, BinOp):
        if e.op in ("max", "min"):
            return f"{e.op}({fmt_expr(e.lhs)}, {fmt_expr(e.rhs)})"
        return f"({_operand(e.lhs)} {e.op} {_operand(e.rhs)})"
    if isinstance(e, UnaryOp):
        return f"-{fmt_expr(e.operand)}" if e.op == "neg" else f"not {fmt_expr(e.operand)}"
    if isinstance(e, Compare):
        return f"{fmt_expr(e.lhs)} {e.op} {fmt_expr(e.rhs)}"
    if isinstance(e, BoolOp):
        return f" {e.op} ".join(f"({fmt_expr(v)})" for v in e.values)
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(fmt_expr(a) for a in e.args)})"
    if isinstance(e, Select):
        return f"({fmt_expr(e.if_true)} if {fmt_expr(e.cond)} else {fmt_expr(e.if_false)})"
    return repr(e)


def _operand(e) -> str:
    """An arithmetic operand: affine sums and comparisons in parentheses."""
    text = fmt_expr(e)
    if isinstance(e, Compare) or (isinstance(e, Affine) and len(e.terms) + bool(e.const) > 1):
        return f"({text})"
    return text


def fmt_stmt(s, indent: int = 0) -> list[str]:
    pad = "    " * indent
    if isinstance(s, Kernel):
        return [f"{pad}def {s.name}():"] + fmt_stmt(s.body, indent + 1)
    if isinstance(s, Block):
        lines = [line for st in s.stmts for line in fmt_stmt(st, indent)]
        return lines or [pad + "pass"]
    if isinstance(s, Loop):
        notes = [] if s.kind is LoopKind.SERIAL else [s.kind.value]
        notes += [f"{k}={v}" for k, v in s.meta if k != "conn"]
        if s.axis is not None:
            notes.insert(0, str(s.axis))
        axis = f"  # {', '.join(notes)}" if notes else ""
        rng = f"{s.stop}" if s.start == 0 else f"{s.start}, {s.stop}"
        return [f"{pad}for {s.var} in range({rng}):{axis}"] + fmt_stmt(s.body, indent + 1)
    if isinstance(s, If):
        lines = [f"{pad}if {fmt_expr(s.cond)}:"] + fmt_stmt(s.then, indent + 1)
        if s.orelse.stmts:
            lines += [f"{pad}else:"] + fmt_stmt(s.orelse, indent + 1)
        return lines
    if isinstance(s, Assign):
        return [f"{pad}{fmt_expr(s.target)} = {fmt_expr(s.value)}"]
    if isinstance(s, AugAssign):
        return [f"{pad}{fmt_expr(s.target)} {s.op}= {fmt_expr(s.value)}"]
    if isinstance(s, Gemm):
        ta, tb = "T" if s.trans_a else "N", "T" if s.trans_b else "N"
        b = f"ldb={s.ldb}"
        if s.panel:   # the register-tiled product over a packed B, or B in place
            rows, cols, lanes = s.panel
            shape = f"{rows}x{cols} dot products" if s.trans_b else f"{rows}x{cols} tiles"
            call, ta = f"tiled_gemm({shape} of {lanes}-float vectors, ", ta + tb * s.trans_b
            copied = copied_rows(s)
            b = "packed" if s.packed else b + (f", copied to rows of {copied}" if copied else "") \
                + (f" (k in blocks of {s.k_block})" if s.k_block else "")
        else:
            call, ta = "sgemm(", ta + tb
        streamed = (", streamed stores" if s.stream else "") + ("" if s.c_stored else ", C not stored")
        head = (f"{pad}{call}{ta}, m={s.m}, n={s.n}, k={s.k}, "
                f"A={s.a_buf.name}[{fmt_expr(s.a_off)}:] lda={s.lda}, "
                f"B={s.b_buf.name}[{fmt_expr(s.b_off)}:] {b}, "
                f"C={s.c_buf.name}[{fmt_expr(s.c_off)}:] ldc={s.ldc}, beta={s.beta:g}{streamed})")
        if s.epilogue is None:
            return [head]
        return [head + ", each element then:", *fmt_stmt(s.epilogue, indent + 1)]
    return [pad + repr(s)]


def format_ir(node) -> str:
    """Render a kernel, block or statement as indented pseudo-code."""
    return "\n".join(fmt_stmt(node))
