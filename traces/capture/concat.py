"""Join Parquet files of one schema into one file by copying their row groups' bytes.

A Parquet file is ``PAR1``, the row groups' encoded column chunks, the footer (a Thrift
compact-protocol ``FileMetaData``), the footer's length and ``PAR1`` again. Encoded pages hold no
file offsets; only the footer does. So files written by separate writers can be joined without
decoding or encoding any data: copy each file's bytes between the magic and its footer, and write
one footer holding every file's row groups with their offsets shifted to where the bytes landed.
This is what lets the capture encode row groups on several threads (each a file of its own) and
still produce one ordinary trace file.

The footer is not decoded either: compact-protocol structs and lists carry no byte lengths, so a
footer's bytes are copied as they are and only the varints that hold offsets (and row-group
ordinals) are written anew. :func:`_scan` walks a footer once to find those varints. The one
field decoded and written anew is the key-value metadata: a trace's content hash
(``traces.format.CONTENT_KEY``) covers the content of the file it is in, so each part's is its
own and the joined file's is the caller's (:meth:`ParquetJoin.finish`); every other entry must be
the same in every part. (The top-level field headers are written anew too: a field id is a delta
from the previous field's, and the key-value field may come or go.)
"""
from __future__ import annotations

import errno
import io
import os
from dataclasses import dataclass, field
from pathlib import Path

from traces.atomic import atomic_output
from traces.format import CONTENT_KEY

MAGIC = b"PAR1"
# Thrift compact-protocol type codes
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
_MAX_ORDINAL = 2**15 - 1  # RowGroup.ordinal is an i16; beyond it the ordinals are left as they are

# Where the offsets are (parquet.thrift field ids): FileMetaData.row_groups -> RowGroup.file_offset
# and RowGroup.columns -> ColumnChunk.file_offset / offset and column index offsets, and
# ColumnChunk.meta_data -> ColumnMetaData's data, index and dictionary page and bloom filter offsets.
_COLUMN_META = {9: "offset", 10: "offset", 11: "offset", 14: "offset"}
_COLUMN_CHUNK = {2: "offset", 3: _COLUMN_META, 4: "offset", 6: "offset"}
_ROW_GROUP = {1: [_COLUMN_CHUNK], 5: "offset", 7: "ordinal"}
_FILE_NUM_ROWS, _FILE_ROW_GROUPS, _FILE_KEY_VALUES = 3, 4, 5
_KEY, _VALUE = 1, 2  # KeyValue's fields (binary)
_REWRITTEN = (_FILE_NUM_ROWS, _FILE_ROW_GROUPS, _FILE_KEY_VALUES)


@dataclass
class Footer:
    """A footer's bytes and the varints in them to rewrite."""

    data: bytes
    fields: list[tuple[int, int, int]] = field(default_factory=list)  # top level: (id, start, value start)
    holes: list[tuple[int, int, str, int]] = field(default_factory=list)  # (start, end, kind, value)
    num_rows: int = 0
    row_groups: tuple[int, int, int] = (0, 0, 0)  # (count, first group's start, end of the list)
    key_values: list[tuple[bytes, bytes | None]] = field(default_factory=list)  # in footer order

    def spans(self) -> list[tuple[int, int, int, int]]:
        """(field id, header start, value start, end) of each top-level field; the STOP byte follows."""
        ends = [start for _, start, _ in self.fields[1:]] + [len(self.data) - 1]
        return [(field_id, start, value, end) for (field_id, start, value), end in zip(self.fields, ends, strict=True)]


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, pos


def _zigzag(data: bytes, pos: int) -> tuple[int, int]:
    n, pos = _varint(data, pos)
    return (n >> 1) ^ -(n & 1), pos


def _list_header(data: bytes, pos: int) -> tuple[int, int, int]:
    """(element count, element type, position after the header)."""
    head = data[pos]
    size, kind, pos = head >> 4, head & 0x0F, pos + 1
    if size == 15:
        size, pos = _varint(data, pos)
    return size, kind, pos


