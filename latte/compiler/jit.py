"""The native target: one object owns the target machine, the O3 pipeline and the JIT.

A program is compiled as one LLVM module per core, in parallel (forked children: llvmlite
runs one LLVM call at a time per process), and each object is loaded into an MCJIT engine.
They are cached on disk (:mod:`latte.compiler.cache`) as one entry, keyed by a hash of what
the IR is made from, the CPU name and features and the llvmlite version, so a second run of
the same net does not recompile: on a hit the IR is not even built.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import signal
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import llvmlite
import llvmlite.binding as llvm

from latte.compiler import cache, perfmap
from latte.compiler.blas import blas
from latte.compiler.machine import target_cpu, usable_cores


@functools.lru_cache(maxsize=None)
def openmp() -> ctypes.CDLL | None:
    """libgomp (shipped with gcc), whose thread pool runs parallel loops; None if absent."""
    for name in (ctypes.util.find_library("gomp"), "libgomp.so.1"):
        if name:
            try:
                return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
    return None


NO_GATHER = ",+prefer-no-gather,+prefer-no-scatter"


def unroll_threshold() -> int:
    """The largest cost of an unrolled loop body LLVM's unroller accepts:
    ``$LATTE_UNROLL_THRESHOLD``, else 100. O3's 300 grows the long functions of fused
    training groups (window copies, scatter-adds) several times over for no measured gain:
    at 100 LLVM compiles ResNet-50's training program in 4/5 of the time, and no zoo net
    runs slower (at 50 ResNet-18's training step ran 1-3% slower; at 0 AlexNet's 1.25x)."""
    text = os.environ.get("LATTE_UNROLL_THRESHOLD", "100")
    if not text.isdigit():
        raise ValueError(f"LATTE_UNROLL_THRESHOLD={text!r}: expected a non-negative integer")
    return int(text)


class Target:
    """Target machine (:func:`~latte.compiler.machine.target_cpu`), optimization pipeline
    and symbol table (created once)."""

    def __init__(self):
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        self.cpu, features = target_cpu()
        # the loop nests keep a unit stride innermost: vectorizing an outer loop with gathers
        # and scatters (LLVM does on znver4 once it unrolls the inner one) runs 10x slower
        self.features = features.flatten() + NO_GATHER
        self.machine = self.new_machine()
        self._register_symbols()

    def new_machine(self) -> llvm.TargetMachine:
        """A fresh target machine (an MCJIT engine takes ownership of the one it gets)."""
        target = llvm.Target.from_triple(llvm.get_process_triple())
        return target.create_target_machine(cpu=self.cpu, features=self.features, opt=3,
                                            reloc="pic", codemodel="jitdefault", jit=True)

    @staticmethod
    def _register_symbols():
        for name in ("scipy_cblas_sgemm", "scipy_cblas_sgemv"):
            llvm.add_symbol(name, ctypes.cast(getattr(blas(), name), ctypes.c_void_p).value)
        libm = ctypes.CDLL(ctypes.util.find_library("m"))
        for name in ("logf", "sqrtf", "floorf"):
            llvm.add_symbol(name, ctypes.cast(getattr(libm, name), ctypes.c_void_p).value)
        gomp = openmp()
        for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads") if gomp else ():
            llvm.add_symbol(name, ctypes.cast(getattr(gomp, name), ctypes.c_void_p).value)

    def cache_key(self, fingerprint: str) -> str:
        """The cache key of the program ``fingerprint`` identifies, on this CPU and LLVM."""
        h = hashlib.sha256()
        for part in (fingerprint, self.cpu, self.features, llvmlite.__version__, "v3",
                     f"unroll{unroll_threshold()}"):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def optimize(self, module: llvm.ModuleRef, speed: int = 3) -> None:
        """The new pass manager at ``speed`` (3: O3 with loop and SLP vectorization)."""
        llvm.set_option("latte", f"-unroll-threshold={unroll_threshold()}")
        pto = llvm.create_pipeline_tuning_options(speed_level=speed)
        pto.loop_vectorization = speed >= 3
        pto.slp_vectorization = speed >= 3
        pto.loop_unrolling = speed >= 3
        pb = llvm.create_pass_builder(self.machine, pto)
        pb.getModulePassManager().run(module, pb)

    def compile(self, ir_text: str) -> "CodeLibrary":
        """JIT ``ir_text``, through the cache keyed by its sha256."""
        return self.library(hashlib.sha256(ir_text.encode()).hexdigest(),
                            lambda _n: [lambda: ir_text])

    def library(self, fingerprint: str, build_ir: Callable[[int], list[Callable[[], str]]],
                speed: int = 3, check: Callable[[], None] | None = None) -> "CodeLibrary":
        """The code of the program that ``fingerprint`` identifies (a hash of everything its
        IR is made from): the cached objects if a valid entry exists (then the IR is never
        built), else the modules ``build_ir(n)`` returns (at most ``n`` functions, each
        building one module's LLVM IR; together they define every function) built and
        compiled in parallel, one per core, and their objects cached as one entry.
        ``speed`` is LLVM's optimization level (part of the key). ``check`` (raising if the
        program must not run) runs alongside the compile; nothing is cached or returned
        unless it passes."""
        key = self.cache_key(f"{fingerprint}/O{speed}")
        data = cache.load(key)
        if data is not None:
            return CodeLibrary(self._engines(_split(data)), True, key, None, speed)
        checking = in_background(check)
        try:
            digests, objects = self._compile_all(build_ir(compile_jobs()), speed)
            checking.wait()
        finally:
            checking.cancel()
        cache.store(key, _join(objects))
        return CodeLibrary(self._engines(objects), False, key,
                           hashlib.sha256(b"".join(digests)).hexdigest(), speed)

    def objects(self, library: "CodeLibrary",
                build_ir: Callable[[int], list[Callable[[], str]]]) -> list[bytes]:
        """The relocatable objects ``library`` runs (``latte export`` links them into a shared
        library: their calls to sgemm, libm and libgomp are references by name): the cached
        ones, else ``build_ir`` compiled again as :meth:`library` compiled it."""
        data = cache.load(library.key)
        if data is not None:
            return _split(data)
        return self._compile_all(build_ir(compile_jobs()), library.speed)[1]

    def object(self, ir_text: str, speed: int) -> bytes:
        """``ir_text`` parsed, verified, optimized at ``speed`` and compiled to an object."""
        module = self._module(ir_text)
        module.verify()
        self.optimize(module, speed)
        return self.machine.emit_object(module)

    def _compile_all(self, modules: list[Callable[[], str]],
                     speed: int) -> tuple[list[bytes], list[bytes]]:
        """The sha256 of each of ``modules``' IR (functions building LLVM IR) and its object,
        each built and compiled in a forked child (llvmlite runs one LLVM call at a time per
        process), or here if there is one."""
        def build(module: Callable[[], str]) -> bytes:
            text = module()
            return hashlib.sha256(text.encode()).digest() + self.object(text, speed)

        # several modules: all built in children, so that this process makes none of
        # llvmlite's IR (cyclic garbage that the collector's next pass, once it is back on,
        # would walk inside net.init())
        out = side_by_side([lambda m=m: build(m) for m in modules], here=len(modules) == 1)
        return [one[:32] for one in out], [one[32:] for one in out]

    def _module(self, ir_text: str) -> llvm.ModuleRef:
        """``ir_text`` parsed, for this target (O3 needs the data layout)."""
        module = llvm.parse_assembly(ir_text)
        module.triple = self.machine.triple
        module.data_layout = str(self.machine.target_data)
        return module

    def _engines(self, objects: list[bytes]) -> list:
        """A finalized MCJIT engine per object (MCJIT needs a module: an empty one). One
        engine holding two objects runs into SIGILL (LLVM 22: the second object's GOT
        relocations of the large code model, which a JIT uses, are resolved wrongly), so
        each object gets its own; no object calls into another. ``LATTE_PERF_MAP=1`` names
        their functions for ``perf`` (:mod:`~latte.compiler.perfmap`)."""
        engines = []
        for obj in objects:
            engine = llvm.create_mcjit_compiler(self._module(""), self.new_machine())
            engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
            engine.finalize_object()
            if os.environ.get("LATTE_PERF_MAP") == "1":
                perfmap.record(engine, obj)
            engines.append(engine)
        return engines


def compile_jobs() -> int:
    """How many modules a program is compiled as, in parallel: ``$LATTE_COMPILE_JOBS``, else
    the cores this process may run on (1 under MPI, whose ranks share them, and where
    ``fork`` is missing)."""
    if os.environ.get("LATTE_COMPILE_JOBS"):
        jobs = os.environ["LATTE_COMPILE_JOBS"]
        if not jobs.isdigit() or int(jobs) < 1:
            raise ValueError(f"LATTE_COMPILE_JOBS={jobs!r}: expected a positive integer")
        return int(jobs)
    if not hasattr(os, "fork") or any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK")):
        return 1
    return usable_cores()


def side_by_side(works: list[Callable[[], bytes]], here: bool = True) -> list[bytes]:
    """What each of ``works`` returns, the first run here (unless not ``here``) and the
    others meanwhile in forked children (a failed child's work runs again here)."""
    mine = works[:1] if here else []
    children = [_Child(work) for work in works[len(mine):]]
    try:
        return [work() for work in mine] + [child.result() for child in children]
    finally:
        for child in children:
            child.cancel()


def in_background(work: Callable[[], None] | None) -> "_Child | _Done":
    """``work`` started in a forked child where programs compile in parallel (else run here
    and now; None: nothing to do). ``wait()`` returns once it has run, and raises its error:
    a failed child's work runs again here, so the error and its traceback are this
    process's; ``cancel()`` stops it (once waited for, a no-op)."""
    if work is None:
        return _Done()
    if compile_jobs() == 1:
        work()
        return _Done()
    return _Child(lambda: work() or b"done")


class _Done:
    """Work already done (:func:`in_background` without a child)."""

    def wait(self) -> None:
        pass

    def cancel(self) -> None:
        pass


class _Child:
    """``work`` run in a forked child, its bytes passed back through a temporary file."""

    def __init__(self, work: Callable[[], bytes]):
        self.work, self.pid = work, None
        fd, self.path = tempfile.mkstemp(prefix="latte-obj-")
        os.close(fd)
        with warnings.catch_warnings():   # Python 3.12+ warns about forking a threaded
            warnings.simplefilter("ignore", DeprecationWarning)   # process: the child only
            pid = os.fork()                                        # runs LLVM
        if pid == 0:
            code = 1
            try:
                Path(self.path).write_bytes(work())
                code = 0
            finally:
                os._exit(code)
        self.pid = pid

    def result(self) -> bytes:
        """The child's bytes, or ``work`` run here if the child failed (a real LLVM error
        then surfaces in this process)."""
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        data = Path(self.path).read_bytes() if status == 0 else b""
        return data if data else self.work()

    def wait(self) -> None:
        """Like :meth:`result`, for work whose bytes say only that it ran."""
        self.result()

    def cancel(self) -> None:
        """Stop the child if it still runs (this process failed or was interrupted) and
        remove its file."""
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = None
        Path(self.path).unlink(missing_ok=True)


_COUNT = struct.Struct("<Q")


def _join(objects: list[bytes]) -> bytes:
    """One cache payload holding ``objects``: a count, then each length and object."""
    return b"".join([_COUNT.pack(len(objects))]
                    + [_COUNT.pack(len(o)) + o for o in objects])


def _split(data: bytes) -> list[bytes]:
    """The objects of a payload :func:`_join` made (its checksum was verified on load)."""
    (n,), at, out = _COUNT.unpack_from(data), _COUNT.size, []
    for _ in range(n):
        (size,) = _COUNT.unpack_from(data, at)
        out.append(data[at + _COUNT.size: at + _COUNT.size + size])
        at += _COUNT.size + size
    return out


class CodeLibrary:
    """Finalized JIT engines (one per object): look up exported functions by name. ``key``
    is the cache key, ``ir_digest`` a sha256 over its modules' LLVM IR (None when the
    objects came from the cache and the IR was never built); both are equal across
    processes for equal nets. ``speed``: the LLVM optimization level it was compiled at."""

    def __init__(self, engines: list, from_cache: bool, key: str, ir_digest: str | None,
                 speed: int = 3):
        self.engines, self.from_cache, self.key, self.ir_digest = engines, from_cache, key, ir_digest
        self.speed = speed

    def address(self, name: str) -> int:
        addr = self.global_address(name)
        if not addr:
            raise KeyError(f"no compiled function {name!r}")
        return addr

    def global_address(self, name: str) -> int:
        """The address of the function or global ``name``, 0 if no object defines it."""
        for engine in self.engines:
            addr = engine.get_global_value_address(name)
            if addr:
                return addr
        return 0


@functools.lru_cache(maxsize=None)
def target() -> Target:
    return Target()
