"""Which Triton kernels does each worker generation benchmark, and did Inductor have their choice on disk?

Reads a launcher log written with ``TORCH_LOGS=+torch._inductor.runtime.triton_heuristics`` (Inductor's autotuner
then logs ``Benchmark all input configs for KERNEL, get:`` and one line per configuration), splits it at the
trainer's ``Start-up of generation N`` lines (a kernel benchmarked before generation N's line counts for N: its
first step), and for every kernel name looks in the compile cache for the kernel's source file(s) (``def KERNEL(``)
and for the ``.best_config`` file Inductor would read for it (``torch._inductor.runtime.autotune_cache``: the
sha256 of ``<basename>:<cache_key_tag>`` hashed again with ``torch_key()``, beside the source). Prints a table:

    python bench/autotune_names.py LAUNCHER_LOG[.gz] CACHE_DIR [--json OUT.json]

Needs torch (for ``torch_key``) only to name the ``.best_config`` files; without it the column says ``?``. Reads one
rank's log (the bench's single-GPU runs): with several ranks' lines mixed in, their calls add up per generation.
Calls after the last start-up line count for the generation after it (one that never finished its first step).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import os
import re
import sys
from pathlib import Path

BENCH = re.compile(r"Benchmark all input configs for (\w+), get:")
CONFIG = re.compile(r": ([0-9.]+), nreg (\d+), nspill (\d+)")
STARTUP = re.compile(r"Start-up of generation (\d+)")


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", errors="replace") as f:
        return [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in f]


def benchmarks(lines: list[str]) -> list[dict]:
    """One dict per benchmark call: generation, kernel, configurations seen and the best time (ms)."""
    out: list[dict] = []
    generation_lines = [int(m.group(1)) for line in lines if (m := STARTUP.search(line))]
    gen_index = 0  # calls before the i-th start-up line belong to that line's generation
    current: dict | None = None
    for line in lines:
        if m := STARTUP.search(line):
            gen_index += 1
            current = None
            continue
        if m := BENCH.search(line):
            gen = generation_lines[gen_index] if gen_index < len(generation_lines) else (
                (generation_lines[-1] + 1) if generation_lines else 0)
            current = {"generation": gen, "kernel": m.group(1), "configs": 0, "best_ms": None}
            out.append(current)
            continue
        if current is not None and "best config" not in line.lower() and (c := CONFIG.search(line)):
            current["configs"] += 1
            t = float(c.group(1))
            current["best_ms"] = t if current["best_ms"] is None else min(current["best_ms"], t)
    return out


def kernel_files(cache: Path, names: set[str]) -> dict[str, list[Path]]:
    """Every ``.py`` file under ``cache`` that defines one of ``names``."""
    found: dict[str, list[Path]] = collections.defaultdict(list)
    pattern = re.compile(r"^def (\w+)\(", re.M)
    for root, _dirs, files in os.walk(cache):
        for f in files:
            if not f.endswith(".py"):
                continue
            p = Path(root) / f
            try:
                text = p.read_text(errors="replace")
            except OSError:
                continue
            for name in set(pattern.findall(text)) & names:
                found[name].append(p)
    return found


def best_config_path(source: Path) -> Path | None:
    """The ``.best_config`` Inductor reads for the kernel in ``source`` (None without torch)."""
    try:
        from torch._inductor.codecache import torch_key
        from torch.compiler import config as cconfig
    except ImportError:
        return None
    key = hashlib.sha256(f"{source.name}:{cconfig.cache_key_tag}".encode()).hexdigest()
    h = hashlib.sha256(key.encode())
    h.update(torch_key())
    return source.parent / f"{h.hexdigest()}.best_config"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("cache", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    calls = benchmarks(read_lines(a.log))
    if not calls:
        print(f"no 'Benchmark all input configs' lines in {a.log}: was TORCH_LOGS="
              "+torch._inductor.runtime.triton_heuristics set for the workers?")
        return 1
    files = kernel_files(a.cache, {c["kernel"] for c in calls}) if a.cache.is_dir() else {}
    by_gen: dict[int, list[dict]] = collections.defaultdict(list)
    for c in calls:
        by_gen[c["generation"]].append(c)
    rows = []
    for gen in sorted(by_gen):
        print(f"generation {gen}: {len(by_gen[gen])} benchmark calls")
        for c in by_gen[gen]:
            srcs = files.get(c["kernel"], [])
            bests = [best_config_path(s) for s in srcs]  # None: no torch to name them
            found = [b for b in bests if b is not None and b.exists()]
            state = ("no source" if not srcs else "?" if None in bests else
                     ",".join("yes" if b in found else "no" for b in bests))
            row = {**c, "sources": [str(s) for s in srcs], "best_config": state}
            if found:
                try:
                    row["best_config_content"] = json.loads(found[0].read_text())
                except (OSError, ValueError) as e:  # written while the run was cut off: say so in the row
                    row["best_config_content"] = f"unreadable: {e}"
            rows.append(row)
            print(f"  {c['kernel']:<60} {c['configs']:>2} configs  best {c['best_ms']} ms  "
                  f"{len(srcs)} source file(s)  .best_config: {state}")
    later = [g for g in sorted(by_gen) if g > 0]
    every = set.intersection(*({c["kernel"] for c in by_gen[g]} for g in later)) if later else set()
    print(f"benchmark calls by generation: " + ", ".join(f"{g}: {len(by_gen[g])}" for g in sorted(by_gen)))
    print(f"kernels benchmarked in every generation after generation 0 ({', '.join(map(str, later)) or '-'}): "
          f"{len(every)}: {', '.join(sorted(every)) or '-'}")
    if a.json:
        a.json.write_text("\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
