"""A net's description: a canonical encoding of everything the compiler can read from it.

The compiler is a function of the net (its batch size and time steps, each ensemble's class,
name, shape, neuron type and fields, each connection's mapping function), of the settings it
runs with (opt level, threads, ``LATTE_*`` variables), of the machine and of latte's own
source. :func:`describe` encodes all of them into a sha256 key, so that a compiled program can
be stored under it and found again before the compiler runs (a warm ``net.init()``).

The encoding walks the net's object graph: values by value, functions by their bytecode,
constants, closure cells, defaults and the globals they name, classes by every attribute of
their own (latte's by name: its source is part of the key), arrays by their bytes except a
field's storage, of which the compiler reads only the shape. Every object gets its place in
the walk (:attr:`Description.objects`): shared and cyclic references encode as that place, and
a stored program names the net's objects by it. An object of a kind the encoder does not know
makes the net undescribable (:class:`Undescribable`): it is then compiled every time, never
looked up by a key that could miss what the compiler read.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.metadata
import os
import sys
import sysconfig
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from latte.compiler import machine
from latte.compiler.fingerprint import source_digest
from latte.lang.ensemble import DataEnsemble, FieldData

# what the compiler reads of the Net object itself (the rest is run-time state)
NET_ATTRIBUTES = ("batch_size", "time_steps", "ensembles", "connections")
# functions and attributes written in C: by name
_BUILTINS = (types.BuiltinFunctionType, np.ufunc, types.MemberDescriptorType,
             types.GetSetDescriptorType, types.WrapperDescriptorType,
             types.MethodDescriptorType, types.ClassMethodDescriptorType)
_RANDOM = (np.random.Generator, np.random.BitGenerator, np.random.RandomState)
_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"])


class Undescribable(Exception):
    """The net holds an object the encoder does not know (named in the message)."""


@dataclass
class Description:
    key: str          # sha256 (hex) of the encoding and the settings
    objects: list     # the net's objects in the order the walk met them


def describe(net, settings: tuple) -> Description:
    """``net``'s description for compiling with ``settings`` (opt level, segments, threads)
    on this machine; raises :class:`Undescribable`."""
    walk = _Walk()
    try:
        walk.encode(net)
    except Undescribable:
        raise
    except RecursionError:
        raise Undescribable("objects nested deeper than Python's recursion limit") from None
    except Exception as error:   # an attribute that raises when read (a lazy module's)
        raise Undescribable(f"reading the net's objects raised {error!r}") from error
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith("LATTE_") and k != "LATTE_CACHE_DIR")
    # the trials' answers (micro-kernel or BLAS) are the host's, its OpenBLAS kernels included
    host = (machine.host(), sorted(machine.cache_sizes().items()))
    h = hashlib.sha256()
    for part in (latte_digest(), versions(), repr(settings), repr(env), repr(host), *walk.out):
        h.update(part.encode())
        h.update(b"\0")
    return Description(h.hexdigest()[:32], walk.objects)


def wanted() -> bool:
    """Whether a stored program may stand for compiling: not where ``LATTE_DUMP`` asks to
    watch the compiler's steps, nor with ``LATTE_STORED_PROGRAMS=0``. (``LATTE_VERIFY`` is
    part of the key: a program stored under it was verified after every step.)"""
    return not os.environ.get("LATTE_DUMP") and os.environ.get("LATTE_STORED_PROGRAMS") != "0"


def latte_digest() -> str:
    """A sha256 of every source file of latte's packages (the compiler, the language, the
    stdlib): any change to them changes every key."""
    import latte.stdlib  # noqa: PLC0415  (the stdlib imports latte: not while latte loads)

    return source_digest(tuple(sorted({Path(p) for p in latte.__path__}
                                      | {Path(p) for p in latte.stdlib.__path__})))


@functools.lru_cache(maxsize=None)
def versions() -> str:
    parts = [sys.version]
    for dist in ("numpy", "llvmlite", "islpy"):
        try:
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist}=?")
    return " ".join(parts)


def _latte_module(name: str | None) -> bool:
    return bool(name) and (name == "latte" or name.startswith("latte."))


_SCALARS = (type(None), bool, int, float, complex, str, bytes, np.generic, np.dtype)


class _Walk:
    """The encoding, as a list of strings, and the objects met, in order."""

    def __init__(self):
        self.out: list[str] = []
        self.objects: list = []
        self.place: dict[int, int] = {}   # id -> place (the objects list keeps them alive)

    def encode(self, x) -> None:
        if isinstance(x, _SCALARS):
            self.out.append(f"{type(x).__name__}:{x!r}")
        elif isinstance(x, enum.Enum):
            self.out.append(f"enum:{type(x).__module__}.{type(x).__qualname__}.{x.name}")
        elif isinstance(x, tuple):
            self.out.append(f"tuple:{type(x).__qualname__}:{len(x)}")
            for item in x:
                self.encode(item)
        elif id(x) in self.place:
            self.out.append(f"@{self.place[id(x)]}")
        else:
            self.place[id(x)] = len(self.objects)
            self.objects.append(x)
            self._new(x)

    def _new(self, x) -> None:
        """Encode ``x``, met for the first time."""
        out = self.out
        if isinstance(x, (list, dict)):
            items = list(x.items()) if isinstance(x, dict) else x
            out.append(f"{type(x).__name__}:{len(items)}")
            for item in items:
                self.encode(item)
        elif isinstance(x, (set, frozenset)):
            if not all(isinstance(i, _SCALARS) for i in x):
                raise Undescribable("a set of objects (its order differs between processes)")
            out.append(f"set:{sorted(repr(i) for i in x)}")
        elif isinstance(x, np.ndarray):
            data = np.ascontiguousarray(x).tobytes()
            out.append(f"array:{x.dtype.str}:{x.shape}:{hashlib.sha256(data).hexdigest()}")
        elif isinstance(x, FieldData):   # the compiler reads a field's shape, never its values
            out.append(f"field:{x.array.dtype.str}:{x.array.shape}")
            self.encode((x.name, x.spec, x.index_map, x.lead_ndim, x.given_shape))
        elif isinstance(x, types.ModuleType):
            out.append(f"module:{x.__name__}")
        elif isinstance(x, types.FunctionType):
            self._function(x)
        elif isinstance(x, _BUILTINS):
            out.append(f"builtin:{type(x).__name__}:{getattr(x, '__module__', None)}."
                       f"{getattr(x, '__qualname__', x.__name__)}")
        elif isinstance(x, types.MethodType):
            out.append("method")
            self.encode((x.__self__, x.__func__))
        elif isinstance(x, functools.partial):
            out.append("partial")
            self.encode((x.func, x.args, x.keywords))
        elif isinstance(x, (staticmethod, classmethod)):
            out.append(type(x).__name__)
            self.encode(x.__func__)
        elif isinstance(x, property):
            out.append("property")
            self.encode((x.fget, x.fset, x.fdel))
        elif isinstance(x, type):
            self._class(x)
        elif isinstance(x, _RANDOM):   # its numbers are drawn at run time, never compiled in
            out.append(f"random:{type(x).__name__}")
        elif type(x).__name__ == "Net" and type(x).__module__ == "latte.net":
            out.append("net")
            for name in NET_ATTRIBUTES:
                self.encode(getattr(x, name))
        elif hasattr(x, "__dict__") or hasattr(type(x), "__slots__"):
            self._instance(x)
        else:
            raise Undescribable(f"an object of type {type(x).__module__}.{type(x).__qualname__}")

    def _instance(self, x) -> None:
        self.out.append("object")
        self.encode(type(x))
        state = dict(getattr(x, "__dict__", {}))
        for cls in type(x).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if slot not in ("__dict__", "__weakref__") and hasattr(x, slot):
                    state[slot] = getattr(x, slot)
        if isinstance(x, DataEnsemble):
            state.pop("source", None)   # the data: read at run time, never compiled in
        self.encode(state)

    def _function(self, fn: types.FunctionType) -> None:
        out = self.out
        if _latte_module(fn.__module__):   # latte's source is part of the key
            out.append(f"function:{fn.__module__}.{fn.__qualname__}:{fn.__code__.co_firstlineno}")
        else:
            out.append(f"function:{fn.__module__}.{fn.__qualname__}")
            self._code(fn.__code__)
            names = _names(fn.__code__)
            named = tuple((n, fn.__globals__[n]) for n in sorted(names & fn.__globals__.keys()))
            self.encode(named)
            for _, value in named:
                self._module_attributes(value, names)
        cells = tuple(_contents(c) for c in fn.__closure__ or ())
        self.encode((cells, fn.__defaults__, fn.__kwdefaults__))

    def _module_attributes(self, value, names: set[str], depth: int = 3) -> None:
        """What a function naming ``names`` may read of a user's module ``value`` (a module is
        otherwise encoded by its name): each attribute of those names, and theirs in turn."""
        if not isinstance(value, types.ModuleType) or _by_name(value.__name__) or not depth:
            return
        found = tuple((n, getattr(value, n)) for n in sorted(names) if hasattr(value, n))
        self.encode(found)
        for _, attribute in found:
            self._module_attributes(attribute, names, depth - 1)

    def _code(self, code: types.CodeType) -> None:
        self.out.append(f"code:{code.co_filename}:{code.co_firstlineno}:{code.co_code.hex()}:"
                        f"{code.co_names}:{code.co_varnames}:{code.co_freevars}:"
                        f"{code.co_cellvars}:{code.co_argcount}:{code.co_kwonlyargcount}:"
                        f"{code.co_flags}")
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._code(const)
            else:
                self.encode(const)

    def _class(self, cls: type) -> None:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if _by_name(cls.__module__):
            self.out.append(f"class:{name}")
            return
        self.out.append(f"class:{name}:{len(cls.__mro__)}")
        for base in cls.__mro__[1:]:
            self.encode(base)
        own = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        self.encode(own)


class _Empty:
    """An empty closure cell's contents."""


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return _Empty


def _by_name(module: str) -> bool:
    """Whether a class or module of ``module`` is encoded by its name alone: latte's (its
    source is in the key), Python's own and numpy's (their versions are). A user's module
    that a standard one's name would hide is not Python's."""
    top = module.split(".")[0]
    if _latte_module(module) or top in ("builtins", "numpy"):
        return True
    where = getattr(sys.modules.get(top), "__file__", None)
    return top in sys.stdlib_module_names and (where is None
                                               or os.path.realpath(where).startswith(_STDLIB))


def _names(code: types.CodeType) -> set[str]:
    """Every global or attribute name ``code`` and the code nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names