def _skip(data: bytes, pos: int, kind: int) -> int:
    """The position after a value of ``kind`` that starts at ``pos``."""
    if kind in (_TRUE, _FALSE, _BYTE):  # in a list a bool is one byte; as a field it has none
        return pos + 1
    if kind in (_I16, _I32, _I64):
        return _varint(data, pos)[1]
    if kind == _DOUBLE:
        return pos + 8
    if kind == _BINARY:
        size, pos = _varint(data, pos)
        return pos + size
    if kind in (_LIST, _SET):
        size, element, pos = _list_header(data, pos)
        for _ in range(size):
            pos = _skip(data, pos, element)
        return pos
    if kind == _MAP:
        size, pos = _varint(data, pos)
        if size:
            types, pos = data[pos], pos + 1
            for _ in range(size):
                pos = _skip(data, _skip(data, pos, types >> 4), types & 0x0F)
        return pos
    if kind == _STRUCT:
        return _scan(data, pos, {}, [])
    raise ValueError(f"unknown Thrift compact type {kind}")


def _scan(data: bytes, pos: int, spec: dict, holes: list, top: list | None = None) -> int:
    """Walk the struct at ``pos``; note the varints ``spec`` names in ``holes``; return its end.

    ``spec`` maps a field id to "offset" / "ordinal" (an integer to rewrite), a nested spec (a
    struct) or a one-element list of one (a list of structs). ``top`` collects (field id, header
    start, value start) of every field.
    """
    last = 0
    while (head := data[pos]) != 0:
        start = pos
        kind, delta = head & 0x0F, head >> 4
        pos += 1
        if delta:
            last += delta
        else:
            last, pos = _zigzag(data, pos)
        if top is not None:
            top.append((last, start, pos))
        if kind in (_TRUE, _FALSE):  # a field's bool lives in its type code
            continue
        want = spec.get(last)
        if isinstance(want, str):
            value, end = _zigzag(data, pos)
            holes.append((pos, end, want, value))
            pos = end
        elif isinstance(want, dict):
            pos = _scan(data, pos, want, holes)
        elif isinstance(want, list):
            size, _, pos = _list_header(data, pos)
            for _ in range(size):
                pos = _scan(data, pos, want[0], holes)
        else:
            pos = _skip(data, pos, kind)
    return pos + 1


def parse_footer(data: bytes) -> Footer:
    """Find, in a FileMetaData's bytes, the row count, the row groups and the varints to shift."""
    footer = Footer(data)
    _scan(data, 0, {_FILE_ROW_GROUPS: [_ROW_GROUP]}, footer.holes, footer.fields)
    for field_id, _, value, end in footer.spans():
        if field_id == _FILE_NUM_ROWS:
            footer.num_rows = _zigzag(data, value)[0]
        elif field_id == _FILE_ROW_GROUPS:
            count, _, first = _list_header(data, value)
            footer.row_groups = (count, first, end)
        elif field_id == _FILE_KEY_VALUES:
            footer.key_values = _key_values(data, value)
    return footer


def _key_values(data: bytes, pos: int) -> list[tuple[bytes, bytes | None]]:
    """The (key, value or None) pairs of the list<KeyValue> at ``pos``."""
    count, _, pos = _list_header(data, pos)
    pairs = []
    for _ in range(count):
        fields: list[tuple[int, int, int]] = []
        pos = _scan(data, pos, {}, [], fields)
        found = {}
        for field_id, start, value in fields:
            if field_id in (_KEY, _VALUE) and data[start] & 0x0F == _BINARY:
                size, value = _varint(data, value)
                found[field_id] = data[value:value + size]
        if _KEY not in found:
            raise ValueError("a key-value metadata entry has no key")
        pairs.append((found[_KEY], found.get(_VALUE)))
    return pairs


