"""``kubetitan prepare-data``: tokenize text, JSONL or Parquet files into token shards (docs/data.md).

The inputs (files, directories, globs; expanded and sorted) are cut into *work units* of about ``--unit-mb`` of
input: byte ranges of text/JSONL files (a line belongs to the range its first byte is in), row groups of Parquet
files, whole gzip files. Each unit is tokenized by one worker process into its own shard(s) and recorded as done
in ``parts/unit-NNNNNN.json`` once its shards are complete (rename, then the record: atomic). The shards and their
order depend only on the inputs and the options, never on the number of workers; a re-run with the same inputs
and options skips finished units; the last step writes ``index.json`` (format: :mod:`kubetitan_trainer.data.shards`).

``--parts N --part I`` does the units of part I of N only (an Indexed Job's pod: I is read from
``JOB_COMPLETION_INDEX`` when not given); whichever part finishes last writes ``index.json``; ``--merge`` writes it
from finished parts; ``--render-job`` prints that Indexed Job.

Bad input (a malformed JSONL line, a missing field, text that is not UTF-8, a missing file) stops the run with
``error: FILE:LINE: ...``, what to do, and exit code 2 (the configuration exit code: not retried); never a
traceback. This module does not import torch: ``--help`` and the workers start fast.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import os
import queue
import re
import signal
import sys
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kubetitan_core.contract import ExitCode
from kubetitan_trainer import BUILTIN_TOKENIZER, atomic, knobs
from kubetitan_trainer.data import shards as S
PLAN_FILE = "plan.json"
PARTS_DIR = "parts"
SUFFIXES = {".txt": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
BATCH_BYTES = 256 << 10
"""A batch handed to ``encode_batch_fast`` holds at most this much text (or ``--batch-size`` documents): the
tokenizer's encodings take about 200-300 bytes a token while they exist, so this bounds a worker's memory."""
LONG_CHARS = 256 << 10
"""Documents longer than this are tokenized in pieces (:func:`text_pieces`) and written piece by piece, so that one
huge document (a 10 MB line: 2 GB tokenized whole) needs one piece's memory, not the whole document's. The document
stays one document (BOS, every piece's ids, EOS; one boundary in the ``.idx``)."""
PIECE_CHARS = 64 << 10
"""Piece size for tokenizers where a cut at whitespace is exact (:func:`piece_safe`)."""
COARSE_PIECE_CHARS = 1 << 20
"""Piece size for other tokenizers: a cut there may change the ids next to it, so it happens once per MiB only."""
_PIECE_CUT = re.compile(r"\n(?=\S)|(?<=\S)(?= \S)")
"""Where a piece may end: after a newline that precedes a non-space character, or before a single space between two
non-space characters (in both patterns piece_safe accepts, a pre-token boundary)."""
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f\ufffd]")
"""Characters text does not hold: C0 controls other than tab, newline, form feed and carriage return, DEL, and the
replacement character a lossy decode of binary data leaves."""
BINARY_SAMPLE_CHARS = 64 << 10
BINARY_SHARE = 0.01
"""``--drop-binary``: a document is binary when more than this share of its first BINARY_SAMPLE_CHARS characters are
:data:`_CONTROL` characters (or, in a text or JSONL file, when its line is not UTF-8)."""
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PLAN_VERSION = 2


DataError = S.DataError
_fix = S.data_error


# ---------------------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kubetitan prepare-data", description=__doc__.split("\n")[0].split(": ", 1)[1],
        epilog="Exit codes: 0 done (or this part done), 2 bad input or options (the message says which and what to do).")
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="files (.txt: one document per line; .jsonl/.json: one JSON object per line; .parquet; "
                        "each optionally .gz except Parquet), directories (searched recursively) or glob patterns")
    p.add_argument("-o", "--output", required=True, help="directory for the shards, parts/ and index.json")
    p.add_argument("--tokenizer", default="builtin", help="`builtin` or a directory holding tokenizer.json")
    p.add_argument("--text-field", default="text", help="key (JSONL) or column (Parquet) holding the text")
    p.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto",
                   help="token dtype; auto: uint16 when the vocabulary fits, else uint32")
    p.add_argument("--workers", type=int, default=knobs.affinity_cpus(),
                   help="tokenizer processes (default: every core this process may use, here %(default)s)")
    p.add_argument("--unit-mb", type=float, default=0.0,
                   help="input MiB per work unit, the unit of parallelism and of resume (default 0: auto, the input "
                        "size / 64 within 1..64 MiB: a function of the inputs only, never of --workers)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="a unit's shard is closed after the document that brings it to this many tokens")
    p.add_argument("--batch-size", type=int, default=1024, help="documents per encode_batch call (at most 1 MiB)")
    p.add_argument("--min-chars", type=int, default=0, help="skip documents of fewer characters (counted in index.json)")
    p.add_argument("--max-chars", type=int, default=0,
                   help="skip documents of more characters (counted in index.json; default 0: no limit, a long "
                        "document is tokenized in pieces)")
    p.add_argument("--drop-binary", action="store_true",
                   help="skip binary documents instead of stopping on them: lines that are not UTF-8, and documents "
                        f"whose first {BINARY_SAMPLE_CHARS >> 10} Ki characters are over {BINARY_SHARE * 100:.0f}%% control "
                        "characters (counted in index.json)")
    p.add_argument("--parts", type=int, default=1, help="split the units into this many parts (an Indexed Job's "
                   "completions)")
    p.add_argument("--part", type=int, default=None,
                   help="do part I of --parts only (default: $JOB_COMPLETION_INDEX when --parts > 1)")
    p.add_argument("--merge", action="store_true",
                   help="only write index.json from the finished parts in --output (no tokenizing)")
    p.add_argument("--verify", action="store_true",
                   help="only check the shards in --output: sizes, CRC-32s and every token id against the "
                        "vocabulary (--vocab-size, else the tokenizer's); exit 2 naming the bad file")
    p.add_argument("--vocab-size", type=int, default=None, help="--verify: the model's vocabulary size")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--render-job", action="store_true",
                   help="print a Kubernetes Indexed Job (batch/v1) that runs this command as --parts pods "
                        "on a shared volume instead of running it; see the --job-* options")
    p.add_argument("--job-name", default="prepare-data", help="--render-job: the Job's name")
    p.add_argument("--job-namespace", default="default", help="--render-job: its namespace")
    p.add_argument("--job-image", default="", help="--render-job: the trainer image (required)")
    p.add_argument("--job-claim", default="", help="--render-job: the ReadWriteMany PersistentVolumeClaim holding "
                   "the inputs and the output (required)")
    p.add_argument("--job-mount-path", default="/data", help="--render-job: where the claim is mounted; inputs and "
                   "--output are paths under it")
    p.add_argument("--job-cpus", type=int, default=8, help="--render-job: CPUs per pod (also its --workers)")
    p.add_argument("--job-memory", default="", help="--render-job: memory per pod (default 1Gi per CPU)")
    p.add_argument("--job-parallelism", type=int, default=0, help="--render-job: pods at once (default: --parts)")
    return p.parse_args(argv)


