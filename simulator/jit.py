"""The one place where Numba compilation flags are decided.

``fastmath`` stays off: both engines must produce bit-identical floats, so no reassociation
and no fused multiply-add. ``cache`` keeps compiled kernels across processes.
"""
from __future__ import annotations

import numba

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
    Usable as ``@jit``, ``@jit(...)`` or ``jit(fn, ...)``.
    """
    flags = dict(JIT_FLAGS if allocates else NO_ALLOC_FLAGS, inline="always" if inline else "never")

    def wrap(f):
        return numba.njit(**flags)(f)

    return wrap if fn is None else wrap(fn)
