"""A real-text corpus from the files of the machine it runs on (no network): one JSONL document per file.

    python bench/text_corpus.py --out corpus.jsonl [--max-mb 64] [--summary corpus_summary.json]

For the loss-parity call on real text (bench/device/loss_parity_real_text.sh): the device has no network, so the text is what a
stock Python image holds. Sources, in this order, each up to its share of ``--max-mb`` (what one leaves unused
goes to the next):

- ``stdlib``: the Python standard library's ``.py`` files (``sysconfig``'s ``stdlib``, without ``site-packages``);
- ``docs``: ``/usr/share/doc`` (copyright files, READMEs, changelogs; ``.gz`` decompressed) and
  ``/usr/share/common-licenses`` (license texts);
- ``man``: ``/usr/share/man`` roff pages (``.gz`` decompressed; English sections only);
- ``site-packages``: the installed packages' ``.py``, ``.md``, ``.rst`` and ``.txt`` files (``purelib``).

Within a source, files are taken in the order of the CRC-32 of their path (a spread sample when the source holds
more than its share, not the alphabetical first ones; the corpus depends only on the files present) until the share
is full; a file that is not UTF-8 text, or is under 64 bytes or over 1 MiB, is skipped. Each file is one document
(``{"text": ...}``): ``kubetitan prepare-data`` stores it as BOS + ids + EOS, and the loader's shuffle
(``data.order: shuffled``) permutes the ``seqLen + 1``-token windows, so a run does not train on one module or one
package at a time. The summary (per source: files, bytes, skipped, the top folders by bytes) goes to stdout and
to ``--summary``; ``--list`` writes every path taken with its bytes.

``--tokenizer-out DIR [--vocab-size 32768]`` also trains a byte-level BPE tokenizer on the corpus (the ``tokenizers``
library, as ``trainer/tools/make_assets.py`` makes kubetitan's builtin one: GPT-2's pre-tokenizer regex, BOS
``<|begin_of_text|>`` = 0 and EOS ``<|end_of_text|>`` = 1) and writes ``tokenizer.json`` and
``tokenizer_config.json`` there, for ``kubetitan prepare-data --tokenizer DIR``. Why: the builtin tokenizer is 644
tokens learnt from the shipped toy corpus, about 1.3 bytes a token on code and prose (nearly bytes); no Llama 3
tokenizer can be fetched on a machine without network, and a 32k vocabulary learnt from the text itself is the
nearest stand-in: 3.86 bytes a token on a 64 MB corpus of the development machine's files (70.1 MB of JSONL
input, 18,164,591 tokens, prepare-data's count; the builtin tokenizer: 1.28 on the 8 MB one).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import sysconfig
import zlib
from pathlib import Path

MIN_BYTES, MAX_BYTES = 64, 1 << 20
SHARES = {"stdlib": 0.55, "docs": 0.1, "man": 0.1, "site-packages": 0.25}
TEXT_SUFFIXES = {".py", ".md", ".rst", ".txt"}


def _walk(root: Path, keep) -> list[Path]:
    if not root.is_dir():
        return []
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", "site-packages", "dist-packages"))
        out += [Path(d) / f for f in files if keep(Path(d) / f)]
    return sorted(out)


def sources() -> dict[str, list[Path]]:
    """The candidate files of each source (sorted paths); a source missing on this machine is empty."""
    paths = sysconfig.get_paths()
    share = Path("/usr/share")
    return {
        "stdlib": _walk(Path(paths["stdlib"]), lambda p: p.suffix == ".py"),
        "docs": _walk(share / "doc", lambda p: p.is_file() and not p.is_symlink())
        + _walk(share / "common-licenses", lambda p: p.is_file() and not p.is_symlink()),
        "man": _walk(share / "man", lambda p: p.parent.name.startswith("man") and p.parent.parent == share / "man"
                     and p.is_file() and not p.is_symlink()),
        "site-packages": _walk(Path(paths["purelib"]), lambda p: p.suffix in TEXT_SUFFIXES),
    }


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def read_text(p: Path) -> str | None:
    """The file's text (``.gz`` decompressed), or None when it is not UTF-8 text of a usable size."""
    try:
        if p.stat().st_size > MAX_BYTES:
            return None
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        if not MIN_BYTES <= len(raw) <= MAX_BYTES or b"\0" in raw:
            return None
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def _top_folders(root: str, taken: list[tuple[Path, int]], n: int = 8) -> list[list]:
    """The ``n`` folders right under the source's root (or files at its top) holding the most bytes taken."""
    by: dict[str, int] = {}
    for p, size in taken:
        rel = os.path.relpath(p, root).split(os.sep)
        by[rel[0]] = by.get(rel[0], 0) + size
    return [[k, v] for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:n]]