# -------------------------------------------------------------------------------------------------------- inputs
def kind_of(path: Path) -> tuple[str, bool] | None:
    """(text|jsonl|parquet, gzip-compressed) of a file name, or None if it is not an input type."""
    gz = path.suffix == ".gz"
    kind = SUFFIXES.get(Path(path.stem).suffix if gz else path.suffix)
    if kind is None or (gz and kind == "parquet"):
        return None
    return kind, gz


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files as given; directories searched recursively and glob patterns expanded, each sorted by path."""
    out: list[Path] = []
    types = ", ".join(sorted({*SUFFIXES, *(s + ".gz" for s in SUFFIXES if s != ".parquet")}))
    for s in inputs:
        p = Path(s)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and kind_of(q) is not None)
            if not found:
                raise _fix(f"{s}: the directory holds no input file ({types})", "point at the files to tokenize")
            out += found
        elif p.is_file():
            if kind_of(p) is None:
                raise _fix(f"{s}: unknown input type", f"use {types} files")
            out.append(p)
        elif glob.has_magic(s):
            found = sorted(Path(q) for q in glob.glob(s, recursive=True) if Path(q).is_file() and kind_of(Path(q)))
            if not found:
                raise _fix(f"{s}: the pattern matches no input file ({types})", "check the pattern (quote it)")
            out += found
        else:
            raise _fix(f"{s}: no such file or directory", "pass text, .jsonl/.json or .parquet files or directories")
    return [p.resolve() for p in out]


# ----------------------------------------------------------------------------------------------------- tokenizer
@dataclass(frozen=True)
class TokenizerInfo:
    json_path: str
    name: str
    sha256: str
    vocab_size: int
    bos_id: int | None
    eos_id: int

    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size}


def _special(tok_dir: Path, key: str) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = tok_dir / name
        if f.is_file():
            try:
                v = json.loads(f.read_text()).get(key)
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                continue
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                return v
    return None


def load_tokenizer_info(spec: str) -> TokenizerInfo:
    from tokenizers import Tokenizer

    tok_dir = BUILTIN_TOKENIZER if spec == "builtin" else Path(spec)
    tj = tok_dir / "tokenizer.json"
    if not tj.is_file():
        raise _fix(f"--tokenizer: no tokenizer.json in {tok_dir}", "pass `builtin` or a directory holding one")
    try:
        tok = Tokenizer.from_file(str(tj))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
        raise _fix(f"--tokenizer: {tj} cannot be loaded ({e})", "pass a Hugging Face fast tokenizer's tokenizer.json") from None
    bos_tok, eos_tok = _special(tok_dir, "bos_token"), _special(tok_dir, "eos_token")
    eos = tok.token_to_id(eos_tok) if eos_tok else None
    if eos is None:
        raise _fix(f"--tokenizer: {tok_dir} names no EOS token in its vocabulary (tokenizer_config.json eos_token)",
                   "use a tokenizer whose tokenizer_config.json has an eos_token: every document ends with it")
    bos = tok.token_to_id(bos_tok) if bos_tok else None
    ident = S.tokenizer_identity(tok_dir, "builtin" if spec == "builtin" else str(tok_dir.resolve()))
    assert ident is not None  # tokenizer.json was just loaded
    return TokenizerInfo(str(tj), ident.name, ident.sha256, tok.get_vocab_size(), bos, eos)


# ---------------------------------------------------------------------------------------------------------- plan
def _parquet_row_groups(path: Path, field: str) -> list[int]:
    import pyarrow.parquet as pq

    try:
        md = pq.ParquetFile(path).metadata
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for a bad file
        raise _fix(f"{path}: cannot be read as Parquet ({e})", "check the file (re-download it) or leave it out") from None
    names = md.schema.to_arrow_schema().names
    if field not in names:
        raise _fix(f"{path}: no column {field!r} (columns: {', '.join(names)})", "pass --text-field with the text column")
    return [md.row_group(i).num_rows for i in range(md.num_row_groups)]


def line_start(path: Path, pos: int, size: int) -> int:
    """The first byte at or after ``pos`` that starts a line (0, or just after a newline); ``size`` if none does."""
    if pos <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(pos - 1)
        at = pos - 1
        while block := f.read(1 << 20):
            i = block.find(b"\n")
            if i >= 0:
                return at + i + 1
            at += len(block)
    return size


def make_plan(files: list[Path], unit_bytes: int, options: dict[str, Any]) -> dict[str, Any]:
    """The work units: a pure function of the input list (paths, sizes, times, and where lines start), the unit size
    and the options.

    A unit is a list of pieces ``[file, start, end, bytes]``: a range of whole lines of a text/JSONL file (a range
    ends at the first line start at or after the unit's size, so a long line makes its unit that much bigger: the
    ``bytes`` are the work), a range of row groups of a Parquet file, or a whole gzip file (``[file, 0, 1, bytes]``,
    its compressed size). Units are filled in input order."""
    inputs, units, cur, cur_bytes = [], [], [], 0

    def close() -> None:
        nonlocal cur, cur_bytes
        if cur:
            units.append(cur)
        cur, cur_bytes = [], 0

    def add(piece: list[int]) -> None:
        nonlocal cur_bytes
        cur.append(piece)
        cur_bytes += piece[3]
        if cur_bytes >= unit_bytes:
            close()

    for i, f in enumerate(files):
        st = f.stat()
        inputs.append({"path": str(f), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
        kind, gz = kind_of(f)  # type: ignore[misc]
        if st.st_size == 0:
            continue
        if gz:
            add([i, 0, 1, st.st_size])
        elif kind == "parquet":
            rows = _parquet_row_groups(f, options["text_field"])
            total = max(1, sum(rows))
            for g, n in enumerate(rows):
                add([i, g, g + 1, max(1, st.st_size * n // total)])
        else:
            pos = 0
            while pos < st.st_size:
                end = line_start(f, min(st.st_size, pos + max(1, unit_bytes - cur_bytes)), st.st_size)
                add([i, pos, end, end - pos])
                pos = end
    close()
    return {"version": PLAN_VERSION, "inputs": inputs, "options": options, "unit_bytes": unit_bytes, "units": units}


UNITS_AUTO = 64


def unit_bytes(unit_mb: float, total: int) -> int:
    """The work unit size: ``unit_mb`` MiB, or for 0 (auto) the input size / 64 within 1..64 MiB, so that a small
    corpus still spreads over the workers and a large one is not cut finer than it needs."""
    if unit_mb > 0:
        return max(1, int(unit_mb * (1 << 20)))
    return int(min(64 << 20, max(1 << 20, total // UNITS_AUTO)))


def plan_id(plan: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def part_units(unit_bytes: list[int], parts: int, part: int) -> range:
    """The units of part ``part`` of ``parts``: a contiguous block, balanced by bytes (a unit goes to the part its
    middle byte falls in), not by count."""
    total = max(1, sum(unit_bytes))
    mine, pos = [], 0
    for u, b in enumerate(unit_bytes):
        if min(parts - 1, (2 * pos + b) * parts // (2 * total)) == part:
            mine.append(u)
        pos += b
    return range(mine[0], mine[-1] + 1) if mine else range(0)


def unit_sizes(plan: dict[str, Any]) -> list[int]:
    """Each work unit's input bytes."""
    return [sum(p[3] for p in unit) for unit in plan["units"]]


