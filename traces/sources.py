"""Views of a trace source: the first N tokens of another source."""
from __future__ import annotations

from traces.format import slice_chunk


class LimitedSource:
    """The first ``max_tokens`` tokens of a trace (rounded up to a whole group)."""

    def __init__(self, source, max_tokens: int):
        self.source, self.meta, self.max_tokens = source, source.meta, max_tokens

    def _limit(self, chunks):
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

    def iter_chunks(self, max_tokens=None):
        return self._limit(self.source.iter_chunks(max_tokens))

    def iter_chunks_reversed(self, max_tokens=None):
        return reversed(list(self.iter_chunks(max_tokens)))
