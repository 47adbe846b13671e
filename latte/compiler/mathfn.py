"""``exp`` and ``tanh`` as LLVM IR that the loop vectorizer can widen.

libm's ``expf`` and ``tanhf`` are opaque calls, one element at a time: an LSTM cell loop
spends most of its time in them. These definitions (Cody-Waite range reduction and the
Cephes single-precision polynomials, within 2 ulp of the exact result) are internal
always-inline functions of straight-line arithmetic, so every loop that calls them
vectorizes at the host's vector width. They keep libm's edge cases: overflow gives
``inf``, underflow 0, ``tanh`` saturates at +-1, and NaN stays NaN.
"""

from __future__ import annotations

from llvmlite import ir

F32, I32 = ir.FloatType(), ir.IntType(32)
POLY = ("contract",)   # fused multiply-adds, nothing that reorders the reduction

# e^x = 2^n e^r, n = round(x log2 e), r = x - n ln 2 with ln 2 split in two (Cody-Waite)
LOG2E, LN2_HI, LN2_LO = 1.44269504088896341, 0.693359375, -2.12194440e-4
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
            1.6666665459e-1, 5.0000001201e-1)
# past these e^x is inf or 0 in float32; clamping keeps n's halves valid exponents
EXP_HI, EXP_LO = 89.0, -104.0
# tanh x = x + x^3 P(x^2) for |x| < 0.625, else sign(x) (1 - 2 / (e^(2|x|) + 1))
TANH_SMALL = 0.625
TANH_POLY = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
             -3.33332819422e-1)


def function(module: ir.Module, name: str) -> ir.Function:
    """The module's ``latte.<name>`` (``exp`` or ``tanh``), defined on first use."""
    qualified = f"latte.{name}"
    if qualified in module.globals:
        return module.globals[qualified]
    fn = ir.Function(module, ir.FunctionType(F32, [F32]), qualified)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    b.ret({"exp": _exp, "tanh": _tanh}[name](module, b, fn.args[0]))
    return fn


def _const(value: float) -> ir.Constant:
    return ir.Constant(F32, value)


def _intrinsic(module: ir.Module, name: str, nargs: int = 1) -> ir.Function:
    """The float32 LLVM intrinsic ``name`` of ``nargs`` arguments."""
    return module.declare_intrinsic(name, [F32], ir.FunctionType(F32, [F32] * nargs))


def _horner(b: ir.IRBuilder, coefficients: tuple[float, ...], z: ir.Value) -> ir.Value:
    p = _const(coefficients[0])
    for c in coefficients[1:]:
        p = b.fadd(b.fmul(p, z, flags=POLY), _const(c), flags=POLY)
    return p


def _scale(b: ir.IRBuilder, n: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Two floats whose product is 2^n (n an i32 in [-150, 129]: each half is a normal
    float's exponent, so the product overflows or underflows as e^x does)."""
    half = b.ashr(n, ir.Constant(I32, 1))
    def power(k):
        return b.bitcast(b.shl(b.add(k, ir.Constant(I32, 127)), ir.Constant(I32, 23)), F32)
    return power(half), power(b.sub(n, half))


def _exp(module: ir.Module, b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    nan = b.fcmp_unordered("uno", x, x)
    xc = b.select(nan, _const(0.0), x)
    xc = b.select(b.fcmp_ordered(">", xc, _const(EXP_HI)), _const(EXP_HI), xc)
    xc = b.select(b.fcmp_ordered("<", xc, _const(EXP_LO)), _const(EXP_LO), xc)
    floor = _intrinsic(module, "llvm.floor")
    n = b.call(floor, [b.fadd(b.fmul(xc, _const(LOG2E)), _const(0.5))])
    r = b.fsub(b.fsub(xc, b.fmul(n, _const(LN2_HI))), b.fmul(n, _const(LN2_LO)))
    p = _horner(b, EXP_POLY, r)
    e = b.fadd(b.fadd(b.fmul(b.fmul(p, r, flags=POLY), r, flags=POLY), r, flags=POLY),
               _const(1.0), flags=POLY)
    s1, s2 = _scale(b, b.fptosi(n, I32))
    return b.select(nan, x, b.fmul(b.fmul(e, s1), s2))


def _tanh(module: ir.Module, b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    ax = b.call(_intrinsic(module, "llvm.fabs"), [x])
    z = b.fmul(x, x)
    small = b.fadd(b.fmul(b.fmul(_horner(b, TANH_POLY, z), z, flags=POLY), x, flags=POLY),
                   x, flags=POLY)
    e = b.call(function(module, "exp"), [b.fmul(ax, _const(2.0))])
    large = b.fsub(_const(1.0), b.fdiv(_const(2.0), b.fadd(e, _const(1.0))))
    large = b.call(_intrinsic(module, "llvm.copysign", 2), [large, x])
    return b.select(b.fcmp_ordered("<", ax, _const(TANH_SMALL)), small, large)
