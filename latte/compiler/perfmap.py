"""``LATTE_PERF_MAP=1``: names for the JIT's functions in ``perf`` (``/tmp/perf-<pid>.map``).

``perf report`` names samples in JIT code from the process's map file; without one, the
generated kernels show as bare addresses. Every loaded object's function symbols (its ELF
symbol table: segments, kernels, the products' micro-kernels, outlined parallel bodies) are
appended there at the address their section was loaded at, which an exported function of
the same section gives away (``engine`` resolves exported names only).
"""

from __future__ import annotations

import os
import struct

SHT_SYMTAB, STT_FUNC = 2, 2


def functions(obj: bytes) -> list[tuple[str, int, int, int]]:
    """``(name, section index, offset, size)`` of each function symbol of the ELF64
    little-endian relocatable object ``obj``."""
    if obj[:4] != b"\x7fELF" or obj[4:6] != b"\x02\x01":
        raise ValueError("not a little-endian ELF64 object")
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    size, count = struct.unpack_from("<HH", obj, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, align, entsize)
    headers = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * size) for i in range(count)]
    out = []
    for header in headers:
        if header[1] != SHT_SYMTAB:
            continue
        names = headers[header[6]][4]
        for at in range(header[4], header[4] + header[5], 24):
            name, info, _, section, offset, length = struct.unpack_from("<IBBHQQ", obj, at)
            if info & 0xF == STT_FUNC and length:
                start = names + name
                out.append((obj[start:obj.index(b"\0", start)].decode(), section, offset, length))
    return out


def record(engine, obj: bytes) -> None:
    """Append ``obj``'s functions, where ``engine`` loaded them, to this process's map."""
    found = functions(obj)
    bases: dict[int, int] = {}
    for name, section, offset, _ in found:
        if section not in bases and (address := engine.get_function_address(name)):
            bases[section] = address - offset
    with open(f"/tmp/perf-{os.getpid()}.map", "a") as f:
        for name, section, offset, length in found:
            if section in bases:
                f.write(f"{bases[section] + offset:x} {length:x} {name}\n")
