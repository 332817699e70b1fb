"""What the capture's Triton kernels share (the NLL's log-sum-exp, the top-R selection): built on
first use where Triton is installed (it comes with CUDA builds of torch), and given up for the
process, with one warning, once one fails on a host; the torch path runs instead."""
from __future__ import annotations

import functools
import warnings


def triton_kernel(build):
    """Decorate ``build(triton, tl)`` (it returns a ``triton.jit`` function): a cached function of
    no arguments that gives the kernel, or None when Triton is not installed."""
    @functools.cache
    def kernel():
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return build(triton, tl)

    kernel.__doc__ = build.__doc__
    return kernel


def give_up(failed: list[str], what: str, instead: str, error: BaseException) -> None:
    """Record ``error``'s first line in ``failed`` (the kernel's list: no retry once it holds
    one) and warn that ``what`` failed and ``instead`` runs."""
    text = str(error).strip()
    failed.append(f"{type(error).__name__}: {text.splitlines()[0] if text else ''}")
    warnings.warn(f"{what} failed ({failed[0]}); {instead}", RuntimeWarning, stacklevel=3)