def part_file(out: Path, unit: int) -> Path:
    return out / PARTS_DIR / f"unit-{unit:06d}.json"


def finished(out: Path, unit: int, pid: str) -> dict[str, Any] | None:
    f = part_file(out, unit)
    try:
        rec = json.loads(f.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return rec if rec.get("plan_id") == pid else None


# -------------------------------------------------------------------------------------------------- the worker
_TOK: Any = None
_PROGRESS: Any = None


_PIECES = False


def piece_safe(tokenizer: dict[str, Any]) -> bool:
    """Whether tokenizing a text in pieces cut at :data:`_PIECE_CUT` (after a newline that precedes a non-space
    character, or before a single space between two non-space characters) gives the same ids as tokenizing it whole:
    true for byte-level BPE without a normalizer and without a prefix space whose pre-tokenizer is GPT-2's regex
    (``ByteLevel`` with ``use_regex``) or Llama 3's ``Split`` pattern, and whose added tokens hold no whitespace. In
    both patterns no pre-token holds a newline followed by a non-space character (a newline is never the optional
    prefix of a word or number, and punctuation only takes newlines after it), nor a non-space character followed by
    a space (a space only ever starts a pre-token or is part of a run of whitespace), and no pattern looks behind,
    so such a cut is a pre-token boundary and BPE, which works inside pre-tokens, cannot see it. Any other tokenizer
    is cut less often (:data:`COARSE_PIECE_CHARS`), each cut possibly changing the ids next to it."""
    if tokenizer.get("normalizer") is not None:
        return False
    if any(re.search(r"\s", t.get("content", "")) for t in tokenizer.get("added_tokens") or []):
        return False
    pt = tokenizer.get("pre_tokenizer") or {}

    def byte_level(p: dict[str, Any], regex: bool) -> bool:
        return p.get("type") == "ByteLevel" and not p.get("add_prefix_space") and bool(p.get("use_regex", True)) == regex

    if byte_level(pt, True):
        return True
    seq = pt.get("pretokenizers") or [] if pt.get("type") == "Sequence" else []
    return (len(seq) == 2 and seq[0].get("type") == "Split" and (seq[0].get("pattern") or {}).get("Regex") == LLAMA3_SPLIT
            and seq[0].get("behavior") == "Isolated" and not seq[0].get("invert") and byte_level(seq[1], False))


def text_pieces(text: str, size: int = PIECE_CHARS, stats: dict[str, int] | None = None) -> Iterator[str]:
    """``text`` in pieces of ``size`` to ``2 * size`` characters, each cut at the first :data:`_PIECE_CUT` after
    ``size`` characters; where the next ``size`` characters hold no whitespace to cut at, at ``size`` characters (a
    character boundary: counted in ``stats["hard_cuts"]``)."""
    start, n = 0, len(text)
    while n - start > size:
        m = _PIECE_CUT.search(text, start + size, min(n, start + 2 * size))
        cut = start + size if m is None else m.end()
        if m is None and stats is not None:
            stats["hard_cuts"] = stats.get("hard_cuts", 0) + 1
        yield text[start:cut]
        start = cut
    yield text[start:]


def _init_worker(tokenizer_json: str, progress: Any) -> None:
    """Each worker loads the tokenizer once and tokenizes on one thread (the parallelism is the processes)."""
    global _TOK, _PROGRESS, _PIECES
    # A forked worker inherits its parent's signal handlers: one that turns SIGTERM into an exception (torch's
    # elastic agent installs such a handler) would keep the pool's terminate() from ending it, and a worker caught in
    # the pool's finalizers then hangs the whole run. The pool's own SIGTERM must end a worker.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _TOK = Tokenizer.from_file(tokenizer_json)
    _PIECES = piece_safe(json.loads(Path(tokenizer_json).read_text()))
    _PROGRESS = progress


def encode_texts(texts: list[str]) -> list[list[int]]:
    """The ids of each text without special tokens (``_TOK``, loaded by :func:`_init_worker`), in one batch."""
    enc = _TOK.encode_batch_fast if hasattr(_TOK, "encode_batch_fast") else _TOK.encode_batch
    return [e.ids for e in enc(texts, add_special_tokens=False)]


def encode_pieces(text: str, stats: dict[str, int] | None = None) -> Iterator[list[int]]:
    """The ids of a long text, piece by piece (:func:`text_pieces`: :data:`PIECE_CHARS` where :func:`piece_safe`
    says the cuts are exact, else :data:`COARSE_PIECE_CHARS`); together, for a piece-safe tokenizer, exactly the
    whole text's ids when every cut is at whitespace."""
    for piece in text_pieces(text, PIECE_CHARS if _PIECES else COARSE_PIECE_CHARS, stats):
        yield encode_texts([piece])[0]


def _line_number(path: Path, gz: bool, pos: int) -> int:
    """1-based line number of the line starting at byte ``pos`` (decompressed bytes for gzip); errors only."""
    n, done = 1, 0
    with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
        while done < pos:
            block = f.read(min(S.READ_CHUNK, pos - done))
            if not block:
                break
            n += block.count(b"\n")
            done += len(block)
    return n


def _lines(path: Path, gz: bool, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of the lines whose first byte is in [start, end) (gzip: the whole file)."""
    if gz:
        with gzip.open(path, "rb") as f:
            pos = 0
            try:
                for line in f:
                    yield pos, line
                    pos += len(line)
            except (EOFError, gzip.BadGzipFile, OSError) as e:
                raise _fix(f"{path}: the gzip stream is damaged after {pos} bytes ({e})",
                           "re-download or re-compress the file, or leave it out") from None
        return
    with open(path, "rb") as f:
        pos = start
        if start > 0:
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())  # the line holding byte start-1 belongs to the previous range
        while pos < end:
            line = f.readline()
            if not line:
                return
            yield pos, line
            pos += len(line)


def _documents(path: Path, kind: str, gz: bool, start: int, end: int, field: str,
               lossy: bool = False) -> Iterator[tuple[int, str | None]]:
    """(input bytes consumed, text) of the documents of one piece; DataError with FILE:LINE for bad input. With
    ``lossy`` a line that is not UTF-8 is a document ``None`` (binary: skipped and counted) instead of an error."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        for g in range(start, end):
            rows = 0
            for batch in pf.iter_batches(batch_size=1024, row_groups=[g], columns=[field]):
                col = batch.column(0)
                for r, t in enumerate(col.to_pylist()):
                    if t is None or t == "":
                        continue
                    if not isinstance(t, str):
                        raise _fix(f"{path}: row group {g}, row {rows + r}: column {field!r} holds "
                                   f"{type(t).__name__}, not text", "pass --text-field with a string column")
                    yield 0, t
                rows += len(col)
        return
    for pos, raw in _lines(path, gz, start, end):
        size = len(raw)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if lossy:
                yield size, None
                continue
            raise _fix(f"{path}:{_line_number(path, gz, pos)}: is not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                       f"{e.start + 1})", "convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or leave it "
                       "out, or pass --drop-binary to skip such lines") from None
        if kind == "text":
            text = line.rstrip("\r\n")
            if text.strip():
                yield size, text
            else:
                yield size, ""
            continue
        if not line.strip():
            yield size, ""
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _fix(f"{path}:{_line_number(path, gz, pos)}: malformed JSON ({e.msg} at column {e.colno})",
                       "fix or remove the line; each line of a .jsonl file is one JSON object") from None
        if not isinstance(obj, dict) or field not in obj:
            keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
            raise _fix(f"{path}:{_line_number(path, gz, pos)}: no key {field!r} (has: {keys})",
                       "pass --text-field with the key holding the text")
        text = obj[field]
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise _fix(f"{path}:{_line_number(path, gz, pos)}: {field!r} is {type(text).__name__}, not text",
                       "pass --text-field with the key holding the text")
        yield size, text


@dataclass
class UnitJob:
    unit: int
    pieces: list[list[int]]
    inputs: list[str]
    out: str
    pid: str
    text_field: str
    dtype: str
    bos_id: int | None
    eos_id: int
    shard_tokens: int
    batch_size: int
    min_chars: int = 0
    max_chars: int = 0
    drop_binary: bool = False


def looks_binary(text: str) -> bool:
    """``--drop-binary``'s detector: over :data:`BINARY_SHARE` of the first :data:`BINARY_SAMPLE_CHARS` characters
    are control characters (:data:`_CONTROL`)."""
    sample = text[:BINARY_SAMPLE_CHARS]
    return len(_CONTROL.findall(sample)) > BINARY_SHARE * len(sample)


SKIP_REASONS = ("empty", "short", "long", "binary")
"""Why a document was not tokenized (index.json's ``skipped``): empty or whitespace only, under ``--min-chars``,
over ``--max-chars``, binary (``--drop-binary``)."""


def skip_reason(text: str | None, job: UnitJob) -> str | None:
    """Which of :data:`SKIP_REASONS` keeps ``text`` (None: a line that is not UTF-8) out of the shards, or None."""
    if text is None:
        return "binary"
    if not text:
        return "empty"
    if len(text) < job.min_chars:
        return "short"
    if job.max_chars and len(text) > job.max_chars:
        return "long"
    if job.drop_binary and looks_binary(text):
        return "binary"
    return None


class _Unit:
    """Tokenizes one work unit into ``shard-<unit>-<k>.bin`` files (a shard closes after the document that brings it
    to ``shard_tokens``: independent of batching)."""

    def __init__(self, job: UnitJob) -> None:
        self.job, self.out = job, Path(job.out)
        self.files: list[dict[str, Any]] = []
        self.writer: S.ShardWriter | None = None
        self.bytes = self.tokens = self.documents = 0
        self.skipped = dict.fromkeys(SKIP_REASONS, 0)
        self.stats = {"long_documents": 0, "hard_cuts": 0}
        self._cpu0 = time.process_time()

    def _writer(self) -> S.ShardWriter:
        if self.writer is None:
            self.writer = S.ShardWriter(self.out, f"shard-{self.job.unit:06d}-{len(self.files):04d}.bin", self.job.dtype)
        return self.writer

    def encode(self, texts: list[str], nbytes: int) -> None:
        j = self.job
        if texts:
            ids = encode_texts(texts)
            pre = (j.bos_id,) if j.bos_id is not None else ()
            lengths = np.fromiter((len(i) + len(pre) + 1 for i in ids), dtype=np.int64, count=len(ids))
            flat = np.fromiter(chain.from_iterable(chain(pre, i, (j.eos_id,)) for i in ids), dtype=np.int64,
                               count=int(lengths.sum()))
            ends = np.cumsum(lengths)
            a = 0  # first document not written yet
            while a < len(ids):
                w = self._writer()
                room = j.shard_tokens - w.tokens
                base = int(ends[a - 1]) if a else 0
                # the first document at which the shard reaches shard_tokens closes it
                b = int(np.searchsorted(ends - base, room, side="left")) + 1
                b = min(max(b, a + 1), len(ids))
                w.add(flat[base:int(ends[b - 1])], lengths[a:b])
                if w.tokens >= j.shard_tokens:
                    self.files.append(w.close())
                    self.writer = None
                a = b
            self.tokens += int(lengths.sum())
            self.documents += len(ids)
        self.bytes += nbytes
        if _PROGRESS is not None:
            _PROGRESS.put((nbytes, int(lengths.sum()) if texts else 0))

    def encode_long(self, text: str, nbytes: int) -> None:
        """One document over :data:`LONG_CHARS`, written piece by piece into the current shard (:func:`encode_pieces`):
        it takes one piece's memory, not the document's, and stays one document."""
        j = self.job
        w = self._writer()
        n = 0
        for ids in chain([[j.bos_id]] if j.bos_id is not None else [], encode_pieces(text, self.stats), [[j.eos_id]]):
            w.write(ids)
            n += len(ids)
        w.end_documents(np.array([n], dtype=np.int64))
        if w.tokens >= j.shard_tokens:
            self.files.append(w.close())
            self.writer = None
        self.tokens += n
        self.documents += 1
        self.stats["long_documents"] += 1
        self.bytes += nbytes
        if _PROGRESS is not None:
            _PROGRESS.put((nbytes, n))

    def run(self) -> dict[str, Any]:
        j = self.job
        texts: list[str] = []
        tbytes = nbytes = 0
        for f, start, end, weight in j.pieces:
            path = Path(j.inputs[f])
            kind, gz = kind_of(path)  # type: ignore[misc]
            piece_bytes = 0  # progress counts input bytes: line sizes of plain files, a share of the rest
            counts = kind != "parquet" and not gz
            for size, text in _documents(path, kind, gz, start, end, j.text_field, j.drop_binary):
                if counts:
                    nbytes += size
                    piece_bytes += size
                why = skip_reason(text, j)
                if why is not None:
                    self.skipped[why] += 1
                elif len(text) > LONG_CHARS:  # type: ignore[arg-type]
                    self.encode(texts, nbytes - size)
                    self.encode_long(text, size)  # type: ignore[arg-type]
                    texts, tbytes, nbytes = [], 0, 0
                else:
                    texts.append(text)  # type: ignore[arg-type]
                    tbytes += len(text)  # type: ignore[arg-type]
                if len(texts) >= j.batch_size or tbytes >= BATCH_BYTES:
                    self.encode(texts, nbytes)
                    texts, tbytes, nbytes = [], 0, 0
            nbytes += weight - piece_bytes  # lines crossing a range's end are counted where they start
        self.encode(texts, nbytes)
        if self.writer is not None:
            self.files.append(self.writer.close())
            self.writer = None
        rec = {"plan_id": j.pid, "unit": j.unit, "bytes": sum(p[3] for p in j.pieces), "tokens": self.tokens,
               "documents": self.documents, "skipped": self.skipped, **self.stats, "files": self.files,
               "cpu_seconds": round(time.process_time() - self._cpu0, 3)}
        (self.out / PARTS_DIR).mkdir(exist_ok=True)
        atomic.write_text(part_file(self.out, j.unit), json.dumps(rec) + "\n")
        return rec


def run_unit(job: UnitJob) -> dict[str, Any]:
    u = _Unit(job)
    try:
        return u.run()
    except OSError as e:
        if u.writer is not None:
            u.writer.abort()
        raise _fix(f"{e.filename or job.out}: {e.strerror or e}",
                   "check that the inputs are readable and --output is writable with free space") from None
    except BaseException:
        if u.writer is not None:
            u.writer.abort()
        raise


# ---------------------------------------------------------------------------------------------------- the driver
def dispatch_order(jobs: list[UnitJob]) -> list[UnitJob]:
    """The order units are handed to the workers: the largest first (by input bytes; ties in unit order), so that a
    big unit (a file of long lines) starts at once instead of running alone at the end while the other workers idle.
    The output does not depend on it: each unit writes its own shards."""
    return sorted(jobs, key=lambda j: (-sum(p[3] for p in j.pieces), j.unit))


def _run_units(jobs: list[UnitJob], workers: int, tok: TokenizerInfo, total_bytes: int, progress: bool) -> None:
    import multiprocessing as mp

    from tqdm import tqdm

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    prog = ctx.Queue()
    results: queue.SimpleQueue = queue.SimpleQueue()
    # the workers first: fork before tqdm starts its monitor thread
    pool = ctx.Pool(max(1, min(workers, len(jobs))), initializer=_init_worker, initargs=(tok.json_path, prog))
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="Tokenizing", smoothing=0.05,
               disable=not progress, mininterval=0.5 if sys.stderr.isatty() else 30)
    tokens, t0 = 0, time.monotonic()
    try:
        for j in dispatch_order(jobs):
            pool.apply_async(run_unit, (j,), callback=results.put, error_callback=results.put)
        done = 0
        while done < len(jobs):
            try:
                b, t = prog.get(timeout=0.2)
                bar.update(b)
                tokens += t
                bar.set_postfix_str(f"{tokens / max(1e-9, time.monotonic() - t0):,.0f} tokens/s", refresh=False)
            except queue.Empty:
                pass
            while not results.empty():
                r = results.get()
                if isinstance(r, BaseException):
                    raise r
                done += 1
        pool.close()
    finally:
        pool.terminate()
        pool.join()
        bar.close()