def _key_values_bytes(pairs: list[tuple[bytes, bytes | None]]) -> bytes:
    """A list<KeyValue> value (the list header and its structs)."""
    out = bytearray(_list_header_bytes(len(pairs), _STRUCT))
    for key, value in pairs:
        out += _field_header(_KEY, 0, _BINARY) + _unsigned(len(key)) + key
        if value is not None:
            out += _field_header(_VALUE, _KEY, _BINARY) + _unsigned(len(value)) + value
        out.append(0)  # STOP
    return bytes(out)


def read_footer(path: Path) -> tuple[Footer, int]:
    """(the parsed footer, the byte offset where it starts) of a Parquet file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(4)
        f.seek(size - 8)
        tail = f.read(8)
        if size < 12 or head != MAGIC or tail[4:] != MAGIC:
            raise ValueError(f"{path} is not an unencrypted Parquet file")
        length = int.from_bytes(tail[:4], "little")
        start = size - 8 - length
        f.seek(start)
        return parse_footer(f.read(length)), start


def _row_groups(footer: Footer, delta: int, first_ordinal: int) -> bytes:
    """The footer's row-group structs, offsets shifted by ``delta``, ordinals from ``first_ordinal``."""
    _, pos, end = footer.row_groups
    out = bytearray()
    ordinal = first_ordinal
    for start, stop, kind, value in footer.holes:
        out += footer.data[pos:start]
        if kind == "offset":
            value += delta
        elif first_ordinal + footer.row_groups[0] - 1 <= _MAX_ORDINAL:
            value, ordinal = ordinal, ordinal + 1
        out += _encode_zigzag(value)
        pos = stop
    out += footer.data[pos:end]
    return bytes(out)


def _list_header_bytes(count: int, kind: int) -> bytes:
    return bytes([count << 4 | kind]) if count < 15 else bytes([0xF0 | kind]) + _unsigned(count)


def _field_header(field_id: int, last_id: int, kind: int) -> bytes:
    """A struct field's header: the id as a delta from the previous field's where it fits in 4 bits."""
    delta = field_id - last_id
    return bytes([delta << 4 | kind]) if 0 < delta <= 15 else bytes([kind]) + _encode_zigzag(field_id)


def _joined_footer(first: Footer, groups: bytes, count: int, num_rows: int,
                   key_values: list[tuple[bytes, bytes | None]]) -> bytes:
    """The first part's footer with the joined row groups, row count and key-value metadata (left
    out if empty); every other field as it was."""
    data = first.data
    values = {_FILE_NUM_ROWS: _encode_zigzag(num_rows), _FILE_ROW_GROUPS: _list_header_bytes(count, _STRUCT) + groups,
              _FILE_KEY_VALUES: _key_values_bytes(key_values) if key_values else None}
    fields = [(field_id, data[start] & 0x0F, data[value:end]) for field_id, start, value, end in first.spans()
              if field_id != _FILE_KEY_VALUES]
    fields.append((_FILE_KEY_VALUES, _LIST, None))
    out, last = bytearray(), 0
    # headers are written anew: the ids are deltas, and the key-value field may come or go
    for field_id, kind, value in sorted(fields, key=lambda f: f[0]):
        value = values.get(field_id, value)
        if value is not None:
            out += _field_header(field_id, last, kind) + value
            last = field_id
    out.append(0)  # STOP
    return bytes(out)


