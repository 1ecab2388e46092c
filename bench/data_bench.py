"""The data plane's throughput in one run (docs/benchmarks.md, "Data preparation and reading").

Prints:

1. the tokenizer's raw ``encode_batch_fast`` rate on one core (MB/s, tokens/s): the ceiling of one worker;
2. ``kubetitan prepare-data`` MB/s and tokens/s with 1, 2, ... workers (``--workers``), as it reports its tokenizing
   phase, its wall time including start-up, its CPU time and its peak RSS; targets: >= 0.8x the raw rate per worker,
   >= 1.8x from 1 to 2, peak RSS < 1 GiB (``--long-docs N``: the corpus also holds a text file of N single-line
   documents of ``--long-mb`` MB each, the base corpus's text with its newlines made spaces);
3. peak RSS of ``prepare-data`` (the main process plus its workers, sampled; and the largest single process) on a
   large input (``--large-mb``, default 1024: the base corpus repeated); target < 1 GiB for a 1 GB input;
4. the shard reader's tokens/s on one core (``ShardSet.read`` of ``seq_len + 1`` windows at random offsets, as a
   shuffling loader reads) against the 3B H200 recipe's consumption (29,146 tokens/s, docs/benchmarks.md);
   and the CRC-32 pass of ``verify_checksums``.

The corpus is real text found on the machine, no download: every readable text file under /usr/share/doc (gzip
ones decompressed) and Python sources of the interpreter's library, one JSONL document per file, up to ``--base-mb``.

    python bench/data_bench.py [--base-mb 24] [--large-mb 1024] [--workers 1,2] [--tokenizer builtin|DIR]
                               [--long-docs 2 --long-mb 9.4]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
RECIPE_3B_TOKENS_PER_S = 29_146
"""kubetitan's 3B recipe on one H200 (docs/benchmarks.md, 2026-12-04): what one GPU consumes."""