def merge(out: Path, pid: str, plan: dict[str, Any], tok: dict[str, Any], dtype: str,
          bos: int | None, eos: int | None, missing_ok: bool) -> dict[str, Any] | None:
    """Write index.json from every unit's record, in unit order; None (or DataError) when some are missing."""
    recs, missing = [], []
    for u in range(len(plan["units"])):
        r = finished(out, u, pid)
        (missing.append(u) if r is None else recs.append(r))
    if missing:
        if missing_ok:
            return None
        first = plan["units"][missing[0]][0]
        raise _fix(f"{out}: {len(missing)} of {len(plan['units'])} work units are not finished (the first, unit "
                   f"{missing[0]}, starts in {plan['inputs'][first[0]]['path']})",
                   "run prepare-data again with the same inputs and options (it does only what is missing), or "
                   "let every part of the Job finish")
    files = [f for r in recs for f in r["files"]]
    skipped = {k: sum(r.get("skipped", {}).get(k, 0) for r in recs) for k in SKIP_REASONS}
    index = S.make_index(files, dtype=dtype, vocab_size=tok["vocab_size"], bos_id=bos, eos_id=eos, tokenizer=tok,
                         extra={"plan_id": pid, "input_files": len(plan["inputs"]),
                                "input_bytes": sum(i["bytes"] for i in plan["inputs"]), "units": len(recs),
                                "filters": plan["options"].get("filters", {}), "skipped": skipped,
                                "long_documents": sum(r.get("long_documents", 0) for r in recs),
                                "hard_cuts": sum(r.get("hard_cuts", 0) for r in recs)})
    atomic.write_text(out / S.INDEX_FILE, json.dumps(index, indent=1) + "\n")
    atomic.write_text(out / CARD_FILE, dataset_card(out, index, plan))
    return index


