"""Token shards on disk: the format ``kubetitan prepare-data`` writes, and the checked reader of it.

A shards directory (format version 2, docs/data.md "Format") holds::

    index.json              what is below, the tokenizer's identity and the BOS/EOS convention
    shard-000000.bin        tokens, flat little-endian uint16 (vocabulary <= 65536) or uint32
    shard-000000.idx        document boundaries: little-endian uint64, documents + 1 offsets into the .bin
                            (token units; first 0, last = the shard's token count)
    shard-000000.crc        chunk checksums: little-endian uint32, the CRC-32 of each CHUNK_BYTES of the .bin
    ...

Every document is stored as ``BOS, its ids, EOS`` (the same sequence torchtitan's Hugging Face path feeds the
model: ``encode(text, add_bos=True, add_eos=True)``), and never spans two shards. ``index.json`` lists every
shard with its token and document counts and a CRC-32 (zlib) of the ``.bin``, the ``.idx`` and the ``.crc``.

:class:`ShardSet` opens such a directory and checks it before any training step: sizes at open (a ``stat`` per
file), CRC-32s at open or lazily before a read uses the bytes (per chunk of ``CHUNK_BYTES`` where the ``.crc``
exists, else the whole shard on its first read), token ids against the model's vocabulary on every read.
Anything wrong is a :class:`~kubetitan_trainer.errors.ConfigError` (exit code 2, not retried) naming the file and
the fix: bad data must stop a run, not crash-loop it. Version 1 directories (the index before checksums: EOS only,
no ``.idx``) are still read, with a warning that says what they lack.

This module imports neither torch nor torchtitan (``kubetitan prepare-data`` uses it, and its start must stay fast).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kubetitan_trainer.errors import ConfigError

INDEX_FILE = "index.json"
FORMAT = "kubetitan-shards"
VERSION = 2
DTYPES = ("uint16", "uint32")
CHECKSUM = "crc32"
"""zlib's CRC-32: about 2.8 GB/s on one core here against 0.7 GB/s for hashlib's blake2b (both measured on this
machine with 64 MiB buffers); it guards against truncation and corruption, not against a forger."""
CONVENTION = "bos+text+eos"
"""Each document is BOS (when the tokenizer has one), its ids (no special tokens of the tokenizer's own), EOS."""
SHARDS_FIELD = "kubetitan.data.shards_path (spec.data.shards.path)"
READ_CHUNK = 16 << 20
CHUNK_BYTES = 64 << 10
"""Bytes of ``.bin`` per chunk checksum (the ``.crc`` file: 4 bytes per 64 KiB, 0.006 %). A lazy reader verifies the
chunks a read touches before it returns them, each once: a window of ``seqLen + 1`` tokens (16-32 KiB at 8192)
costs at most two chunks on its first touch, about what the kernel's readahead (128 KiB) reads from disk anyway,
so a rank verifies what it trains on without reading whole shards it samples a few windows of."""

log = logging.getLogger("kubetitan.shards")

Verify = Literal["none", "size", "lazy", "checksum"]


def crc32_file(path: str | os.PathLike, chunk: int = READ_CHUNK) -> str:
    """CRC-32 of a file as 8 hex digits, read in chunks (bounded memory)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def crc32_bytes(data: bytes | memoryview) -> str:
    return f"{zlib.crc32(data):08x}"


@dataclass(frozen=True)
class TokenizerIdentity:
    """What makes two tokenizers the same for shards: the sha256 of their ``tokenizer.json`` (the vocabulary, the
    merges, the pre-tokenizer and normaliser: everything that maps text to ids). The path, the repository name and
    ``tokenizer_config.json`` are not part of it: a copy of the same file elsewhere is the same tokenizer, and the
    BOS/EOS ids the shards hold are recorded apart (``bos_id``, ``eos_id``). ``name`` only labels it in messages."""

    name: str
    sha256: str


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(READ_CHUNK):
            h.update(block)
    return h.hexdigest()


def tokenizer_identity(folder: str | os.PathLike, name: str) -> TokenizerIdentity | None:
    """The identity of the tokenizer in ``folder`` (None when it holds no ``tokenizer.json``); hashed once per file
    version in a process."""
    tj = Path(folder) / "tokenizer.json"
    try:
        st = tj.stat()
    except OSError:
        return None
    return TokenizerIdentity(name, _file_sha256(str(tj), st.st_mtime_ns, st.st_size))


def doc_index_name(bin_name: str) -> str:
    return bin_name[:-4] + ".idx" if bin_name.endswith(".bin") else bin_name + ".idx"


def chunk_index_name(bin_name: str) -> str:
    return bin_name[:-4] + ".crc" if bin_name.endswith(".bin") else bin_name + ".crc"


def dtype_for(vocab_size: int) -> str:
    """The smallest token dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass
class Shard:
    """One ``.bin`` file of a shard set and where its tokens sit in the concatenated stream."""

    name: str
    tokens: int
    documents: int | None
    start: int
    """Offset of its first token in the concatenated stream."""
    checksum: str | None = None
    doc_index: str | None = None
    doc_index_checksum: str | None = None
    chunk_index: str | None = None
    """The ``.crc`` file (CRC-32 per ``chunk_bytes`` of the ``.bin``); None in directories written before it."""
    chunk_index_checksum: str | None = None
    chunk_bytes: int = 0
    verified: bool = False


class DataError(Exception):
    """Bad input or options of ``kubetitan prepare-data``: printed as ``error: <message>`` with exit code 2. A plain
    one-string exception, so that it crosses the process boundary from a worker intact. (It lives here, not in
    ``prepare``, so that it is one class when ``prepare`` runs as ``__main__``.)"""


def data_error(problem: str, fix: str) -> DataError:
    return DataError(f"{problem}. Fix: {fix}")


def _fail(problem: str, fix: str, field_name: str = SHARDS_FIELD) -> ConfigError:
    return ConfigError(field_name, problem, fix)


RERUN = "re-run `kubetitan prepare-data` into an empty directory (or copy the whole directory it wrote again)"


def _chunk_fields(s: Shard, need: Any, fail: Any) -> None:
    """A version-2 ``files`` entry's chunk index (``chunk_index``, ``chunk_index_checksum``, ``chunk_bytes``) into
    ``s``; ``need(key, type)`` reads a key, ``fail(problem)`` makes the error."""
    s.chunk_index, s.chunk_index_checksum = need("chunk_index", str), need("chunk_index_checksum", str)
    s.chunk_bytes = need("chunk_bytes", int)
    if s.chunk_bytes <= 0 or "/" in str(s.chunk_index) or str(s.chunk_index).startswith("."):
        raise fail(f"a bad chunk index ({s.chunk_index!r}, {s.chunk_bytes} bytes a chunk)")


@dataclass
class ShardSet:
    """An opened, checked shards directory; :meth:`read` gives the concatenated token stream."""

    path: Path
    version: int
    dtype: str
    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    shards: list[Shard]
    tokenizer: dict[str, Any] = field(default_factory=dict)
    """Tokenizer identity: ``name`` (``builtin``, a path or a hub repository), ``sha256`` of tokenizer.json."""
    convention: str = CONVENTION
    model_vocab_size: int | None = None
    verify: str = "size"
    field_name: str = SHARDS_FIELD
    index: dict[str, Any] = field(default_factory=dict)
    _arrays: list[np.memmap | None] = field(default_factory=list, repr=False)
    _chunk_crcs: list[np.ndarray | None] = field(default_factory=list, repr=False)
    _chunk_ok: list[np.ndarray | None] = field(default_factory=list, repr=False)
    """Per shard: which chunks a lazy reader has verified (None until its first read)."""
    _chunks_left: list[int] = field(default_factory=list, repr=False)
    _starts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64), repr=False)
    _doc_starts: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    """Per shard read so far: its document offsets (the ``.idx``, CRC-checked once, memory-mapped)."""

    # ------------------------------------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str | os.PathLike, *, vocab_size: int | None = None, verify: Verify = "size",
             dtype: str = "auto", field_name: str = SHARDS_FIELD, tokenizer: TokenizerIdentity | None = None) -> ShardSet:
        """Open and check a shards directory.

        ``vocab_size``: the model's vocabulary; an index whose tokenizer has a larger one is refused, and every
        :meth:`read` refuses ids at or above it. ``verify``: ``size`` checks every file's size against the index
        (a ``stat`` each), ``checksum`` also reads every file for its CRC-32 now, ``lazy`` checks a shard's CRC-32
        on the first read that touches it, ``none`` checks nothing. ``dtype``: ``auto`` or the dtype the
        configuration expects. ``tokenizer``: the run's tokenizer; an index that records another one (another
        ``tokenizer.json`` sha256) is refused. Raises ConfigError naming the file and the fix.
        """
        d = Path(path)
        if not str(path):
            raise _fail("is empty", "set it to a directory written by `kubetitan prepare-data`", field_name)
        if not d.is_dir():
            raise _fail(f"{d} is not a directory" if d.exists() else f"{d} does not exist",
                        "point it at a directory written by `kubetitan prepare-data` (it holds index.json and "
                        "shard-*.bin); on a cluster, mount the volume holding it (spec.data.volume)", field_name)
        idx_path = d / INDEX_FILE
        if not idx_path.is_file():
            hint = (" (it holds the parts of an unfinished prepare-data run: finish it, or run "
                    "`kubetitan prepare-data --merge -o DIR`)" if (d / "parts").is_dir() else "")
            raise _fail(f"no {INDEX_FILE} in {d}{hint}",
                        "point it at a directory written by `kubetitan prepare-data` (it holds index.json and "
                        "shard-*.bin)", field_name)
        try:
            index = json.loads(idx_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _fail(f"{idx_path} cannot be read as JSON ({e})", RERUN, field_name) from None
        if not isinstance(index, dict):
            raise _fail(f"{idx_path} is not a kubetitan shards index (a JSON object)", RERUN, field_name)
        ss = cls._from_index(d, index, field_name)
        ss.model_vocab_size, ss.verify = vocab_size, verify
        if dtype not in ("auto", ss.dtype):
            raise ConfigError("kubetitan.data.shards_dtype (spec.data.shards.dtype)",
                              f"is {dtype} but {idx_path} says the shards hold {ss.dtype}", f"set it to auto or {ss.dtype}")
        if vocab_size is not None and ss.vocab_size > vocab_size:
            raise _fail(f"{idx_path} was written with a tokenizer of {ss.vocab_size} tokens "
                        f"({ss.tokenizer.get('name', 'unknown')}), more than the model's vocabulary of {vocab_size}",
                        "train with the tokenizer the shards were prepared with (spec.tokenizer) and a model whose "
                        "vocabulary holds it, or re-run `kubetitan prepare-data --tokenizer` with the model's tokenizer",
                        field_name)
        if tokenizer is not None:
            ss.check_tokenizer(tokenizer)
        if verify != "none":
            ss._check_sizes()
        if verify == "checksum":
            ss.verify_checksums()
        return ss

    @classmethod
    def _from_index(cls, d: Path, index: dict[str, Any], field_name: str) -> ShardSet:
        where = d / INDEX_FILE

        def need(key: str, kind: type | tuple[type, ...], obj: dict[str, Any] = index, what: str = "") -> Any:
            v = obj.get(key)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise _fail(f"{where} is not a valid kubetitan shards index: {what}{key!r} is "
                            f"{'missing' if v is None else repr(v)}", RERUN, field_name)
            return v

        version = index.get("version", 1)
        if version not in (1, VERSION):
            raise _fail(f"{where} has format version {version!r}; this trainer reads versions 1 and {VERSION}",
                        "use a kubetitan release that wrote it, or re-run `kubetitan prepare-data` with this one",
                        field_name)
        dtype = index.get("dtype", "uint16")
        if dtype not in DTYPES:
            raise _fail(f"{where} gives dtype {dtype!r}", f"{RERUN}; shards hold uint16 or uint32", field_name)
        files = need("files", list)
        vocab = need("vocab_size", int)
        eos = index.get("eos_id")
        bos = index.get("bos_id") if version >= 2 else None
        shards: list[Shard] = []
        start = 0
        for i, f in enumerate(files):
            if not isinstance(f, dict):
                raise _fail(f"{where}: files[{i}] is not an object", RERUN, field_name)
            name = need("name", str, f, f"files[{i}].")
            if "/" in name or name.startswith("."):
                raise _fail(f"{where}: files[{i}].name {name!r} is not a file name in the directory", RERUN, field_name)
            tokens = need("tokens", int, f, f"files[{i}].")
            if version >= 2:
                docs = need("documents", int, f, f"files[{i}].")
                s = Shard(name, tokens, docs, start, need("checksum", str, f, f"files[{i}]."),
                          need("doc_index", str, f, f"files[{i}]."), need("doc_index_checksum", str, f, f"files[{i}]."))
                if "chunk_index" in f:  # optional: directories written before chunk checksums have none
                    _chunk_fields(s, lambda key, kind: need(key, kind, f, f"files[{i}]."),
                                  lambda p: _fail(f"{where}: files[{i}] has {p}", RERUN, field_name))
            else:
                s = Shard(name, tokens, None, start)
            shards.append(s)
            start += tokens
        if version == 1:
            log.warning(f"{where} is a version-1 shards index (written before checksums): its sizes are checked but not "
                        "its contents, it records no document boundaries, and its documents end with EOS and start "
                        "with no BOS (the Hugging Face path adds both). Re-run `kubetitan prepare-data` to get a "
                        f"version-{VERSION} directory")
        tok = index.get("tokenizer")
        tokenizer = tok if isinstance(tok, dict) else ({"name": tok} if tok else {})
        ss = cls(path=d, version=int(version), dtype=dtype, vocab_size=vocab,
                 eos_id=eos if isinstance(eos, int) else None, bos_id=bos if isinstance(bos, int) else None,
                 shards=shards, tokenizer=tokenizer, convention=index.get("convention", "text+eos"),
                 field_name=field_name, index=index)
        ss._starts = np.asarray([s.start for s in shards] + [start], dtype=np.int64)
        ss._arrays, ss._chunk_crcs, ss._chunk_ok = [None] * len(shards), [None] * len(shards), [None] * len(shards)
        ss._chunks_left = [0] * len(shards)
        if ss.total_tokens == 0:
            raise _fail(f"{d} holds no tokens ({where} lists {len(shards)} shard(s), all empty)",
                        "prepare-data found no text: check its inputs (and --text-field), then re-run it", field_name)
        return ss

    def files(self) -> list[tuple[str, int, str | None, str]]:
        """(name, size in bytes, CRC-32 or None, what) of every file the index lists, in stream order: each shard's
        ``.bin`` (what ``shard``), its ``.idx`` (``document index``) and its ``.crc`` (``chunk index``)."""
        item = np.dtype(self.dtype).itemsize
        out: list[tuple[str, int, str | None, str]] = []
        for s in self.shards:
            out.append((s.name, s.tokens * item, s.checksum, "shard"))
            if s.doc_index is not None:
                out.append((s.doc_index, (int(s.documents or 0) + 1) * 8, s.doc_index_checksum, "document index"))
            if s.chunk_index is not None:
                out.append((s.chunk_index, 4 * -(-s.tokens * item // s.chunk_bytes), s.chunk_index_checksum,
                            "chunk index"))
        return out

    def _check_sizes(self) -> None:
        for name, want, _crc, what in self.files():
            p = self.path / name
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                raise _fail(f"{INDEX_FILE} lists {name}, which is missing from {self.path}",
                            "copy the whole directory written by `kubetitan prepare-data`, or re-run it",
                            self.field_name) from None
            if size == want:
                continue
            if what != "shard":
                raise _fail(f"{what} {p} has {size} bytes where {INDEX_FILE} says {want}",
                            "copy it again, or " + RERUN, self.field_name)
            item = np.dtype(self.dtype).itemsize
            tokens = want // item
            if size == 0:
                problem = "is empty"
            elif size % item:
                problem = f"has {size} bytes, not a whole number of {self.dtype} tokens"
            elif size < want:
                problem = f"is truncated: {size} bytes where {INDEX_FILE} says {want} ({tokens} {self.dtype} tokens)"
            else:
                problem = f"has {size} bytes where {INDEX_FILE} says {want} ({tokens} {self.dtype} tokens)"
            raise _fail(f"shard {p} {problem}", "copy the shard again from where prepare-data wrote it, or " + RERUN,
                        self.field_name)

    # ---------------------------------------------------------------------------------------------- properties
    @property
    def total_tokens(self) -> int:
        return int(self._starts[-1])

    @property
    def num_documents(self) -> int | None:
        """Documents in the set; None for a version-1 directory (it did not count them per shard)."""
        if self.version < 2:
            docs = self.index.get("documents")
            return int(docs) if isinstance(docs, int) else None
        return sum(int(s.documents or 0) for s in self.shards)

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.get("name", ""))

    @property
    def tokenizer_sha256(self) -> str:
        return str(self.tokenizer.get("sha256", ""))

    # -------------------------------------------------------------------------------------------------- checks
    def check_tokenizer(self, run: TokenizerIdentity) -> None:
        """Refuse shards prepared with another tokenizer than the run's (:class:`TokenizerIdentity`: the sha256 of
        ``tokenizer.json``): their ids would mean other text, silently, whenever the vocabulary fits. A version-1
        index records no hash: it is let through (its warning already says to re-run prepare-data)."""
        want = self.tokenizer_sha256
        if not want or want == run.sha256:
            return
        theirs = self.tokenizer_name or "unknown"
        raise _fail(f"{self.path} was prepared with another tokenizer than this run's: the shards' is {theirs} "
                    f"(tokenizer.json sha256 {want[:16]}…, {INDEX_FILE}), the run's is {run.name} (sha256 "
                    f"{run.sha256[:16]}…), so its token ids would stand for other text",
                    f"re-run `kubetitan prepare-data --tokenizer <the run's tokenizer>` into a new directory and "
                    f"train on that, or point spec.tokenizer at the tokenizer the shards were prepared with ({theirs}, "
                    "the same tokenizer.json)", self.field_name)

    def _corrupt(self, name: str, got: str, want: str | None, what: str = "", fix: str = "") -> ConfigError:
        return _fail(f"shard {self.path / name} is corrupt: {what}its CRC-32 is {got}, {INDEX_FILE} says {want}",
                     fix or "copy the shard again from where prepare-data wrote it, or " + RERUN, self.field_name)

    def _verify_shard(self, i: int) -> None:
        """The whole shard ``i``'s CRC-32s (``.bin``, ``.idx``, ``.crc``) against the index, once."""
        s = self.shards[i]
        if s.verified or s.checksum is None:
            return
        got = crc32_file(self.path / s.name)
        if got != s.checksum:
            raise self._corrupt(s.name, got, s.checksum)
        for name, want, what in ((s.doc_index, s.doc_index_checksum, "document index"),
                                 (s.chunk_index, s.chunk_index_checksum, "chunk index")):
            if name is not None and (got := crc32_file(self.path / name)) != want:
                raise _fail(f"{what} {self.path / name} is corrupt: its CRC-32 is {got}, {INDEX_FILE} says {want}",
                            "copy it again, or " + RERUN, self.field_name)
        if s.chunk_index is not None:
            self._check_chunks(i, 0, self._chunk_table(i).size)  # the .bin agrees with its own chunk index
        s.verified = True

    def _chunk_table(self, i: int) -> np.ndarray:
        """Shard ``i``'s chunk CRC-32s (its ``.crc``, itself checked against the index once)."""
        t = self._chunk_crcs[i]
        if t is None:
            s = self.shards[i]
            q = self.path / str(s.chunk_index)
            raw = q.read_bytes()
            if (got := crc32_bytes(raw)) != s.chunk_index_checksum:
                raise _fail(f"chunk index {q} is corrupt: its CRC-32 is {got}, {INDEX_FILE} says "
                            f"{s.chunk_index_checksum}", "copy it again, or " + RERUN, self.field_name)
            t = self._chunk_crcs[i] = np.frombuffer(raw, dtype="<u4")
            self._chunk_ok[i], self._chunks_left[i] = np.zeros(t.size, dtype=bool), t.size
        return t

    def _check_chunks(self, i: int, first: int, end: int) -> None:
        """Chunks ``[first, end)`` of shard ``i`` against its chunk index, each once."""
        s, table = self.shards[i], self._chunk_table(i)
        ok = self._chunk_ok[i]
        assert ok is not None
        raw = self._array(i).view(np.uint8)
        cb = s.chunk_bytes
        for c in np.flatnonzero(~ok[first:end]) + first:
            c = int(c)
            got = zlib.crc32(raw[c * cb:(c + 1) * cb])
            if got != int(table[c]):
                end_byte = min((c + 1) * cb, raw.size)
                raise self._corrupt(s.name, f"{got:08x}", f"{int(table[c]):08x}",
                                    f"bytes {c * cb}-{end_byte} (chunk {c}) changed since prepare-data wrote them: ")
            ok[c] = True
            self._chunks_left[i] -= 1
        if self._chunks_left[i] == 0:
            s.verified = True

    def _verify_span(self, i: int, off: int, n: int) -> None:
        """Before tokens ``[off, off + n)`` of shard ``i`` are used (``verify="lazy"``): the chunks holding them
        against the chunk index, or, for a shard without one, the whole shard on its first read."""
        s = self.shards[i]
        if s.verified or s.checksum is None or n <= 0:
            return
        if s.chunk_index is None:
            self._verify_shard(i)
            return
        self._chunk_table(i)
        item = np.dtype(self.dtype).itemsize
        first, end = off * item // s.chunk_bytes, ((off + n) * item - 1) // s.chunk_bytes + 1
        ok = self._chunk_ok[i]
        assert ok is not None
        if not ok[first:end].all():
            self._check_chunks(i, first, end)

    def verify_checksums(self) -> None:
        """Read every shard once and compare its CRC-32s with the index, chunk by chunk too where it has a chunk
        index (version 2; version 1 has none)."""
        for i in range(len(self.shards)):
            self._verify_shard(i)

    def locate(self, offset: int) -> tuple[int, int]:
        """(shard number, offset inside it) of a global token offset."""
        if not 0 <= offset < self.total_tokens:
            raise IndexError(f"token offset {offset} is outside [0, {self.total_tokens})")
        i = int(np.searchsorted(self._starts, offset, side="right") - 1)
        return i, offset - int(self._starts[i])

    def check_range(self, arr: np.ndarray, where: int) -> None:
        """Refuse token ids outside [0, vocab) in ``arr``, the tokens at global offset ``where``: ConfigError naming
        the shard and the offset of the first bad id. The vocabulary is the model's when given, else the index's."""
        limit = self.model_vocab_size if self.model_vocab_size is not None else self.vocab_size
        if arr.size == 0:
            return
        if int(arr.max()) < limit and int(arr.min()) >= 0:
            return
        bad = int(np.flatnonzero((arr >= limit) | (arr < 0))[0])
        i, off = self.locate(where + bad)
        whose = "the model's" if self.model_vocab_size is not None else f"the tokenizer's ({INDEX_FILE})"
        raise _fail(f"shard {self.path / self.shards[i].name} holds token id {int(arr[bad])} at token offset {off}, "
                    f"outside {whose} vocabulary of {limit}",
                    "prepare the data with the model's tokenizer (`kubetitan prepare-data --tokenizer`) or use a "
                    "model whose vocabulary holds it; if the shard was not written by prepare-data, it is corrupt: "
                    + RERUN, self.field_name)

    # --------------------------------------------------------------------------------------------------- reading
    def _array(self, i: int) -> np.memmap:
        a = self._arrays[i]
        if a is None:
            p = self.path / self.shards[i].name
            try:
                a = np.memmap(p, dtype=np.dtype(self.dtype).newbyteorder("<"), mode="r",
                              shape=(self.shards[i].tokens,))
            except (OSError, ValueError) as e:
                raise _fail(f"shard {p} cannot be memory-mapped ({e})",
                            "copy the shard again from where prepare-data wrote it, or " + RERUN,
                            self.field_name) from None
            self._arrays[i] = a
        return a

    def read(self, offset: int, n: int) -> np.ndarray:
        """Tokens ``[offset, offset + n)`` of the concatenated stream as int64, spanning shards; checked against the
        vocabulary (see :meth:`check_range`)."""
        if n < 0 or offset < 0 or offset + n > self.total_tokens:
            raise IndexError(f"tokens [{offset}, {offset + n}) are outside [0, {self.total_tokens})")
        out = np.empty(n, dtype=np.int64)
        pos, done = offset, 0
        while done < n:
            i, off = self.locate(pos)
            a = self._array(i)
            take = min(n - done, len(a) - off)
            if self.verify == "lazy":
                self._verify_span(i, off, take)
            out[done:done + take] = a[off:off + take]
            pos, done = pos + take, done + take
        self.check_range(out, offset)
        return out

    def segments(self, offset: int, n: int) -> np.ndarray:
        """For tokens ``[offset, offset + n)``: which document of the span each belongs to (int32, 0 for the first,
        +1 at every document start after it; a shard's start is a document's), from the ``.idx`` files (each
        CRC-checked on its first use here, then memory-mapped: a window costs two binary searches per shard)."""
        out = np.zeros(n, dtype=np.int32)
        end, pos = offset + n, offset
        while pos < end:
            i, off = self.locate(pos)
            starts = self._shard_doc_starts(i)  # local offsets, the shard's end last
            upto = min(end, int(self._starts[i + 1]))
            lo = int(np.searchsorted(starts, off, side="right"))
            hi = int(np.searchsorted(starts, upto - int(self._starts[i]), side="left"))
            out[starts[lo:hi].astype(np.int64) + (int(self._starts[i]) - offset)] += 1  # documents starting inside
            if upto < end:  # the next shard starts a document
                out[upto - offset] += 1
            pos = upto
        return np.cumsum(out, dtype=np.int32)

    def _shard_doc_starts(self, i: int) -> np.ndarray:
        got = self._doc_starts.get(i)
        if got is None:
            s = self.shards[i]
            self.document_offsets(i)  # checks it exists and its CRC-32 (a version-1 directory has none)
            got = self._doc_starts[i] = np.memmap(self.path / s.doc_index, dtype="<u8", mode="r")  # type: ignore[operator]
        return got

    def document_offsets(self, i: int) -> np.ndarray:
        """Document start offsets (plus the end) of shard ``i`` in global token units; version 2 only."""
        s = self.shards[i]
        if s.doc_index is None:
            raise ValueError(f"{self.path} is a version-1 shards directory: it records no document boundaries")
        q = self.path / s.doc_index
        raw = q.read_bytes()
        if s.doc_index_checksum is not None and (got := crc32_bytes(raw)) != s.doc_index_checksum:
            raise _fail(f"document index {q} is corrupt: its CRC-32 is {got}, {INDEX_FILE} says {s.doc_index_checksum}",
                        "copy it again, or " + RERUN, self.field_name)
        return np.frombuffer(raw, dtype="<u8").astype(np.int64) + s.start


# ------------------------------------------------------------------------------------------------------- writing
class ShardWriter:
    """Writes one shard: documents appended in order to ``<name>.bin`` (tokens) and ``<name>.idx`` (offsets),
    and ``<name>.crc`` (a CRC-32 per ``chunk_bytes`` of the ``.bin``), under temporary names until :meth:`close`
    renames them, so a crash never leaves a half shard under its real name. Memory stays bounded: tokens go to the
    file as they come, CRC-32s are computed on the way."""

    def __init__(self, directory: Path, name: str, dtype: str, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.dir, self.name, self.dtype = Path(directory), name, np.dtype(dtype).newbyteorder("<")
        self.idx_name = doc_index_name(name)
        self.crc_name = chunk_index_name(name)
        self._tmp_bin = self.dir / f".{name}.tmp"
        self._tmp_idx = self.dir / f".{self.idx_name}.tmp"
        self._tmp_crc = self.dir / f".{self.crc_name}.tmp"
        self._bin = open(self._tmp_bin, "wb")
        self._crc = 0
        self.chunk_bytes = chunk_bytes
        self._chunk_crcs: list[int] = []
        self._chunk_crc, self._chunk_fill = 0, 0
        self.tokens = 0
        self._ends: list[np.ndarray] = []
        self._doc_end = 0
        self.documents = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as their tokens concatenated (``flat``) and their lengths."""
        self.write(flat)
        self.end_documents(lengths)

    def end_documents(self, lengths: np.ndarray) -> None:
        """Record documents of these lengths, written since the last recorded one (:meth:`write`), as complete."""
        ends = self._doc_end + np.cumsum(lengths, dtype=np.int64)
        if ends.size:
            assert int(ends[-1]) <= self.tokens, "documents end past the tokens written"
            self._doc_end = int(ends[-1])
        self._ends.append(ends)
        self.documents += int(lengths.size)

    def write(self, flat: np.ndarray) -> None:
        """Append tokens (a document's or a part of one: :meth:`end_documents` records where documents end)."""
        arr = np.ascontiguousarray(flat, dtype=self.dtype)
        data = arr.tobytes()
        self._bin.write(data)
        self._crc = zlib.crc32(data, self._crc)
        view, pos = memoryview(data), 0
        while pos < len(view):
            take = min(len(view) - pos, self.chunk_bytes - self._chunk_fill)
            self._chunk_crc = zlib.crc32(view[pos:pos + take], self._chunk_crc)
            self._chunk_fill += take
            pos += take
            if self._chunk_fill == self.chunk_bytes:
                self._chunk_crcs.append(self._chunk_crc)
                self._chunk_crc, self._chunk_fill = 0, 0
        self.tokens += int(arr.size)

    def close(self) -> dict[str, Any]:
        """Flush, fsync and rename; returns the shard's ``files`` entry for index.json."""
        assert self._doc_end == self.tokens, "the last document was not recorded (end_documents)"
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        offsets = np.concatenate([np.zeros(1, dtype=np.int64), *self._ends]).astype("<u8").tobytes()
        if self._chunk_fill:
            self._chunk_crcs.append(self._chunk_crc)
        chunks = np.asarray(self._chunk_crcs, dtype="<u4").tobytes()
        for tmp, data in ((self._tmp_idx, offsets), (self._tmp_crc, chunks)):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        os.replace(self._tmp_idx, self.dir / self.idx_name)
        os.replace(self._tmp_crc, self.dir / self.crc_name)
        os.replace(self._tmp_bin, self.dir / self.name)
        return {"name": self.name, "tokens": self.tokens, "documents": self.documents,
                "checksum": f"{self._crc:08x}", "doc_index": self.idx_name, "doc_index_checksum": crc32_bytes(offsets),
                "chunk_index": self.crc_name, "chunk_index_checksum": crc32_bytes(chunks),
                "chunk_bytes": self.chunk_bytes}

    def abort(self) -> None:
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx, self._tmp_crc):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def make_index(files: list[dict[str, Any]], *, dtype: str, vocab_size: int, bos_id: int | None, eos_id: int | None,
               tokenizer: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The version-2 ``index.json`` content for shards listed in stream order."""
    return {"format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": vocab_size,
            "bos_id": bos_id, "eos_id": eos_id, "convention": CONVENTION, "checksum": CHECKSUM,
            "tokenizer": tokenizer, "total_tokens": sum(int(f["tokens"]) for f in files),
            "documents": sum(int(f["documents"]) for f in files), **(extra or {}), "files": files}
