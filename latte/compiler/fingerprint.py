"""A program's fingerprint: a sha256 of everything codegen reads, without running codegen.

Codegen is a pure function of the native segments (names and kernels), the buffer table
(each buffer's slot, shape and dtype), the thread count and the compiler's own source. The
fingerprint encodes all of them canonically: every IR node by its class and its structural
fields (those that take part in equality; a statement's source location and a loop's
ensemble object do not reach the generated code), every buffer by its slot and layout. Two
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

from latte.compiler.ir import Axis, Buffer

_COMPILER = Path(__file__).parent


def fingerprint(segments, buffer_index: dict[Buffer, int], threads: int) -> str:
    """The sha256 (hex) of ``segments`` (each with ``.name`` and ``.kernels``) compiled
    against ``buffer_index`` for ``threads`` threads by this version of the compiler."""
    out = [compiler_digest(), f"threads={threads}"]
    for buf, slot in buffer_index.items():
        out.append(f"{slot}:{buf.name}:{buf.shape}:{buf.dtype}:{buf.batched}")
    for seg in segments:
        out.append(f"segment {seg.name!r}")
        _encode(tuple(seg.kernels), buffer_index, out)
    return hashlib.sha256("\n".join(out).encode()).hexdigest()


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


def _encode(x, index: dict[Buffer, int | str], out: list[str], omit: tuple = ()) -> None:
    if isinstance(x, omit):
        out.append(type(x).__name__)
    elif isinstance(x, Buffer):
        out.append(f"B{index[x]}")
    elif isinstance(x, (str, int, float, type(None))):   # bool is an int; repr tells apart
        out.append(repr(x))
    elif isinstance(x, (tuple, list)):
        out.append("(")
        for item in x:
            _encode(item, index, out, omit)
        out.append(")")
    elif isinstance(x, enum.Enum):
        out.append(f"{type(x).__name__}.{x.name}")
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        out.append(f"{type(x).__name__}(")
        for name in _fields(type(x)):
            _encode(getattr(x, name), index, out, omit)
        out.append(")")
    else:
        raise TypeError(f"fingerprint: cannot encode {type(x).__name__} in a kernel")
