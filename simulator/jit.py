"""The one place where Numba compilation flags are decided.

``fastmath`` stays off: both engines must produce bit-identical floats, so no reassociation
and no fused multiply-add. ``cache`` keeps compiled kernels across processes.
"""
from __future__ import annotations

import contextlib
import types
from pathlib import Path
from types import ModuleType

import numba
import numpy as np
from numba.extending import intrinsic

from traces.provenance import files_fingerprint

JIT_FLAGS = {
    "cache": True,
    "fastmath": False,
    "nogil": True,
    "boundscheck": False,
    "error_model": "numpy",  # no Python exceptions from float division inside kernels
}

# For functions that never allocate: without Numba's runtime no array argument is
# reference-counted per call, which otherwise costs more than a small helper's whole body.
NO_ALLOC_FLAGS = dict(JIT_FLAGS, _nrt=False)


def jit(fn=None, *, allocates: bool = True, inline: bool = False):
    """Compile ``fn`` with the project's flags.

    ``allocates=False``: a kernel or helper that only works in arrays it is given.
    ``inline=True``: a helper on a kernel's hot path with many array arguments, inlined into
    its callers' IR (passing a dozen arrays through a call costs more than the helper's body).
    Numba compiles an inlined function again at each call site, with everything inlined in it:
    a large one belongs at few sites (the kernel's trim, the heap's pop), or its kernels take
    minutes to compile.
    Usable as ``@jit``, ``@jit(...)`` or ``jit(fn, ...)``.
    """
    flags = dict(JIT_FLAGS if allocates else NO_ALLOC_FLAGS, inline="always" if inline else "never")

    def wrap(f):
        return numba.njit(**flags)(f)

    return wrap if fn is None else wrap(fn)


def specialise(fn, variants: dict, inline: bool = False):
    """``fn`` compiled as a kernel with each name in ``variants`` bound to a policy module.

    ``fn``'s body calls hooks as ``eviction.on_use(...)``; here ``eviction`` resolves to the
    chosen variant's module, so Numba compiles direct calls (inlinable, no branch on a policy
    code). Each combination is cached under its own name, which also carries a fingerprint of
    the engine's and the policies' sources: Numba invalidates a cached kernel only when the
    kernel's own file changes, so an edited hook must change the name. Cached kernels of older
    fingerprints are removed. ``variants`` may also bind other specialised functions (a step of
    the kernel compiled apart); ``inline=True`` inlines the result into its callers.
    """
    # flags by their initials (TRACK_FREQUENCY=1: TF1): the cache's file names stay within the
    # file system's limit; the same names come in the same order for every kernel of ``fn``
    tag = ".".join([m.__name__.rsplit(".", 1)[-1] for m in variants.values() if isinstance(m, ModuleType)]
                   + ["".join(w[0] for w in k.split("_") if w) + str(int(v))
                      for k, v in variants.items() if isinstance(v, bool | int)])
    fp = SOURCES_FINGERPRINT
    namespace = dict(fn.__globals__, **variants)
    f = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    f.__qualname__ = f"{fn.__qualname__}[{tag}@{fp}]"
    f.__module__ = fn.__module__
    f.__doc__ = fn.__doc__
    kernel = numba.njit(**NO_ALLOC_FLAGS, inline="always" if inline else "never")(f)
    _prune_stale(kernel, f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}[", f"@{fp}]")
    return kernel


def sources_fingerprint() -> str:
    """A short hash of every source file a specialised kernel is compiled from."""
    root = Path(__file__).resolve().parent
    files = sorted([*root.glob("engine/*.py"), *root.glob("policies/**/*.py"),
                    root / "jit.py", root / "metrics.py"])
    return files_fingerprint(root, files)


def _prune_stale(kernel, prefix: str, current: str) -> None:
    """Remove this kernel's cache files from earlier source fingerprints."""
    try:
        directory = Path(kernel._cache._cache_path)  # Numba's cache locator; private
        stale = [p for p in directory.iterdir()
                 if p.name.startswith(prefix) and current not in p.name]
    except (AttributeError, OSError):
        return
    for p in stale:
        with contextlib.suppress(OSError):
            p.unlink()


@numba.njit(**NO_ALLOC_FLAGS, inline="always")
def ix(i):
    """``i``, an index known to be >= 0 and < 2**32 (an expert id, a pool, a position), as an
    unsigned one: Numba indexes a signed integer through a wrap of negative values (a compare and
    a select on every access, on the hot path's critical chain) and an unsigned one directly.

    Only for indexing and for ids that stay ids: a uint32 in arithmetic with a signed integer
    gives a signed result again, and a sentinel -1 must never pass through here.
    """
    return np.uint32(i)


# taken when the engine is imported: the sources its kernels are compiled from in this process
SOURCES_FINGERPRINT = sources_fingerprint()


@intrinsic
def prefetch(typingctx, array, index):
    """Ask the CPU to start loading the cache line that holds ``array.flat[index]`` (C-contiguous)
    now, for a read soon after; changes no value (a prefetch never faults, even out of range)."""
    from llvmlite import ir
    from numba.core import cgutils
    from numba.core import types as nbtypes

    if not isinstance(array, nbtypes.Array) or not isinstance(index, nbtypes.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_ptr = ir.IntType(8).as_pointer()
        address = builder.bitcast(builder.gep(data, [args[1]]), byte_ptr)
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [address, i32(0), i32(3), i32(1)])  # read, keep in all cache levels, data
        return context.get_dummy_value()

    return nbtypes.void(array, index), codegen
