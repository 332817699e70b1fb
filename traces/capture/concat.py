"""Join Parquet files of one schema into one file by copying their row groups' bytes.

A Parquet file is ``PAR1``, the row groups' encoded column chunks, the footer (a Thrift
compact-protocol ``FileMetaData``), the footer's length and ``PAR1`` again. Encoded pages hold no
file offsets; only the footer does. So files written by separate writers can be joined without
decoding or encoding anything: copy each file's bytes between the magic and its footer, and
write one footer holding every file's row groups with their offsets shifted to where the bytes
landed. This is what lets the capture encode row groups on several threads (each a file of its
own) and still produce one ordinary trace file.

The footer is read and written by a small generic Thrift compact-protocol codec that keeps
every field it does not know, so nothing a newer writer adds is lost.
"""
from __future__ import annotations

from pathlib import Path

from traces.atomic import atomic_output

MAGIC = b"PAR1"
# Thrift compact-protocol type codes
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)
_INTS = (_I16, _I32, _I64)

# Parquet footer field ids (parquet.thrift)
_FILE_NUM_ROWS, _FILE_ROW_GROUPS = 3, 4
_GROUP_COLUMNS, _GROUP_FILE_OFFSET, _GROUP_ORDINAL = 1, 5, 7
_CHUNK_FILE_OFFSET, _CHUNK_META, _CHUNK_OFFSET_INDEX, _CHUNK_COLUMN_INDEX = 2, 3, 4, 6
# ColumnMetaData: data, index, dictionary page and bloom filter offsets
_COLUMN_OFFSETS = (9, 10, 11, 14)
_MAX_ORDINAL = 2**15 - 1  # ordinal is an i16; beyond it the optional field is left out


