"""Views of a trace source: the same chunk-source protocol over part of a trace.

Every source (:class:`~traces.format.TraceReader`, :class:`~traces.format.ArraySource`, the
trace cache's ``CachedTrace``, and the views here) has ``meta``, ``num_tokens`` and re-iterable
``iter_chunks(max_tokens=None, *, logits=True, order_r=0, stored_ids=False)`` and
``iter_chunks_reversed`` with the same options (traces/format.py, *Options*).
"""
from __future__ import annotations

from collections.abc import Iterator

from traces.format import TraceChunk, slice_chunk


class LimitedSource:
    """The first ``max_tokens`` tokens of a trace (rounded up to a whole group)."""

    def __init__(self, source, max_tokens: int):
        self.source, self.meta, self.max_tokens = source, source.meta, max_tokens

    @property
    def token_bound(self) -> int | None:
        """At most how many tokens the view yields and above every group ordinal in it: the
        wrapped source's tokens (its last group may run past the limit); None where unknown."""
        inner = self.source
        return getattr(inner, "token_bound", None) or getattr(inner, "num_tokens", None)

    @property
    def keeps_logit_order(self) -> bool:
        """Whether ``order_r`` is served from a kept copy (as the wrapped source's)."""
        return bool(getattr(self.source, "keeps_logit_order", False))

    def _limit(self, chunks: Iterator[TraceChunk]) -> Iterator[TraceChunk]:
        left = self.max_tokens
        for c in chunks:
            if left <= 0:
                return
            if c.num_tokens <= left:
                left -= c.num_tokens
                yield c
                continue
            stop = left
            while stop < c.num_tokens and c.group[stop] == c.group[stop - 1]:
                stop += 1
            yield slice_chunk(c, 0, stop)
            return

    def iter_chunks(self, max_tokens: int | None = None, *, logits: bool = True,
                    order_r: int = 0, stored_ids: bool = False) -> Iterator[TraceChunk]:
        """The source's chunks up to the limit (the last one cut after a whole group)."""
        return self._limit(self.source.iter_chunks(max_tokens, logits=logits, order_r=order_r,
                                                   stored_ids=stored_ids))

    def iter_chunks_reversed(self, max_tokens: int | None = None, *, logits: bool = True,
                             order_r: int = 0, stored_ids: bool = False) -> Iterator[TraceChunk]:
        """The chunks of :meth:`iter_chunks`, last to first."""
        return reversed(list(self.iter_chunks(max_tokens, logits=logits, order_r=order_r,
                                              stored_ids=stored_ids)))
