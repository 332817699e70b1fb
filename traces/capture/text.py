"""Capture input: documents from files, folders or JSONL, tokenised into windows.

A *document* is one text with a domain label: a plain file (domain: the ``domain`` option, else
the name of the folder it was found under), or one JSONL record (``{"text": ..., "domain": ...}``).
A *window* is a run of at most ``window_tokens`` consecutive tokens of one document; each window
becomes one trace sequence.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traces.errors import InputError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".html", ".tex", ".csv", ""}


@dataclass
class Document:
    text: str
    domain: str
    source: str  # where it came from (path, or path:line for JSONL)


@dataclass
class Window:
    """One trace sequence: token ids of a piece of one document."""

    seq: int
    domain: int  # index into the domain list
    tokens: np.ndarray  # int64[n]
    source: str


def _jsonl(path: Path, text_field: str, domain_field: str, default_domain: str) -> Iterator[Document]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
                raise InputError(f"{path}:{lineno}: no string field '{text_field}'")
            domain = rec.get(domain_field, default_domain)
            yield Document(rec[text_field], str(domain), f"{path}:{lineno}")


def _read_file(path: Path, domain: str) -> Document:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    return Document(text, domain, str(path))


def read_documents(
    paths: Iterable[str | Path],
    text_field: str = "text",
    domain_field: str = "domain",
    domain: str | None = None,
) -> list[Document]:
    """All documents under ``paths`` (files, folders searched recursively, ``.jsonl`` files).

    Folder contents are read in sorted path order; a plain file's domain is ``domain`` if given,
    else the name of its top folder below the folder named in ``paths`` (or that folder's name).
    """
    docs: list[Document] = []
    for p in map(Path, paths):
        if not p.exists():
            raise InputError(f"input path '{p}' does not exist")
        if p.is_dir():
            for f in sorted(q for q in p.rglob("*") if q.is_file()):
                if f.suffix == ".jsonl":
                    docs.extend(_jsonl(f, text_field, domain_field, domain or p.name))
                elif f.suffix in TEXT_SUFFIXES:
                    rel = f.relative_to(p).parts
                    docs.append(_read_file(f, domain or (rel[0] if len(rel) > 1 else p.name)))
        elif p.suffix == ".jsonl":
            docs.extend(_jsonl(p, text_field, domain_field, domain or p.stem))
        else:
            docs.append(_read_file(p, domain or p.parent.name or "text"))
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise InputError("the capture input holds no text")
    return docs


def make_windows(
    docs: list[Document],
    tokenizer,
    window_tokens: int,
    min_window_tokens: int = 2,
    max_tokens: int | None = None,
    add_bos: bool = True,
) -> tuple[list[Window], list[str]]:
    """Tokenise documents into windows of at most ``window_tokens`` tokens (BOS included).

    Returns the windows in document order and the domain names (index = ``Window.domain``).
    Tails shorter than ``min_window_tokens`` are dropped; ``max_tokens`` caps the total.
    """
    if window_tokens < 2:
        raise InputError(f"window_tokens={window_tokens} must be at least 2")
    bos = getattr(tokenizer, "bos_token_id", None) if add_bos else None
    body = window_tokens - (bos is not None)
    domains: list[str] = []
    windows: list[Window] = []
    total = 0
    for doc in docs:
        ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        if doc.domain not in domains:
            domains.append(doc.domain)
        d = domains.index(doc.domain)
        for start in range(0, len(ids), body):
            piece = ids[start : start + body]
            if bos is not None:
                piece = [bos, *piece]
            if max_tokens is not None:
                piece = piece[: max_tokens - total]
            if len(piece) < max(min_window_tokens, 2):
                continue
            windows.append(Window(len(windows), d, np.asarray(piece, dtype=np.int64), doc.source))
            total += len(piece)
            if max_tokens is not None and total >= max_tokens:
                return windows, domains
    if not windows:
        raise InputError("the capture input gives no window of at least min_window_tokens tokens")
    return windows, domains