CARD_FILE = "dataset_card.md"
"""What prepare-data writes beside index.json for people: the sources and their hashes, the filters, the counts and
the tokenizer (:func:`dataset_card`)."""


def input_sha256(path: str, planned: dict[str, Any]) -> str:
    """The sha256 of an input file, or why there is none (gone, or changed since it was planned)."""
    try:
        st = os.stat(path)
        if (st.st_size, st.st_mtime_ns) != (planned["bytes"], planned["mtime_ns"]):
            return "(changed since it was tokenized)"
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as e:
        return f"({e.strerror or e})"


def dataset_card(out: Path, index: dict[str, Any], plan: dict[str, Any]) -> str:
    """The dataset card (Markdown): the sources with their bytes and sha256 (hashed here, at the merge: about a
    second per GB), the filters and what they kept out, the token and document counts, the tokenizer's identity."""
    tok, f, sk = index["tokenizer"], index.get("filters", {}), index.get("skipped", {})
    rows = "\n".join(f"| `{i['path']}` | {i['bytes']:,} | `{input_sha256(i['path'], i)}` |" for i in plan["inputs"])
    return f"""# Dataset card: {out.name}

Written by `kubetitan prepare-data` with `index.json` (plan `{index['plan_id']}`); the shards' own checksums are
in `index.json`.

## Counts

| tokens | documents | shards | dtype | input files | input bytes | long documents (in pieces) | hard cuts |
|---|---|---|---|---|---|---|---|
| {index['total_tokens']:,} | {index['documents']:,} | {len(index['files'])} | {index['dtype']} | \
{index['input_files']} | {index['input_bytes']:,} | {index.get('long_documents', 0)} | {index.get('hard_cuts', 0)} |

## Tokenizer

`{tok['name']}`: `tokenizer.json` sha256 `{tok['sha256']}`, {tok['vocab_size']:,} tokens; documents stored as
{index['convention']} (BOS id {index['bos_id']}, EOS id {index['eos_id']}).

## Filters

| --min-chars | --max-chars | --drop-binary | left out: empty | short | long | binary |
|---|---|---|---|---|---|---|
| {f.get('min_chars') or 'none'} | {f.get('max_chars') or 'none'} | {'yes' if f.get('drop_binary') else 'no'} | \
{sk.get('empty', 0):,} | {sk.get('short', 0):,} | {sk.get('long', 0):,} | {sk.get('binary', 0):,} |

## Sources

Text field `{plan['options'].get('text_field', 'text')}`.

| file | bytes | sha256 |
|---|---|---|
{rows}
"""


