"""Token shards on disk: the format ``kubetitan prepare-data`` writes, and the checked reader of it.

A shards directory (format version 2, docs/data.md "Format") holds::

    index.json              what is below, the tokenizer's identity and the BOS/EOS convention
    shard-000000.bin        tokens, flat little-endian uint16 (vocabulary <= 65536) or uint32
    shard-000000.idx        document boundaries: little-endian uint64, documents + 1 offsets into the .bin
                            (token units; first 0, last = the shard's token count)
    ...

Every document is stored as ``BOS, its ids, EOS`` (the same sequence torchtitan's Hugging Face path feeds the
model: ``encode(text, add_bos=True, add_eos=True)``), and never spans two shards. ``index.json`` lists every
shard with its token and document counts and a CRC-32 (zlib) of the ``.bin`` and the ``.idx``.

:class:`ShardSet` opens such a directory and checks it before any training step: sizes at open (a ``stat`` per
file), CRC-32s at open or lazily on first read of a shard, token ids against the model's vocabulary on every read.
Anything wrong is a :class:`~kubetitan_trainer.errors.ConfigError` (exit code 2, not retried) naming the file and
the fix: bad data must stop a run, not crash-loop it. Version 1 directories (the index before checksums: EOS only,
no ``.idx``) are still read, with a warning that says what they lack.

This module imports neither torch nor torchtitan (``kubetitan prepare-data`` uses it, and its start must stay fast).
"""

from __future__ import annotations

import contextlib
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


def shard_name(unit: int) -> str:
    return f"shard-{unit:06d}.bin"