def build(out: Path, max_bytes: int, listing: Path | None = None) -> dict:  # long: one pass, summary as it goes
    summary: dict = {"max_bytes": max_bytes, "sources": {}}
    budget_left, total = 0, 0
    cands = sources()
    roots = {"stdlib": sysconfig.get_paths()["stdlib"], "docs": "/usr/share", "man": "/usr/share/man",
             "site-packages": sysconfig.get_paths()["purelib"]}
    lst = listing.open("w") if listing else None
    with out.open("w") as f:
        for name, share in SHARES.items():
            budget = int(max_bytes * share) + budget_left
            used = skipped = 0
            taken: list[tuple[Path, int]] = []
            for p in sorted(cands[name], key=lambda p: (zlib.crc32(str(p).encode()), str(p))):
                if budget - used < MIN_BYTES:
                    break
                if p.suffix != ".gz" and _size(p) > budget - used:  # cannot fit: skip it without reading it
                    continue
                text = read_text(p)
                if text is None:
                    skipped += 1
                    continue
                n = len(text.encode())
                if used + n > budget:
                    continue
                f.write(json.dumps({"text": text}) + "\n")
                used += n
                taken.append((p, n))
                if lst:
                    lst.write(f"{name}\t{n}\t{p}\n")
            budget_left = budget - used
            total += used
            summary["sources"][name] = {"root": roots[name], "candidates": len(cands[name]), "files": len(taken),
                                        "bytes": used, "skipped": skipped,
                                        "top_folders": _top_folders(roots[name], taken)}
    if lst:
        lst.close()
    summary.update(total_bytes=total, documents=sum(s["files"] for s in summary["sources"].values()),
                   python=sys.version.split()[0], stdlib=sysconfig.get_paths()["stdlib"])
    return summary


BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def train_tokenizer(corpus: Path, out: Path, vocab_size: int) -> str:
    """A byte-level BPE of ``vocab_size`` tokens learnt from ``corpus`` (JSONL ``text``) into ``out``; a line
    saying what it is."""
    import time

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t0 = time.monotonic()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with corpus.open() as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in f), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=2) + "\n")
    return f"tokenizer {out}: byte-level BPE, {tok.get_vocab_size()} tokens, learnt in {time.monotonic() - t0:.1f} s"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--max-mb", type=float, default=64)
    ap.add_argument("--summary", type=Path)
    ap.add_argument("--list", type=Path, help="write every file taken: source, bytes, path")
    ap.add_argument("--tokenizer-out", type=Path, help="also learn a byte-level BPE tokenizer from the corpus here")
    ap.add_argument("--vocab-size", type=int, default=32768, help="its vocabulary (default 32768)")
    a = ap.parse_args(argv)
    s = build(a.out, int(a.max_mb * 2**20), a.list)
    for name, v in s["sources"].items():
        top = ", ".join(f"{k} {b / 1e6:.2f}" for k, b in v["top_folders"])
        print(f"{name:14s} {v['files']:6d} files {v['bytes'] / 1e6:8.2f} MB (of {v['candidates']} candidates, "
              f"{v['skipped']} skipped) under {v['root']}; most MB: {top}")
    print(f"corpus {a.out}: {s['documents']} documents, {s['total_bytes']:,} bytes of UTF-8 text")
    if a.summary:
        a.summary.write_text(json.dumps(s, indent=1) + "\n")
    if a.tokenizer_out:
        print(train_tokenizer(a.out, a.tokenizer_out, a.vocab_size), flush=True)


if __name__ == "__main__":
    main()