def _claim_plan(out: Path, plan: dict[str, Any]) -> str:
    """Write plan.json (first writer wins: every part computes the same plan) or check it is the same plan."""
    pid = plan_id(plan)
    f = out / PLAN_FILE
    body = json.dumps({"plan_id": pid, **plan}) + "\n"
    if not f.exists():
        tmp = out / f".{PLAN_FILE}.{os.getpid()}.tmp"
        tmp.write_text(body)
        try:
            os.link(tmp, f)  # atomic create-if-absent, also on NFS
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    try:
        old = json.loads(f.read_text()).get("plan_id")
    except (json.JSONDecodeError, OSError) as e:
        raise _fix(f"{f} cannot be read ({e})", f"delete {out} and run again") from None
    if old != pid:
        raise _fix(f"{out} holds the output of prepare-data with other inputs or options (its {PLAN_FILE} differs: "
                   "input files, their sizes or times, --tokenizer, --text-field, --dtype, --unit-mb, --shard-tokens, "
                   "the filters; or another version of prepare-data planned it)",
                   f"use a new --output directory, or delete {out} to start over")
    return pid


# long: the command's top level (merge-only, verify, units, workers, index) read in order; each step is a call
def prepare(a: argparse.Namespace) -> int:
    out = Path(a.output)
    if a.merge and not a.inputs:
        try:
            plan = json.loads((out / PLAN_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise _fix(f"{out / PLAN_FILE} cannot be read ({e})",
                       "point --output at a directory prepare-data has worked on") from None
        pid = plan.pop("plan_id")
        o = plan["options"]
        index = merge(out, pid, plan, o["tokenizer"], o["dtype"], o["bos_id"], o["eos_id"], missing_ok=False)
        assert index is not None
        print(f"Wrote {out / S.INDEX_FILE}: {index['total_tokens']:,} tokens, {index['documents']:,} documents, "
              f"{len(index['files'])} shard(s)")
        return 0
    if not a.inputs:
        raise _fix("no INPUT given", "pass the files, directories or glob patterns to tokenize")
    for name in ("workers", "parts", "batch_size", "shard_tokens"):
        if getattr(a, name) < 1:
            raise _fix(f"--{name.replace('_', '-')} is {getattr(a, name)}", "use 1 or more")
    for name in ("min_chars", "max_chars"):
        if getattr(a, name) < 0:
            raise _fix(f"--{name.replace('_', '-')} is {getattr(a, name)}", "use 0 (no limit) or more")
    if a.max_chars and a.max_chars < a.min_chars:
        raise _fix(f"--max-chars {a.max_chars} is below --min-chars {a.min_chars}", "raise --max-chars or lower --min-chars")
    if a.unit_mb < 0:
        raise _fix(f"--unit-mb is {a.unit_mb}", "use a positive size in MiB, or 0 for auto")
    part = a.part
    if part is None and a.parts > 1:
        env = os.environ.get("JOB_COMPLETION_INDEX")
        if env is None or not env.isdigit():
            raise _fix(f"--parts {a.parts} without --part, and JOB_COMPLETION_INDEX is {env!r}",
                       "pass --part I (0-based), or run it as an Indexed Job's pod (`--render-job`)")
        part = int(env)
    part = part or 0
    if not 0 <= part < a.parts:
        raise _fix(f"--part {part} is outside 0..{a.parts - 1}", "use 0 <= --part < --parts")
    tok = load_tokenizer_info(a.tokenizer)
    dtype = a.dtype if a.dtype != "auto" else S.dtype_for(tok.vocab_size)
    if dtype == "uint16" and tok.vocab_size > 1 << 16:
        raise _fix(f"--dtype uint16 cannot hold a vocabulary of {tok.vocab_size}", "use uint32 or auto")
    files = expand_inputs(a.inputs)
    options = {"tokenizer": tok.identity(), "text_field": a.text_field, "dtype": dtype, "bos_id": tok.bos_id,
               "eos_id": tok.eos_id, "shard_tokens": a.shard_tokens, "convention": S.CONVENTION,
               "filters": {"min_chars": a.min_chars, "max_chars": a.max_chars, "drop_binary": a.drop_binary}}
    plan = make_plan(files, unit_bytes(a.unit_mb, sum(f.stat().st_size for f in files)), options)
    try:
        out.mkdir(parents=True, exist_ok=True)
        pid = _claim_plan(out, plan)
    except OSError as e:
        raise _fix(f"--output {out}: {e.strerror or e}", "use a directory you can write to") from None
    mine = part_units(unit_sizes(plan), a.parts, part)
    todo = [u for u in mine if finished(out, u, pid) is None]
    inputs = [i["path"] for i in plan["inputs"]]
    jobs = [UnitJob(u, plan["units"][u], inputs, str(out), pid, a.text_field, dtype, tok.bos_id, tok.eos_id,
                    a.shard_tokens, a.batch_size, a.min_chars, a.max_chars, a.drop_binary) for u in todo]
    todo_bytes = sum(p[3] for j in jobs for p in j.pieces)
    where = f"part {part} of {a.parts}: " if a.parts > 1 else ""
    print(f"{where}{len(mine)} work unit(s) of {len(plan['units'])}, {len(mine) - len(todo)} already done; "
          f"tokenizing {todo_bytes / 1e6:,.2f} MB with {min(a.workers, max(1, len(jobs)))} worker(s)",
          file=sys.stderr)
    t0 = time.monotonic()
    if jobs:
        _run_units(jobs, a.workers, tok, todo_bytes, not a.no_progress)
    dt = time.monotonic() - t0
    toks = sum((finished(out, j.unit, pid) or {}).get("tokens", 0) for j in jobs)
    if jobs:
        print(f"{where}tokenized {todo_bytes / 1e6:,.1f} MB into {toks:,} tokens in {dt:.1f} s: "
              f"{todo_bytes / 1e6 / dt:,.2f} MB/s, {toks / dt:,.0f} tokens/s", file=sys.stderr)
    index = merge(out, pid, plan, tok.identity(), dtype, tok.bos_id, tok.eos_id, missing_ok=a.parts > 1)
    if index is None:
        print(f"{where}done; index.json is written by the part that finishes last (or `--merge`)", file=sys.stderr)
    else:
        print(f"Wrote {index['total_tokens']:,} tokens from {index['documents']:,} documents in "
              f"{len(index['files'])} shard(s) to {out}")
    return 0


def verify(out: Path, vocab_size: int | None) -> int:
    """Check a shards directory completely (what the trainer checks at start, plus every CRC-32 and token id)."""
    ss = S.ShardSet.open(out, vocab_size=vocab_size, verify="checksum", field_name="--output")
    step = 1 << 24
    for pos in range(0, ss.total_tokens, step):
        ss.read(pos, min(step, ss.total_tokens - pos))  # read() refuses ids outside the vocabulary
    docs = ss.num_documents
    print(f"{out}: version {ss.version}, {len(ss.shards)} shard(s), {ss.total_tokens:,} {ss.dtype} tokens, "
          f"{'?' if docs is None else f'{docs:,}'} documents, vocabulary {ss.vocab_size} "
          f"(tokenizer {ss.tokenizer_name or '?'}): sizes{', CRC-32s' if ss.version >= 2 else ''} and token ids OK")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if a.render_job:
            from kubetitan_trainer.data.prepare_job import render_job_yaml

            sys.stdout.write(render_job_yaml(a))
            return 0
        if a.verify:
            return verify(Path(a.output), a.vocab_size)
        return prepare(a)
    except (DataError, S.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    except OSError as e:  # writing the index or plan: a full or read-only volume
        print(f"error: {e.filename or a.output}: {e.strerror or e}. Fix: check that --output is writable and has free "
              "space, then run the same command again (finished work units are kept)", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    except KeyboardInterrupt:
        print("Interrupted; finished work units are kept: run the same command again to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