def doc_index_name(bin_name: str) -> str:
    return bin_name[:-4] + ".idx" if bin_name.endswith(".bin") else bin_name + ".idx"


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
    _starts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64), repr=False)

    # ------------------------------------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str | os.PathLike, *, vocab_size: int | None = None, verify: Verify = "size",
             dtype: str = "auto", field_name: str = SHARDS_FIELD) -> ShardSet:
        """Open and check a shards directory.

        ``vocab_size``: the model's vocabulary; an index whose tokenizer has a larger one is refused, and every
        :meth:`read` refuses ids at or above it. ``verify``: ``size`` checks every file's size against the index
        (a ``stat`` each), ``checksum`` also reads every file for its CRC-32 now, ``lazy`` checks a shard's CRC-32
        on the first read that touches it, ``none`` checks nothing. ``dtype``: ``auto`` or the dtype the
        configuration expects. Raises ConfigError naming the file and the fix.
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
        if verify != "none":
            ss._check_sizes()
        ss._arrays = [None] * len(ss.shards)
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
        if ss.total_tokens == 0:
            raise _fail(f"{d} holds no tokens ({where} lists {len(shards)} shard(s), all empty)",
                        "prepare-data found no text: check its inputs (and --text-field), then re-run it", field_name)
        return ss

    def _check_sizes(self) -> None:
        item = np.dtype(self.dtype).itemsize
        for s in self.shards:
            p = self.path / s.name
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                raise _fail(f"{INDEX_FILE} lists {s.name}, which is missing from {self.path}",
                            "copy the whole directory written by `kubetitan prepare-data`, or re-run it",
                            self.field_name) from None
            want = s.tokens * item
            if size != want:
                if size == 0:
                    what = "is empty"
                elif size % item:
                    what = f"has {size} bytes, not a whole number of {self.dtype} tokens"
                elif size < want:
                    what = f"is truncated: {size} bytes where {INDEX_FILE} says {want} ({s.tokens} {self.dtype} tokens)"
                else:
                    what = f"has {size} bytes where {INDEX_FILE} says {want} ({s.tokens} {self.dtype} tokens)"
                raise _fail(f"shard {p} {what}", "copy the shard again from where prepare-data wrote it, or " + RERUN,
                            self.field_name)
            if s.doc_index is not None:
                q = self.path / s.doc_index
                want_idx = (s.documents + 1) * 8
                try:
                    got = q.stat().st_size
                except FileNotFoundError:
                    raise _fail(f"{INDEX_FILE} lists {s.doc_index}, which is missing from {self.path}",
                                "copy the whole directory written by `kubetitan prepare-data`, or re-run it",
                                self.field_name) from None
                if got != want_idx:
                    raise _fail(f"document index {q} has {got} bytes where {INDEX_FILE} says {want_idx} "
                                f"({s.documents} documents)", "copy it again, or " + RERUN, self.field_name)

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
    def _verify_shard(self, i: int) -> None:
        s = self.shards[i]
        if s.verified or s.checksum is None:
            return
        p = self.path / s.name
        got = crc32_file(p)
        if got != s.checksum:
            raise _fail(f"shard {p} is corrupt: its CRC-32 is {got}, {INDEX_FILE} says {s.checksum}",
                        "copy the shard again from where prepare-data wrote it, or " + RERUN, self.field_name)
        if s.doc_index is not None:
            q = self.path / s.doc_index
            got = crc32_file(q)
            if got != s.doc_index_checksum:
                raise _fail(f"document index {q} is corrupt: its CRC-32 is {got}, {INDEX_FILE} says "
                            f"{s.doc_index_checksum}", "copy it again, or " + RERUN, self.field_name)
        s.verified = True

    def verify_checksums(self) -> None:
        """Read every shard once and compare its CRC-32 with the index (version 2; version 1 has none)."""
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
        a = self._arrays[i] if self._arrays else None
        if a is None:
            if not self._arrays:
                self._arrays = [None] * len(self.shards)
            if self.verify == "lazy":
                self._verify_shard(i)
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
            out[done:done + take] = a[off:off + take]
            pos, done = pos + take, done + take
        self.check_range(out, offset)
        return out

    def document_offsets(self, i: int) -> np.ndarray:
        """Document start offsets (plus the end) of shard ``i`` in global token units; version 2 only."""
        s = self.shards[i]
        if s.doc_index is None:
            raise ValueError(f"{self.path} is a version-1 shards directory: it records no document boundaries")
        offs = np.fromfile(self.path / s.doc_index, dtype="<u8").astype(np.int64)
        return offs + s.start


# ------------------------------------------------------------------------------------------------------- writing
def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a file so that a reader sees the old one or the whole new one (temp file in the same dir, fsync,
    rename); a write that fails (a full disk) leaves no temp file behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode())


class ShardWriter:
    """Writes one shard: documents appended in order to ``<name>.bin`` (tokens) and ``<name>.idx`` (offsets),
    both under temporary names until :meth:`close` renames them, so a crash never leaves a half shard under its
    real name. Memory stays bounded: tokens go to the file as they come, CRC-32s are computed on the way."""

    def __init__(self, directory: Path, name: str, dtype: str) -> None:
        self.dir, self.name, self.dtype = Path(directory), name, np.dtype(dtype).newbyteorder("<")
        self.idx_name = doc_index_name(name)
        self._tmp_bin = self.dir / f".{name}.tmp"
        self._tmp_idx = self.dir / f".{self.idx_name}.tmp"
        self._bin = open(self._tmp_bin, "wb")
        self._crc = 0
        self.tokens = 0
        self._ends: list[np.ndarray] = []
        self.documents = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as their tokens concatenated (``flat``) and their lengths."""
        data = np.ascontiguousarray(flat, dtype=self.dtype).tobytes()
        self._bin.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._ends.append(self.tokens + np.cumsum(lengths, dtype=np.int64))
        self.tokens += int(flat.size)
        self.documents += int(lengths.size)

    def close(self) -> dict[str, Any]:
        """Flush, fsync and rename; returns the shard's ``files`` entry for index.json."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        offsets = np.concatenate([np.zeros(1, dtype=np.int64), *self._ends]).astype("<u8").tobytes()
        with open(self._tmp_idx, "wb") as f:
            f.write(offsets)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_idx, self.dir / self.idx_name)
        os.replace(self._tmp_bin, self.dir / self.name)
        return {"name": self.name, "tokens": self.tokens, "documents": self.documents,
                "checksum": f"{self._crc:08x}", "doc_index": self.idx_name, "doc_index_checksum": crc32_bytes(offsets)}

    def abort(self) -> None:
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def make_index(files: list[dict[str, Any]], *, dtype: str, vocab_size: int, bos_id: int | None, eos_id: int | None,
               tokenizer: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The version-2 ``index.json`` content for shards listed in stream order."""
    return {"format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": vocab_size,
            "bos_id": bos_id, "eos_id": eos_id, "convention": CONVENTION, "checksum": CHECKSUM,
            "tokenizer": tokenizer, "total_tokens": sum(int(f["tokens"]) for f in files),
            "documents": sum(int(f["documents"]) for f in files), **(extra or {}), "files": files}
