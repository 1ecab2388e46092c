"""S3 shards staging bench: MB/s of staging a shards directory from an S3-compatible server to local disk
(kubetitan_trainer.data.s3shards: ranged GETs, CRC-32 of every file), by GETs in flight, against a local copy.

    python bench/s3_stage_bench.py [--shards 4] [--shard-mb 32] [--threads 1,4,8] [--out FILE.txt]

The shards are synthetic (random uint16 tokens, one document per shard) written by the trainer's own ShardWriter,
uploaded to moto's S3 server (its own venv, started here on 127.0.0.1), then staged afresh once per ``--threads``
value; a second staging of the last one shows the restart cost (a LIST and index.json, no shard). The local copy is
``shutil.copyfile`` plus the same CRC-32 pass, the floor of any staging.

Caveats printed with the numbers: moto is one Python process on this shared 2-core machine (S3 serves each ranged
GET from many hosts), and both sides write to this VM's disk with a page cache: compare the shape, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "trainer"), str(REPO / "operator" / "core"), str(REPO / "operator"), str(REPO / "tests")]

import numpy as np  # noqa: E402

from kubetitan_trainer import compat, storage  # noqa: E402
from kubetitan_trainer.data import s3shards
from kubetitan_trainer.data.shards import ShardWriter, crc32_file, make_index  # noqa: E402


def make_shards(out: Path, n: int, mb: int) -> int:
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    files = []
    for i in range(n):
        w = ShardWriter(out, f"shard-{i:06d}.bin", "uint16")
        tokens = mb * 2**20 // 2
        w.add(rng.integers(0, 60000, size=tokens, dtype=np.int64), np.asarray([tokens], dtype=np.int64))
        files.append(w.close())
    (out / "index.json").write_text(json.dumps(make_index(files, dtype="uint16", vocab_size=65536, bos_id=None,
                                                          eos_id=None, tokenizer={"name": "bench"})))
    return sum(p.stat().st_size for p in out.iterdir())


def start_moto(work: Path) -> tuple[subprocess.Popen, str]:
    from kmockx.harness import free_port

    moto = shutil.which("moto_server") or str(REPO / ".tools" / "bin" / "moto_server")
    port = free_port()
    server = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=open(work / "moto.log", "wb"),
                              stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2)
            return server, endpoint
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("moto_server did not start (run `make setup`)")
            time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--shard-mb", type=int, default=32)
    p.add_argument("--threads", default="1,4,8")
    p.add_argument("--out", help="also write the report here")
    a = p.parse_args()
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    work = Path(tempfile.mkdtemp(prefix="s3stage-"))
    server, endpoint = start_moto(work)
    try:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        size = make_shards(work / "src", a.shards, a.shard_mb)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=30)
        uri = f"s3://{bucket}/shards"
        s3 = storage.S3Settings(uri=uri, endpoint=endpoint, force_path_style=True)
        client = compat.s3_client(s3, compat.s3_client_config(s3))
        for f in sorted((work / "src").iterdir()):
            with client.put_object(bucket, f"shards/{f.name}") as w:
                w.write(f.read_bytes())
        say(f"# s3_stage_bench {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {os.cpu_count()} CPUs, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at start")
        say(f"# {a.shards} shards x {a.shard_mb} MiB (+ .idx, index.json) = {size / 1e6:.1f} MB; part size "
            f"{s3.part_size_bytes >> 20} MiB; S3 server: moto 5.2.5 server mode on 127.0.0.1 (not S3)")
        t0 = time.monotonic()
        (work / "copy").mkdir()
        for f in (work / "src").iterdir():
            shutil.copyfile(f, work / "copy" / f.name)
            crc32_file(work / "copy" / f.name)
        secs = time.monotonic() - t0
        say(f"local copy + CRC-32        {secs:6.2f} s  {size / 1e6 / secs:7.1f} MB/s")
        for threads in [int(x) for x in a.threads.split(",")]:
            stage = work / f"stage-{threads}"
            settings = s3shards.StageSettings(s3, stage_dir=str(stage), threads=threads)
            t0 = time.monotonic()
            s3shards.stage(uri, settings, "bench")
            secs = time.monotonic() - t0
            say(f"staged, {threads} GET(s) in flight  {secs:6.2f} s  {size / 1e6 / secs:7.1f} MB/s")
        t0 = time.monotonic()
        s3shards.stage(uri, settings, "bench")
        say(f"restart (all reused)       {time.monotonic() - t0:6.2f} s")
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
