"""``kubetitan prepare-data``: tokenize a text/JSONL/Parquet corpus into token shards.

Output: ``<output>/shard-00000.bin ...`` (flat little-endian uint16 when the vocabulary fits,
else uint32; each document's tokens followed by the EOS id) and ``<output>/index.json``
(dtype, files with token counts, tokenizer, vocabulary size). ``spec.data.source: shards``
reads them memory-mapped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kubetitan_trainer.data import INDEX_FILE
from kubetitan_trainer.tokenizer import BUILTIN_TOKENIZER


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kubetitan prepare-data", description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="text (.txt: one document per line), .jsonl/.json or .parquet files")
    p.add_argument("-o", "--output", required=True, help="directory for the shards and index.json")
    p.add_argument("--tokenizer", default="builtin", help="`builtin` or a directory holding tokenizer.json")
    p.add_argument("--text-field", default="text", help="column/key holding the text in JSONL and Parquet")
    p.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    p.add_argument("--batch-size", type=int, default=256, help="documents tokenized per batch")
    return p.parse_args(argv)


def _documents(path: Path, field: str) -> Iterator[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise SystemExit(f"{path}: no column {field!r} (columns: {pf.schema_arrow.names}); pass --text-field")
        for batch in pf.iter_batches(columns=[field]):
            yield from (t for t in batch.column(0).to_pylist() if t)
    elif path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    obj = json.loads(line)
                    if field not in obj:
                        raise SystemExit(f"{path}:{n}: no key {field!r}; pass --text-field")
                    yield obj[field]
    else:
        with open(path, encoding="utf-8") as f:
            yield from (line.rstrip("\n") for line in f if line.strip())


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer
    from tqdm import tqdm

    a = parse_args(sys.argv[1:] if argv is None else argv)
    tok_dir = BUILTIN_TOKENIZER if a.tokenizer == "builtin" else Path(a.tokenizer)
    if not (tok_dir / "tokenizer.json").is_file():
        print(f"--tokenizer: no tokenizer.json in {tok_dir}; pass `builtin` or a directory holding one", file=sys.stderr)
        return 2
    paths = [Path(p) for p in a.inputs]
    for p in paths:
        if not p.is_file():
            print(f"{p}: no such file; pass text, .jsonl/.json or .parquet files", file=sys.stderr)
            return 2
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    cfg_path = tok_dir / "tokenizer_config.json"
    eos_token = json.loads(cfg_path.read_text()).get("eos_token") if cfg_path.is_file() else None
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    eos_id = tok.token_to_id(eos_token) if eos_token else None
    vocab = tok.get_vocab_size()
    dtype = a.dtype if a.dtype != "auto" else ("uint16" if vocab <= 65536 else "uint32")
    if dtype == "uint16" and vocab > 65536:
        print(f"--dtype uint16 cannot hold a vocabulary of {vocab}; use uint32 or auto", file=sys.stderr)
        return 2
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    files: list[dict] = []
    buf: list[np.ndarray] = []
    buffered = 0
    docs = 0

    def flush() -> None:
        nonlocal buf, buffered
        if not buffered:
            return
        name = f"shard-{len(files):05d}.bin"
        np.concatenate(buf).astype(dtype).tofile(out / name)
        files.append({"name": name, "tokens": int(buffered)})
        buf, buffered = [], 0

    total_bytes = sum(p.stat().st_size for p in paths)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="Tokenizing") as bar:
        for p in paths:
            batch: list[str] = []

            def encode(batch: list[str]) -> None:
                nonlocal buffered, docs
                for enc in tok.encode_batch(batch):
                    ids = enc.ids + ([eos_id] if eos_id is not None else [])
                    arr = np.asarray(ids, dtype=np.int64)
                    while len(arr):
                        room = a.shard_tokens - buffered
                        buf.append(arr[:room])
                        buffered += len(arr[:room])
                        arr = arr[room:]
                        if buffered >= a.shard_tokens:
                            flush()
                    docs += 1
                bar.update(sum(len(t.encode("utf-8")) + 1 for t in batch))

            for text in _documents(p, a.text_field):
                batch.append(text)
                if len(batch) >= a.batch_size:
                    encode(batch)
                    batch = []
            if batch:
                encode(batch)
    flush()
    index = {"dtype": dtype, "vocab_size": vocab, "eos_id": eos_id, "tokenizer": str(tok_dir),
             "documents": docs, "total_tokens": sum(f["tokens"] for f in files), "files": files}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    print(f"Wrote {index['total_tokens']:,} tokens from {docs:,} documents in {len(files)} shard(s) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