class _Decoder:
    """Reads Thrift compact-protocol values: structs become lists of [field id, type, value]."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def byte(self) -> int:
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return result

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int):
        if kind in (_TRUE, _FALSE):  # a struct field's bool lives in its type code
            return kind == _TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in _INTS:
            return self.zigzag()
        if kind in (_DOUBLE, _BINARY):
            size = 8 if kind == _DOUBLE else self.varint()
            self.pos += size
            return self.data[self.pos - size:self.pos]
        if kind in (_LIST, _SET):
            head = self.byte()
            size, element = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            return element, [self.element(element) for _ in range(size)]
        if kind == _MAP:
            size = self.varint()
            types = self.byte() if size else 0
            return types, [(self.element(types >> 4), self.element(types & 0x0F)) for _ in range(size)]
        if kind == _STRUCT:
            return self.struct()
        raise ValueError(f"unknown Thrift compact type {kind}")

    def element(self, kind: int):
        """A list, set or map element: bools are a whole byte there."""
        return self.byte() if kind in (_TRUE, _FALSE) else self.value(kind)

    def struct(self) -> list[list]:
        fields, last = [], 0
        while (head := self.byte()) != _STOP:
            kind, delta = head & 0x0F, head >> 4
            last = last + delta if delta else self.zigzag()
            fields.append([last, kind, self.value(kind)])
        return fields


class _Encoder:
    """Writes what :class:`_Decoder` reads."""

    def __init__(self):
        self.out = bytearray()

    def varint(self, n: int) -> None:
        while n > 0x7F:
            self.out.append((n & 0x7F) | 0x80)
            n >>= 7
        self.out.append(n)

    def zigzag(self, n: int) -> None:
        self.varint((n << 1) ^ (n >> 63))

    def value(self, kind: int, value) -> None:
        if kind in (_TRUE, _FALSE):
            return
        if kind == _BYTE:
            self.out.append(value)
        elif kind in _INTS:
            self.zigzag(value)
        elif kind in (_DOUBLE, _BINARY):
            if kind == _BINARY:
                self.varint(len(value))
            self.out += value
        elif kind in (_LIST, _SET):
            element, items = value
            if len(items) < 15:
                self.out.append(len(items) << 4 | element)
            else:
                self.out.append(0xF0 | element)
                self.varint(len(items))
            for item in items:
                self.element(element, item)
        elif kind == _MAP:
            types, items = value
            self.varint(len(items))
            if items:
                self.out.append(types)
            for key, item in items:
                self.element(types >> 4, key)
                self.element(types & 0x0F, item)
        elif kind == _STRUCT:
            self.struct(value)
        else:
            raise ValueError(f"unknown Thrift compact type {kind}")

    def element(self, kind: int, value) -> None:
        if kind in (_TRUE, _FALSE):
            self.out.append(value)
        else:
            self.value(kind, value)

    def struct(self, fields: list[list]) -> None:
        last = 0
        for field_id, kind, value in fields:
            if kind in (_TRUE, _FALSE):
                kind = _TRUE if value else _FALSE
            if 0 < field_id - last <= 15:
                self.out.append((field_id - last) << 4 | kind)
            else:
                self.out.append(kind)
                self.zigzag(field_id)
            last = field_id
            self.value(kind, value)
        self.out.append(_STOP)


def decode_struct(data: bytes) -> list[list]:
    """A Thrift compact-protocol struct as nested [field id, type, value] lists."""
    return _Decoder(data).struct()


def encode_struct(fields: list[list]) -> bytes:
    """The bytes of a struct from :func:`decode_struct` (after changes)."""
    encoder = _Encoder()
    encoder.struct(fields)
    return bytes(encoder.out)


def _field(fields: list[list], field_id: int) -> list | None:
    return next((f for f in fields if f[0] == field_id), None)


def _shift(fields: list[list], field_ids, delta: int) -> None:
    for field_id in field_ids:
        f = _field(fields, field_id)
        if f is not None:
            f[2] += delta


def read_footer(path: Path) -> tuple[list[list], int]:
    """(the decoded FileMetaData, the byte offset where it starts) of a Parquet file."""
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
        return decode_struct(f.read(length)), start


def concat_parquet(parts: list[Path], out: Path) -> None:
    """Write ``out`` (atomically): the row groups of ``parts``, in order, bytes copied as they are.

    Every part must have the same schema and key-value metadata (the first part's are kept).
    """
    footers = [read_footer(p) for p in parts]
    first = footers[0][0]
    row_groups: list = []
    num_rows = 0
    with atomic_output(out) as tmp, tmp.open("wb") as dst:
        dst.write(MAGIC)
        for path, (footer, start) in zip(parts, footers, strict=True):
            if _field(footer, 2) != _field(first, 2) or _field(footer, 5) != _field(first, 5):
                raise ValueError(f"{path}: schema or metadata differs from {parts[0]}")
            delta = dst.tell() - len(MAGIC)  # where this part's bytes land, relative to where they were
            with path.open("rb") as src:  # a part is about one row group: read it whole
                src.seek(len(MAGIC))
                dst.write(src.read(start - len(MAGIC)))
            for group in _field(footer, _FILE_ROW_GROUPS)[2][1]:
                _shift(group, (_GROUP_FILE_OFFSET,), delta)
                for chunk in _field(group, _GROUP_COLUMNS)[2][1]:
                    _shift(chunk, (_CHUNK_FILE_OFFSET, _CHUNK_OFFSET_INDEX, _CHUNK_COLUMN_INDEX), delta)
                    meta = _field(chunk, _CHUNK_META)
                    if meta is not None:
                        _shift(meta[2], _COLUMN_OFFSETS, delta)
                ordinal = _field(group, _GROUP_ORDINAL)
                if ordinal is not None:
                    if len(row_groups) > _MAX_ORDINAL:
                        group.remove(ordinal)
                    else:
                        ordinal[2] = len(row_groups)
                row_groups.append(group)
            num_rows += _field(footer, _FILE_NUM_ROWS)[2]
        _field(first, _FILE_NUM_ROWS)[2] = num_rows
        _field(first, _FILE_ROW_GROUPS)[2] = (_STRUCT, row_groups)
        footer = encode_struct(first)
        dst.write(footer)
        dst.write(len(footer).to_bytes(4, "little"))
        dst.write(MAGIC)
