"""What the capture's Triton kernels share (the NLL's log-sum-exp, the top-R selection): a kernel
that fails on a host is given up for the process, with one warning, and the torch path runs."""
from __future__ import annotations

import warnings


def give_up(failed: list[str], what: str, instead: str, error: BaseException) -> None:
    """Record ``error``'s first line in ``failed`` (the kernel's list: no retry once it holds
    one) and warn that ``what`` failed and ``instead`` runs."""
    text = str(error).strip()
    failed.append(f"{type(error).__name__}: {text.splitlines()[0] if text else ''}")
    warnings.warn(f"{what} failed ({failed[0]}); {instead}", RuntimeWarning, stacklevel=3)
