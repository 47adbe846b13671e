"""A program's fingerprint: a sha256 of everything codegen reads, without running codegen.

Codegen is a pure function of the native segments (names and kernels), the buffer table
(each buffer's slot, shape and dtype), the thread count and the compiler's own source. The
fingerprint encodes all of them canonically: each kernel as its :func:`shape` (every IR
node by its class and its structural fields, those that take part in equality; a
statement's source location and a loop's axis do not reach the generated code) and the
slots of its buffers, every buffer by its slot and layout. Two
programs with the same fingerprint generate the same LLVM IR, so the object cache can be
looked up before the LLVM module is built (most of a warm ``net.init()``). An object of a
type the encoder does not know is an error, never silently left out.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from pathlib import Path

from latte.compiler.ir import Axis, Buffer, Kernel, accesses, remembered

_COMPILER = Path(__file__).parent


def fingerprint(segments, buffer_index: dict[Buffer, int], threads: int) -> str:
    """The sha256 (hex) of ``segments`` (each with ``.name`` and ``.kernels``) compiled
    against ``buffer_index`` for ``threads`` threads by this version of the compiler: each
    kernel as its name, phase, :func:`shape` and the slots of its buffers."""
    out = [compiler_digest(), f"threads={threads}"]
    for buf, slot in buffer_index.items():
        out.append(f"{slot}:{buf.name}:{buf.shape}:{buf.dtype}:{buf.batched}")
    for seg in segments:
        out.append(f"segment {seg.name!r}")
        for kernel in seg.kernels:
            if not isinstance(kernel, Kernel):
                raise TypeError(f"fingerprint: segment {seg.name!r} holds a "
                                f"{type(kernel).__name__}, not a kernel")
            slots = " ".join(str(buffer_index[b]) for b in kernel_buffers(kernel))
            out.append(f"kernel {kernel.name!r} {kernel.phase!r} over {slots}")
            out.append(shape(kernel, False))
    return hashlib.sha256("\n".join(out).encode()).hexdigest()


def kernel_buffers(kernel: Kernel) -> list[Buffer]:
    """The buffers ``kernel`` touches, in order of first access (its function's arguments;
    remembered by the kernel: kernels never change)."""
    return list(remembered(kernel, "_buffers",
                           lambda: tuple(dict.fromkeys(a.buffer for a in accesses(kernel.body)))))


def shape(kernel: Kernel, check_bounds: bool) -> str:
    """What ``kernel``'s function is made from: its IR with each of its buffers as its
    argument position and element type. Kernels of one shape share a function. With bounds
    checks the kernel's name and its buffers' names and sizes are part of the code, hence of
    the shape. Remembered by the kernel (the segments are cut by it, and codegen's modules,
    built in forked children, find it)."""
    if not check_bounds and "_shape" in kernel.__dict__:
        return kernel.__dict__["_shape"]
    detail = (lambda b: (b.dtype, b.size, b.name)) if check_bounds else (lambda b: b.dtype)
    key = structure(kernel.body, {b: f"{i}:{detail(b)}" for i, b in enumerate(kernel_buffers(kernel))})
    if check_bounds:
        return f"{kernel.name}\n{key}"
    object.__setattr__(kernel, "_shape", key)
    return key


def structure(node, labels: dict[Buffer, str]) -> str:
    """``node``'s IR in the fingerprint's canonical encoding, each buffer written as its
    label in ``labels`` and loop axes (what a loop iterates, which ``latte explain`` shows
    and codegen never reads) left out: equal strings, the same code over the labelled
    buffers."""
    out: list[str] = []
    _encode(node, labels, out, (Axis,))
    return "\n".join(out)


def compiler_digest() -> str:
    """A sha256 of the compiler's source files: any change to it changes every key."""
    return source_digest((_COMPILER,))


@functools.lru_cache(maxsize=None)
def source_digest(roots: tuple[Path, ...]) -> str:
    """A sha256 of every Python source file under ``roots``, each named by its root's name
    and its path there."""
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            h.update(f"{root.name}/{path.relative_to(root).as_posix()}".encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.compare)


_ATOMS = frozenset((str, int, float, bool, type(None)))   # bool is an int; repr tells apart


def _encode(x, index: dict[Buffer, int | str], out: list[str], omit: tuple = ()) -> None:
    kind = type(x)   # exact types first (most of a kernel), then their subclasses
    if kind in omit or (kind not in _ATOMS and isinstance(x, omit)):
        out.append(kind.__name__)
    elif kind in _ATOMS:
        out.append(repr(x))
    elif kind is Buffer:
        out.append(f"B{index[x]}")
    elif kind is tuple or kind is list:
        out.append("(")
        for item in x:
            _encode(item, index, out, omit)
        out.append(")")
    elif dataclasses.is_dataclass(kind) and not issubclass(kind, Buffer):
        out.append(f"{kind.__name__}(")
        for name in _fields(kind):
            _encode(getattr(x, name), index, out, omit)
        out.append(")")
    elif isinstance(x, Buffer):
        out.append(f"B{index[x]}")
    elif isinstance(x, enum.Enum):
        out.append(f"{kind.__name__}.{x.name}")
    elif isinstance(x, (str, int, float)):
        out.append(repr(x))
    elif isinstance(x, (tuple, list)):
        _encode(tuple(x), index, out, omit)
    else:
        raise TypeError(f"fingerprint: cannot encode {kind.__name__} in a kernel")
