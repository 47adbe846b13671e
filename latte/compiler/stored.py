"""Compiled programs kept in the disk cache under their net's description.

A warm ``net.init()`` finds the program the compiler made for an equal description
(:mod:`latte.compiler.description`) and skips the compiler: the program is pickled with every
object of the net (ensembles, connections, neuron types, mapping functions, field storage)
written as its place in the description's walk, and loaded back onto the objects at the same
places of the net now being initialized. A program holding an object that the walk did not
meet and that neither latte's compiler nor a library made (its copy would part from the
user's object), or that does not pickle, is not stored. Entries use the object cache's format
(checked on load, written atomically); like the object code beside them they are trusted, so
the cache folder must be the user's own.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickle
import types

from latte.compiler import cache
from latte.compiler.description import Description

SUFFIX = ".program"
# a stored program holds objects of these modules by value (the net's own by their places)
_BY_VALUE = ("latte.compiler", "latte.lang", "builtins", "numpy", "islpy", "nanobind", "enum",
             "collections", "copyreg")


class _Pickler(pickle.Pickler):
    def __init__(self, file, desc: Description):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.places = {id(o): i for i, o in enumerate(desc.objects)}
        self.objects = desc.objects

    def persistent_id(self, obj):
        place = self.places.get(id(obj))
        return place if place is not None and self.objects[place] is obj else None

    def reducer_override(self, obj):
        """Refuse what the description did not meet, unless latte's compiler or a library
        made it: a copy of a user's object would silently part from the net."""
        named = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
        module = getattr(named, "__module__", None) or ""
        if not any(module == m or module.startswith(f"{m}.") for m in _BY_VALUE):
            raise pickle.PicklingError(f"{module}.{named.__qualname__} is not the net's")
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, objects: list):
        super().__init__(file)
        self.objects = objects

    def persistent_load(self, place):
        return self.objects[place]


def load(desc: Description):
    """``(program, fingerprint, speed)`` stored for ``desc``, or None."""
    data = cache.load(desc.key, SUFFIX)
    return None if data is None else loads(desc, data)


def store(desc: Description, program, fingerprint: str, speed: int) -> None:
    """Keep ``program`` under ``desc``'s key, if it pickles."""
    data = dumps(desc, program, fingerprint, speed)
    if data is not None:
        cache.store(desc.key, data, SUFFIX)


def dumps(desc: Description, program, fingerprint: str, speed: int) -> bytes | None:
    """``(program, fingerprint, speed)`` pickled, its library left out, the objects of
    ``desc`` written as their places; None if it holds anything else that is not
    latte's or a library's, or nests deeper than Python's recursion limit."""
    library, program.library = program.library, None
    buf = io.BytesIO()
    try:
        with _no_collections():
            _Pickler(buf, desc).dump((program, fingerprint, speed))
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
        return None
    finally:
        program.library = library
    return buf.getvalue()


def loads(desc: Description, data: bytes):
    """What :func:`dumps` made, its places bound to ``desc``'s objects; None if it does not
    load."""
    try:
        with _no_collections():
            return _Unpickler(io.BytesIO(data), desc.objects).load()
    except Exception:   # noqa: BLE001  (whatever the entry holds, compiling is the answer)
        return None


@contextlib.contextmanager
def _no_collections():
    """The garbage collector paused: a program is ~10^5 objects, and the collections that
    making them all at once sets off took 4/5 of the time to load ResNet-50's."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
