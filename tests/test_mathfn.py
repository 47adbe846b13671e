"""The compiled ``exp`` and ``tanh`` (latte/compiler/mathfn.py): within 2 ulp of the exact
result over float32's range, libm's edge cases kept, and widened by the loop vectorizer."""

import ctypes
import re

import numpy as np
import pytest
from llvmlite import ir

from latte.compiler import mathfn
from latte.compiler.jit import target

F32, I64 = ir.FloatType(), ir.IntType(64)


def _map_ir(name: str) -> str:
    """IR of ``void apply(float* x, float* y, i64 n)``: y[i] = name(x[i])."""
    module = ir.Module(name=f"test_{name}")
    ptr = F32.as_pointer()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr, ptr, I64]), "apply")
    for arg in fn.args[:2]:
        arg.add_attribute("noalias")
    entry, loop, done = (fn.append_basic_block(n) for n in ("entry", "loop", "done"))
    b = ir.IRBuilder(entry)
    b.cbranch(b.icmp_signed(">", fn.args[2], ir.Constant(I64, 0)), loop, done)
    b.position_at_end(loop)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    value = b.load(b.gep(fn.args[0], [i]))
    b.store(b.call(mathfn.function(module, name), [value]), b.gep(fn.args[1], [i]))
    nxt = b.add(i, ir.Constant(I64, 1))
    i.add_incoming(nxt, loop)
    b.cbranch(b.icmp_signed("<", nxt, fn.args[2]), loop, done)
    b.position_at_end(done)
    b.ret_void()
    return str(module)


@pytest.fixture(scope="module", params=["exp", "tanh"])
def compiled(request):
    lib = target().compile(_map_ir(request.param))
    proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    apply = proto(lib.address("apply"))

    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty_like(x)
        apply(x.ctypes.data, y.ctypes.data, x.size)
        return y

    run.library = lib   # the compiled code lives as long as the engine does

    return request.param, run


def _ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|got - exact| in units of float32's spacing at exact."""
    spacing = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    spacing = np.maximum(spacing, np.finfo(np.float32).smallest_normal * 2.0**-23)
    return np.abs(got.astype(np.float64) - exact) / spacing


def test_within_two_ulp(compiled):
    name, run = compiled
    rng = np.random.default_rng(0)
    hi = 88.5 if name == "exp" else 12.0
    x = np.concatenate([np.linspace(-87.0, hi, 200_001), rng.uniform(-1, 1, 100_000),
                        rng.normal(0, 1e-3, 10_000), [0.0, -0.0, 1e-30, -1e-30, 0.625, -0.625]])
    x = x.astype(np.float32)
    exact = getattr(np, name)(x.astype(np.float64))
    worst = _ulps(run(x), exact)
    assert worst.max() <= 2.0, (name, x[worst.argmax()], worst.max())
    print(name, "max ulp", worst.max())


def test_edge_cases(compiled):
    name, run = compiled
    x = np.array([np.inf, -np.inf, np.nan, 89.0, 100.0, -110.0, -1e4, 1e4], np.float32)
    with np.errstate(over="ignore"):
        expected = getattr(np, name)(x)
    np.testing.assert_array_equal(run(x), expected)


def test_vectorized(compiled):
    """The loop over ``apply`` is widened: no scalar call is left, and the optimized IR
    holds float vectors (as wide as LLVM chooses for the host: 4 floats at least)."""
    name, _ = compiled
    module = target()._module(_map_ir(name))
    target().optimize(module)
    text = str(module)
    assert "call float @latte." not in text
    widths = [int(w) for w in re.findall(r"<(\d+) x float>", text)]
    assert widths and max(widths) >= 4, text