def collect_corpus(path: Path, target_bytes: int) -> tuple[int, int]:
    """Write up to ``target_bytes`` of JSONL documents (one per source file); returns (documents, text bytes)."""
    roots = [Path("/usr/share/doc"), Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    docs = size = 0
    with open(path, "w", encoding="utf-8") as out:
        for root in roots:
            for f in sorted(root.rglob("*")):
                if size >= target_bytes:
                    return docs, size
                if not f.is_file() or f.is_symlink() or not (f.suffix in (".py", ".txt", ".md", ".rst", ".gz")
                                                             or root.name == "doc"):
                    continue
                try:
                    raw = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
                    text = raw.decode("utf-8")
                except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
                    continue
                if not text.strip() or "\x00" in text:
                    continue
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                out.write(line)
                docs += 1
                size += len(line.encode())
    return docs, size


RAW = r"""
import json, os, sys, time
os.environ["RAYON_NUM_THREADS"] = "1"
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8")]
limit = int(sys.argv[3])
batches, cur, cur_bytes, total = [], [], 0, 0
for t in texts:
    n = len(t.encode())
    if total + n > limit:
        break
    cur.append(t); cur_bytes += n; total += n
    if len(cur) >= 1024 or cur_bytes >= 1 << 20:
        batches.append(cur); cur, cur_bytes = [], 0
if cur:
    batches.append(cur)
t0 = time.perf_counter(); cpu0 = time.process_time()
tokens = sum(len(e.ids) for b in batches for e in tok.encode_batch_fast(b, add_special_tokens=False))
dt = time.perf_counter() - t0; cpu = time.process_time() - cpu0
print(json.dumps({"bytes": total, "tokens": tokens, "seconds": dt, "cpu_seconds": cpu}))
"""


def write_long_docs(base: Path, out: Path, n: int, mb: float) -> int:
    """``n`` single-line documents of ``mb`` MB each (a ``.txt`` file: one document per line), made of the base
    corpus's text with newlines turned into spaces; returns the file's bytes."""
    text = " ".join(json.loads(line)["text"].replace("\n", " ").replace("\r", " ") for line in open(base, encoding="utf-8"))
    size = int(mb * 1e6)
    with open(out, "w", encoding="utf-8") as f:
        for i in range(n):
            start = (i * size) % max(1, len(text) - size) if len(text) > size else 0
            doc = text[start:start + size]
            while len(doc.encode()) < size:
                doc += " " + text[:size - len(doc)]
            f.write(doc + "\n")
    return out.stat().st_size


def schedule(costs: list[float], order: list[int], workers: int) -> float:
    """The makespan of handing units out in ``order`` to the first free of ``workers`` (what the pool does)."""
    free = [0.0] * workers
    for u in order:
        i = free.index(min(free))
        free[i] += costs[u]
    return max(free)


def balance(out: Path, workers: int) -> str:
    """The speed-up ``workers`` idle cores would give, from each unit's CPU seconds (parts/unit-N.json of a run):
    units handed out largest first (prepare-data's order) against unit order (before), total over makespan."""
    recs = sorted((json.loads(p.read_text()) for p in (out / "parts").glob("unit-*.json")), key=lambda r: r["unit"])
    costs = [r["cpu_seconds"] for r in recs]
    largest = sorted(range(len(recs)), key=lambda u: (-recs[u]["bytes"], u))
    total = sum(costs)
    return (f"load balance over {workers} idle cores, from the 1-worker run's {len(costs)} units' CPU seconds "
            f"(total {total:.1f} s, largest unit {max(costs):.1f} s): largest first {total / schedule(costs, largest, workers):.2f}x, "
            f"in unit order {total / schedule(costs, list(range(len(costs))), workers):.2f}x")


def raw_rate(tokenizer_json: str, corpus: Path, limit: int) -> dict:
    r = subprocess.run([sys.executable, "-c", RAW, tokenizer_json, str(corpus), str(limit)], capture_output=True,
                       text=True, check=True)
    return json.loads(r.stdout)


def run_prepare(inputs: list[str], out: Path, workers: int, tokenizer: str, sample_rss: bool = False) -> dict:
    cmd = [sys.executable, "-m", "kubetitan_trainer.data.prepare", *inputs, "-o", str(out), "--workers", str(workers),
           "--tokenizer", tokenizer, "--no-progress"]
    t0 = time.monotonic()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_sum = peak_one = 0
    if sample_rss:
        proc = psutil.Process(p.pid)
        while p.poll() is None:
            try:
                procs = [proc, *proc.children(recursive=True)]
                rss = [q.memory_info().rss for q in procs]
            except psutil.NoSuchProcess:
                continue
            peak_sum, peak_one = max(peak_sum, sum(rss)), max(peak_one, max(rss))
            time.sleep(0.1)
    stdout, stderr = p.communicate()
    wall = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the workers were waited for by prepare-data: included
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if p.returncode:
        raise SystemExit(f"prepare-data failed ({p.returncode}): {stderr[-2000:]}")
    m = re.search(r"tokenized ([\d,.]+) MB into ([\d,]+) tokens in ([\d.]+) s", stderr)
    assert m, stderr
    mb, tokens, secs = float(m.group(1).replace(",", "")), int(m.group(2).replace(",", "")), float(m.group(3))
    return {"workers": workers, "MB": mb, "tokens": tokens, "tokenize_seconds": secs, "wall_seconds": wall,
            "MB_per_s": mb / secs, "tokens_per_s": tokens / secs, "peak_rss_sum_bytes": peak_sum,
            "peak_rss_largest_process_bytes": peak_one, "cpu_seconds": cpu, "MB_per_cpu_s": mb / cpu}


def reader_rate(shards: Path, seq_len: int, seconds: float = 5.0) -> dict:
    sys.path.insert(0, str(REPO / "trainer"))
    from kubetitan_trainer.data.shards import ShardSet

    ss = ShardSet.open(shards, verify="size")
    t0 = time.perf_counter()
    ss.verify_checksums()
    crc_s = time.perf_counter() - t0
    crc_bytes = sum((shards / s.name).stat().st_size for s in ss.shards)
    ss = ShardSet.open(shards, verify="size", vocab_size=ss.vocab_size)
    rng = np.random.default_rng(0)
    n = seq_len + 1
    reads = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for off in rng.integers(0, ss.total_tokens - n, size=256):
            ss.read(int(off), n)
        reads += 256
    dt = time.perf_counter() - t0
    return {"seq_len": seq_len, "windows": reads, "tokens_per_s": reads * n / dt, "windows_per_s": reads / dt,
            "headroom_vs_3b_h200": reads * n / dt / RECIPE_3B_TOKENS_PER_S, "crc32_GB_per_s": crc_bytes / crc_s / 1e9,
            "total_tokens": ss.total_tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-mb", type=float, default=24.0, help="corpus size for the rate measurements")
    ap.add_argument("--large-mb", type=float, default=1024.0, help="input size for the peak-RSS run (0: skip)")
    ap.add_argument("--workers", default="1,2", help="worker counts to measure")
    ap.add_argument("--large-workers", type=int, default=2)
    ap.add_argument("--padded-mb", type=float, default=0.0,
                    help="also a JSONL input of this size whose lines carry each base document twice, once in a "
                         "'meta' key that is parsed but not tokenized and once cut to 256 characters as 'text': "
                         "the streaming reader's memory on a large file, at a fraction of the tokenizing time")
    ap.add_argument("--long-docs", type=int, default=0, help="also single-line documents in a .txt input")
    ap.add_argument("--long-mb", type=float, default=9.4, help="size of each --long-docs document")
    ap.add_argument("--tokenizer", default="builtin")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--workdir", default="", help="where the corpus and shards go (default: a temp dir)")
    a = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "trainer"), str(REPO / "operator" / "core"),
                                                os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(REPO / "trainer"))
    from kubetitan_trainer.data.prepare import BUILTIN_TOKENIZER

    tok_json = str((BUILTIN_TOKENIZER if a.tokenizer == "builtin" else Path(a.tokenizer)) / "tokenizer.json")
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# data_bench on {os.uname().nodename}: {psutil.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, nice {os.nice(0)}, tokenizer {a.tokenizer}")
    base = work / "base.jsonl"
    t0 = time.monotonic()
    docs, size = collect_corpus(base, int(a.base_mb * 1e6))
    print(f"corpus: {docs:,} documents (files of /usr/share/doc and Python sources), {size / 1e6:.1f} MB JSONL "
          f"({time.monotonic() - t0:.1f} s to collect)")

    raw = raw_rate(tok_json, base, int(min(size, 8e6)))
    raw_mbs, raw_tps = raw["bytes"] / raw["seconds"] / 1e6, raw["tokens"] / raw["seconds"]
    print(f"raw encode_batch_fast, one thread: {raw_mbs:.2f} MB/s, {raw_tps:,.0f} tokens/s "
          f"({raw['bytes'] / 1e6:.1f} MB of text, {raw['tokens'] / raw['bytes']:.3f} tokens/byte, "
          f"CPU/wall {raw['cpu_seconds'] / raw['seconds']:.2f}: {raw['bytes'] / raw['cpu_seconds'] / 1e6:.2f} MB "
          f"per CPU-second)")

    inputs = [str(base)]
    if a.long_docs:
        long_bytes = write_long_docs(base, work / "long.txt", a.long_docs, a.long_mb)
        inputs.append(str(work / "long.txt"))
        print(f"long documents: {a.long_docs} single-line documents of {a.long_mb} MB in long.txt "
              f"({long_bytes / 1e6:.1f} MB)")
    results = []
    for w in [int(x) for x in a.workers.split(",")]:
        r = run_prepare(inputs, work / f"out-w{w}", w, a.tokenizer, sample_rss=True)
        results.append(r)
        print(f"prepare-data --workers {w}: {r['MB_per_s']:.2f} MB/s, {r['tokens_per_s']:,.0f} tokens/s "
              f"({r['MB']:.1f} MB in {r['tokenize_seconds']:.1f} s; wall with start-up {r['wall_seconds']:.1f} s); "
              f"per worker {r['MB_per_s'] / w / raw_mbs:.2f}x the raw rate (target >= 0.8); "
              f"{r['MB_per_cpu_s']:.2f} MB per CPU-second of the whole command "
              f"({r['MB_per_cpu_s'] / (raw['bytes'] / raw['cpu_seconds'] / 1e6):.2f}x the raw rate per CPU-second); "
              f"peak RSS {r['peak_rss_sum_bytes'] / 2**20:,.0f} MiB together, largest process "
              f"{r['peak_rss_largest_process_bytes'] / 2**20:,.0f} MiB (target < 1024)")
    if len(results) > 1:
        one = results[0]
        for r in results[1:]:
            print(f"speed-up {one['workers']} -> {r['workers']} workers: {r['MB_per_s'] / one['MB_per_s']:.2f}x "
                  f"(target for 1 -> 2: >= 1.8); load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if a.long_docs:
        print(balance(work / f"out-w{results[0]['workers']}", 2))
    same = len({(work / f"out-w{r['workers']}" / "index.json").read_text() for r in results}) == 1
    print(f"index.json identical for every worker count: {same}")

    rd = reader_rate(work / f"out-w{results[0]['workers']}", a.seq_len)
    print(f"reader, one core: {rd['tokens_per_s']:,.0f} tokens/s ({rd['windows_per_s']:,.0f} random windows of "
          f"{a.seq_len + 1} tokens/s from {rd['total_tokens']:,} tokens) = {rd['headroom_vs_3b_h200']:.0f}x the 3B "
          f"H200 recipe's {RECIPE_3B_TOKENS_PER_S:,} tokens/s; CRC-32 pass {rd['crc32_GB_per_s']:.2f} GB/s")

    if a.large_mb > 0:
        large = work / "large.jsonl"
        chunk = base.read_bytes()
        with open(large, "wb") as f:
            written = 0
            while written < a.large_mb * 1e6:
                f.write(chunk)
                written += len(chunk)
        del chunk
        r = run_prepare([str(large)], work / "out-large", a.large_workers, a.tokenizer, sample_rss=True)
        print(f"large input {written / 1e9:.2f} GB, --workers {a.large_workers}: peak RSS {r['peak_rss_sum_bytes'] / 2**20:,.0f} "
              f"MiB for the main process and its workers together (largest single process "
              f"{r['peak_rss_largest_process_bytes'] / 2**20:,.0f} MiB; target < 1024 MiB); {r['MB_per_s']:.2f} MB/s, "
              f"{r['tokens_per_s']:,.0f} tokens/s, {r['tokenize_seconds']:.0f} s")
        large.unlink()
    if a.padded_mb > 0:
        padded = work / "padded.jsonl"
        written = 0
        with open(padded, "w", encoding="utf-8") as f:
            while written < a.padded_mb * 1e6:
                for line in open(base, encoding="utf-8"):
                    text = json.loads(line)["text"]
                    out = json.dumps({"meta": text, "text": text[:256]}, ensure_ascii=False) + "\n"
                    f.write(out)
                    written += len(out.encode())
        r = run_prepare([str(padded)], work / "out-padded", a.large_workers, a.tokenizer, sample_rss=True)
        print(f"padded input {written / 1e9:.2f} GB (text fields {r['tokens']:,} tokens), --workers "
              f"{a.large_workers}: peak RSS {r['peak_rss_sum_bytes'] / 2**20:,.0f} MiB together (largest single process "
              f"{r['peak_rss_largest_process_bytes'] / 2**20:,.0f} MiB); {r['MB_per_s']:.2f} MB/s of input, "
              f"{r['tokenize_seconds']:.0f} s")
        padded.unlink()
    print(f"# load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
