"""Background admission: substituted gate mass accumulates per expert until it reaches beta."""
from __future__ import annotations


def accumulate_substituted(acc, gate, beta):
    """Add one substitution's gate weight to an expert's accumulator.

    Returns ``(new_acc, admit)``: at ``acc >= beta`` the expert is to be queued for a background
    transfer and its accumulator resets to 0.
    """
    acc = acc + gate
    if acc >= beta:
        return 0.0, True
    return acc, False