class ParquetJoin:
    """One Parquet file built from parts appended in order: their bytes copied, their footers merged.

    ``f`` is the output, open for binary writing at its start. Every part must have the same
    schema and key-value metadata (the first part's are kept), except the content hash, which
    covers one part only and is never kept (see :meth:`finish`).
    """

    def __init__(self, f):
        self.f = f
        self.f.write(MAGIC)
        self._first: Footer | None = None
        self._same: tuple = ()
        self._groups = bytearray()
        self._count = self._num_rows = 0

    def append(self, path: Path, footer: Footer, start: int) -> None:
        """Copy the row groups of the part at ``path`` (``footer`` and ``start`` from :func:`read_footer`)."""
        if self._first is None:
            self._first, self._same = footer, _unchanged_fields(footer)
        elif _unchanged_fields(footer) != self._same:
            raise ValueError(f"{path}: schema or metadata differs from the first part")
        delta = self.f.tell() - len(MAGIC)  # where this part's bytes land, relative to where they were
        with path.open("rb") as src:
            _copy_bytes(src, self.f, len(MAGIC), start - len(MAGIC), path)
        self._groups += _row_groups(footer, delta, self._count)
        self._count += footer.row_groups[0]
        self._num_rows += footer.num_rows

    def finish(self, content_hash: str | None = None) -> None:
        """Write the merged footer; the file is complete.

        ``content_hash``: the whole file's (``traces.format.ContentHash`` of every part's content
        in order), recorded under ``CONTENT_KEY`` where the first part has its own, else last;
        None records none.
        """
        recorded = [(CONTENT_KEY, content_hash.encode("ascii"))] if content_hash else []
        shared = self._same[1]
        at = next((i for i, (key, _) in enumerate(self._first.key_values) if key == CONTENT_KEY), len(shared))
        joined = _joined_footer(self._first, bytes(self._groups), self._count, self._num_rows,
                                shared[:at] + recorded + shared[at:])
        self.f.write(joined)
        self.f.write(len(joined).to_bytes(4, "little"))
        self.f.write(MAGIC)


# copy_file_range's errors that mean "not between these two files": copy through memory instead
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ETXTBSY}


def _copy_bytes(src, dst, offset: int, count: int, path: Path) -> None:
    """``count`` bytes of ``src`` from ``offset`` to ``dst`` at its position, which they advance.

    The kernel copies them where it can (``os.copy_file_range``: Linux, both files on one file
    system, as a part and the output beside it are): a 6.8 MB part cost 8.6 ms of CPU that way
    and 21 ms through ``read`` and ``write`` (2 cores, files in the page cache). Elsewhere they
    go through memory, a MiB at a time."""
    dst.flush()
    done = 0
    try:
        source, out = src.fileno(), dst.fileno()
        while done < count:
            copied = os.copy_file_range(source, out, count - done, offset + done)
            if not copied:
                break
            done += copied
    except (AttributeError, OSError) as e:  # no such call, not a file, or not between these two
        kernel_refused = isinstance(e, AttributeError | io.UnsupportedOperation) or e.errno in _NO_KERNEL_COPY
        if done or not kernel_refused:
            raise
        src.seek(offset)
        while done < count and (chunk := src.read(min(count - done, 1 << 20))):
            dst.write(chunk)
            done += len(chunk)
    if done < count:
        raise ValueError(f"{path} ends before its footer: the file was cut short")


def concat_parquet(parts: list[Path], out: Path, content_hash: str | None = None) -> None:
    """Write ``out`` (atomically): the row groups of ``parts``, in order, bytes copied as they are.

    ``content_hash`` as :meth:`ParquetJoin.finish` takes it: the parts' own are never kept.
    """
    with atomic_output(out) as tmp, tmp.open("wb") as f:
        join = ParquetJoin(f)
        for part in parts:
            join.append(part, *read_footer(part))
        join.finish(content_hash)


def _unchanged_fields(footer: Footer) -> tuple[bytes, list[tuple[bytes, bytes | None]]]:
    """What every part shares: the footer's bytes outside the row groups, the row count and the
    key-value metadata (schema, writer), and the key-value entries but the content hash."""
    return (b"".join(footer.data[start:end] for field_id, start, _, end in footer.spans()
                     if field_id not in _REWRITTEN),
            [(key, value) for key, value in footer.key_values if key != CONTENT_KEY])


def _unsigned(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _encode_zigzag(n: int) -> bytes:
    return _unsigned((n << 1) ^ (n >> 63))
