"""Token shards read from ``s3://`` against a real S3-compatible server (moto's server mode, tests/s3/conftest.py):
shards written by ``kubetitan prepare-data`` are uploaded as ``aws s3 sync`` would, staged to local disk with every
CRC-32 checked (kubetitan_trainer.data.s3shards), and a CPU run from the bucket trains exactly the samples and losses of
the same run from the local directory, through 503 SlowDown and connection resets. A corrupt or truncated object and
a missing bucket are the configuration exit code naming the object or the bucket, never a traceback."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kubetitan_core import render
from kubetitan_core.contract import ExitCode
from kubetitan_trainer import compat, storage
from kubetitan_trainer.data import s3shards
from kubetitan_trainer.errors import ConfigError
from support.specs import tiny_lpt
from support.trainer import launch, ledger_config

pytestmark = [pytest.mark.xdist_group("trainer-torch"), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory) -> Path:
    """A prepare-data directory of the trainer's builtin corpus, in shards of about 40 KB (several files)."""
    from kubetitan_trainer.data.loaders import BUILTIN_CORPUS
    from kubetitan_trainer.data.prepare import main

    out = tmp_path_factory.mktemp("prepared") / "corpus"
    assert main([str(BUILTIN_CORPUS), "-o", str(out), "--shard-tokens", "20000"]) == 0
    return out


def _client(endpoint: str):
    s = storage.S3Settings(uri="s3://x", endpoint=endpoint, force_path_style=True)
    return compat.s3_client(s, compat.s3_client_config(s))


def upload(endpoint: str, local: Path, bucket: str, prefix: str, replace: dict[str, bytes] | None = None) -> str:
    """Every file of ``local`` to ``s3://bucket/prefix/`` (what ``aws s3 sync local s3://bucket/prefix/`` does);
    ``replace`` uploads other bytes under a file's name."""
    client = _client(endpoint)
    for p in sorted(x for x in local.rglob("*") if x.is_file()):
        rel = p.relative_to(local).as_posix()
        with client.put_object(bucket, f"{prefix}/{rel}") as w:
            w.write((replace or {}).get(rel, p.read_bytes()))
    return f"s3://{bucket}/{prefix}"


def _settings(endpoint: str, uri: str, stage_dir: Path, part: int = 5 * 2**20) -> s3shards.StageSettings:
    return s3shards.StageSettings(storage.S3Settings(uri=uri, endpoint=endpoint, force_path_style=True,
                                                     part_size_bytes=part), stage_dir=str(stage_dir), threads=4)


FIELD = "kubetitan.data.shards_path (spec.data.shards.path)"


def test_staging_copies_every_file_verified_and_a_restart_reuses_them(s3_server, fault_proxy, bucket, s3_env,
                                                                      shards_dir, tmp_path, caplog):
    uri = upload(s3_server.endpoint, shards_dir, bucket, "c4/en")
    index = json.loads((shards_dir / "index.json").read_text())
    assert len(index["files"]) >= 3, "the corpus should span several shards"
    # 503 SlowDown on the first GETs and a connection reset: the client retries them
    f503 = fault_proxy.inject("503", "GET", 3, path_contains="/shard-")
    reset = fault_proxy.inject("reset", "GET", 1, path_contains="/shard-")
    caplog.set_level("INFO", logger="kubetitan.s3shards")
    got = s3shards.stage(uri, _settings(fault_proxy.endpoint, uri, tmp_path), FIELD)
    assert got == tmp_path / bucket / "c4" / "en"
    assert (f503.hits, reset.hits) == (3, 1), fault_proxy.requests[:12]
    for p in shards_dir.glob("shard-*"):
        assert (got / p.name).read_bytes() == p.read_bytes(), p.name
    assert (got / "index.json").read_bytes() == (shards_dir / "index.json").read_bytes()
    assert f"Staged {uri} to {got}" in caplog.text and "MB/s" in caplog.text
    gets = sum(1 for m, path, _s in fault_proxy.requests if m == "GET" and "/shard-" in path)

    # a second start (a restart on the same node) lists and reads index.json, and downloads no shard again
    fault_proxy.requests.clear()
    caplog.clear()
    assert s3shards.stage(uri, _settings(fault_proxy.endpoint, uri, tmp_path), FIELD) == got
    assert not [r for r in fault_proxy.requests if "/shard-" in r[1]], fault_proxy.requests
    assert "Reused the staged copy" in caplog.text
    assert gets >= 2 * len(index["files"]), "one ranged GET per file at least (.bin and .idx)"

    # a staged file changed on the node since it was verified is downloaded again
    victim = got / index["files"][0]["name"]
    victim.write_bytes(b"\0" * victim.stat().st_size)
    s3shards.stage(uri, _settings(s3_server.endpoint, uri, tmp_path), FIELD)
    assert victim.read_bytes() == (shards_dir / victim.name).read_bytes()


def test_processes_of_a_node_staging_at_once_download_each_object_once(s3_server, fault_proxy, bucket, s3_env,
                                                                        shards_dir, tmp_path):
    """Every local rank calls the stager; the file lock lets one download while the others wait, then reuse."""
    import threading

    uri = upload(s3_server.endpoint, shards_dir, bucket, "shared")
    got: list[Path] = []
    ranks = [threading.Thread(target=lambda: got.append(s3shards.stage(uri, _settings(fault_proxy.endpoint, uri,
                                                                                       tmp_path), FIELD)))
             for _ in range(3)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout=120)
    assert len(got) == 3 and len(set(got)) == 1
    gets = [p for m, p, _s in fault_proxy.requests if m == "GET" and "/shard-" in p]
    assert gets and len(gets) == len(set(gets)), "an object was downloaded twice"
    assert len(set(gets)) == 3 * len(json.loads((shards_dir / "index.json").read_text())["files"])  # .bin .idx .crc


def test_parts_are_parallel_ranged_gets(s3_server, fault_proxy, bucket, s3_env, tmp_path):
    """A file larger than the part size comes in ranged GETs, each retried on its own (a reset on one part)."""
    big = tmp_path / "big"
    from kubetitan_trainer.data.shards import ShardWriter, make_index

    import numpy as np

    big.mkdir()
    w = ShardWriter(big, "shard-000000.bin", "uint16")
    w.add(np.arange(6 * 2**20 // 2 * 2, dtype=np.int64) % 500, np.asarray([6 * 2**20], dtype=np.int64))
    entry = w.close()
    (big / "index.json").write_text(json.dumps(make_index([entry], dtype="uint16", vocab_size=512, bos_id=None,
                                                          eos_id=None, tokenizer={"name": "t"})))
    uri = upload(s3_server.endpoint, big, bucket, "big")
    reset = fault_proxy.inject("reset", "GET", 1, path_contains="/shard-000000.bin")
    got = s3shards.stage(uri, _settings(fault_proxy.endpoint, uri, tmp_path / "stage"), FIELD)
    assert (got / "shard-000000.bin").read_bytes() == (big / "shard-000000.bin").read_bytes()
    assert reset.hits == 1
    parts = [r for r in fault_proxy.requests if r[0] == "GET" and r[1].endswith("/shard-000000.bin") and r[2] == 206]
    assert len(parts) == 3, fault_proxy.requests  # 12 MiB in 5 MiB parts


def _file(shards_dir: Path, shard: int, key: str = "name") -> str:
    """The name of shard ``shard``'s .bin (``key`` name) or .idx (``doc_index``) in the index."""
    return json.loads((shards_dir / "index.json").read_text())["files"][shard][key]


CORRUPT = [
    # (id, which file (shard, index key), its uploaded bytes from the good ones, what the message says)
    ("flipped-byte", (1, "name"), lambda b: b[:10] + bytes([b[10] ^ 0xFF]) + b[11:], "is corrupt: its CRC-32"),
    ("truncated", (1, "name"), lambda b: b[:-6], "is truncated"),
    ("corrupt-doc-index", (0, "doc_index"), lambda b: b[:-1] + bytes([b[-1] ^ 1]), "is corrupt: its CRC-32"),
]


@pytest.mark.parametrize("which, mangle, says", [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_a_corrupt_or_truncated_object_is_a_config_error_naming_it(s3_server, bucket, s3_env, shards_dir, tmp_path,
                                                                   which, mangle, says):
    name = _file(shards_dir, *which)
    uri = upload(s3_server.endpoint, shards_dir, bucket, "bad",
                 replace={name: mangle((shards_dir / name).read_bytes())})
    with pytest.raises(ConfigError) as e:
        s3shards.stage(uri, _settings(s3_server.endpoint, uri, tmp_path), FIELD)
    msg = str(e.value)
    assert f"s3://{bucket}/bad/{name} {says}" in msg and "aws s3 cp" in msg, msg
    assert e.value.field == FIELD
    assert not (tmp_path / bucket / "bad" / name).exists(), "a bad file never lands under its real name"


def test_a_prefix_without_index_and_a_missing_bucket_are_config_errors(s3_server, bucket, s3_env, tmp_path):
    uri = f"s3://{bucket}/nothing-here"
    with pytest.raises(ConfigError, match=rf"there is no index.json under {uri}/ .*aws s3 sync"):
        s3shards.stage(uri, _settings(s3_server.endpoint, uri, tmp_path), FIELD)
    uri = "s3://no-such-bucket-kt-data/c4"
    with pytest.raises(ConfigError) as e:
        s3shards.stage(uri, _settings(s3_server.endpoint, uri, tmp_path), FIELD)
    assert "the bucket 'no-such-bucket-kt-data' does not exist" in str(e.value)
    assert "create the bucket 'no-such-bucket-kt-data'" in str(e.value)


class _FakeS3:
    """An in-process stand-in for the S3 client over a local directory: LIST and ranged GETs, each GET recorded;
    ``mangle`` serves other bytes for a file (a corrupt object)."""

    def __init__(self, root: Path, mangle: dict[str, Any] | None = None) -> None:
        self.root, self.mangle, self.gets = root, mangle or {}, []
        self.lock = threading.Lock()

    def list_objects(self, bucket: str, prefix: str):
        yield SimpleNamespace(object_info=[SimpleNamespace(key=prefix + p.name, size=p.stat().st_size)
                                           for p in sorted(self.root.iterdir())])

    def get_object(self, bucket: str, key: str, object_info: Any = None, reader_constructor: Any = None):
        name, fake = key.rsplit("/", 1)[-1], self

        class Reader:
            pos = 0

            def seek(self, n: int) -> None:
                self.pos = n

            def readinto(self, buf: bytearray) -> int:
                with fake.lock:
                    fake.gets.append((name, self.pos))
                data = (fake.root / name).read_bytes()
                data = fake.mangle.get(name, lambda b: b)(data)[self.pos:self.pos + len(buf)]
                buf[:len(data)] = data
                return len(data)

        return Reader()


def _many_shards(d: Path, files: int, size: int) -> list[str]:
    """A shards directory of ``files`` .bin files of ``size`` bytes each (and their small .idx); the .bin names."""
    import numpy as np

    from kubetitan_trainer.data.shards import ShardWriter, make_index

    d.mkdir()
    entries = []
    for i in range(files):
        w = ShardWriter(d, f"shard-{i:06d}.bin", "uint16")
        w.add(np.arange(size // 2, dtype=np.int64) % 500, np.asarray([size // 2], dtype=np.int64))
        entries.append(w.close())
    (d / "index.json").write_text(json.dumps(make_index(entries, dtype="uint16", vocab_size=512, bos_id=None,
                                                        eos_id=None, tokenizer={"name": "t"})))
    return [e["name"] for e in entries]


def test_a_corrupt_object_is_reported_without_downloading_every_other_file(tmp_path, monkeypatch):
    """Six files of 16 parts, two at a time; the first is corrupt: the error comes once its second download fails,
    the files not yet started are never fetched (before the abort, every other file was downloaded first)."""
    names = _many_shards(tmp_path / "src", files=6, size=16 * 1024)
    fake = _FakeS3(tmp_path / "src", mangle={names[0]: lambda b: b[:-1] + bytes([b[-1] ^ 1])})
    monkeypatch.setattr(compat, "s3_client", lambda settings, config: fake)
    monkeypatch.setattr(s3shards.time, "sleep", lambda s: None)
    # The third and later files start (on their file thread) only once the stage is aborted, so that the other file
    # thread cannot run ahead through every file while the first is fetched twice (as on a loaded machine). The wait
    # is on the file thread, not in a GET: a GET held on the shared part threads starved the corrupt file's second
    # download, queued behind it, until the hold timed out (240 s once under make test).
    download = s3shards.Stager._download

    def after_the_abort(self, name, info, progress, pool, abort):
        if name in names[2:]:
            assert abort.wait(60), "the stage was not aborted"
        return download(self, name, info, progress, pool, abort)

    monkeypatch.setattr(s3shards.Stager, "_download", after_the_abort)
    uri = "s3://b/many"
    with pytest.raises(ConfigError, match=f"s3://b/many/{names[0]} is corrupt"):
        s3shards.stage(uri, s3shards.StageSettings(storage.S3Settings(uri=uri, part_size_bytes=1024),
                                                   stage_dir=str(tmp_path / "stage"), threads=2), FIELD)
    assert [n for n, _ in fake.gets if n.endswith(".bin")].count(names[0]) == 2 * 16, "downloaded twice"
    late = [n for n, _ in fake.gets if n in names[2:]]
    assert not late, fake.gets


def test_a_staging_disk_too_small_is_a_config_error_before_downloading_or_at_enospc(tmp_path, monkeypatch):
    """Too little free space is reported before a GET (the .part files are sparse, so the disk would fill only at a
    write); a disk that fills anyway (ENOSPC at a write) is the same error, not a crash."""
    import errno
    import shutil

    _many_shards(tmp_path / "src", files=2, size=8 * 1024)
    fake = _FakeS3(tmp_path / "src")
    monkeypatch.setattr(compat, "s3_client", lambda settings, config: fake)
    uri, stage_dir = "s3://b/many", tmp_path / "stage"
    settings = s3shards.StageSettings(storage.S3Settings(uri=uri, part_size_bytes=4096), stage_dir=str(stage_dir))
    monkeypatch.setattr(s3shards.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(2**40, 2**40 - 2**20, 2**20))
    with pytest.raises(ConfigError) as e:
        s3shards.stage(uri, settings, FIELD)
    assert f"the node-local staging directory {stage_dir} has 0.00 GiB free" in str(e.value)
    assert "more local disk" in e.value.fix and "fewer or smaller shards" in e.value.fix
    assert [n for n, _ in fake.gets if n != "index.json"] == [], "nothing downloaded"
    monkeypatch.setattr(s3shards.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(2**40, 0, 2**40))

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(s3shards.os, "pwrite", full)
    with pytest.raises(ConfigError, match=f"the node-local staging directory {stage_dir} has"):
        s3shards.stage(uri, settings, FIELD)


def test_a_version_1_index_without_checksums_is_reused_on_a_restart(tmp_path, monkeypatch):
    """A version-1 index (written before checksums) lists no CRC-32: its staged files are vouched for by the
    manifest's size and mtime, so a second start downloads nothing but the index (it used to download everything)."""
    _many_shards(tmp_path / "src", files=2, size=8 * 1024)
    index = json.loads((tmp_path / "src" / "index.json").read_text())
    index["version"] = 1
    index["files"] = [{"name": f["name"], "tokens": f["tokens"]} for f in index["files"]]
    (tmp_path / "src" / "index.json").write_text(json.dumps(index))
    fake = _FakeS3(tmp_path / "src")
    monkeypatch.setattr(compat, "s3_client", lambda settings, config: fake)
    uri = "s3://b/v1"
    settings = s3shards.StageSettings(storage.S3Settings(uri=uri, part_size_bytes=4096), stage_dir=str(tmp_path / "st"))
    s3shards.stage(uri, settings, FIELD)
    assert len([n for n, _ in fake.gets if n.endswith(".bin")]) == 4  # two files of two parts
    fake.gets.clear()
    got = s3shards.stage(uri, settings, FIELD)
    assert [n for n, _ in fake.gets] == ["index.json"]
    assert (got / index["files"][0]["name"]).read_bytes() == (tmp_path / "src" / index["files"][0]["name"]).read_bytes()


# ------------------------------------------------------------------------------------------ the trainer, end to end
def _run(tmp: Path, name: str, path: str, endpoint: str, env: dict[str, str], steps: int = 2) -> tuple[int, str]:
    obj = tiny_lpt({"training": {"steps": steps, "seqLen": 64, "localBatchSize": 2, "warmupSteps": 1},
                    "data": {"source": "shards", "shards": {"path": path},
                             **({"s3": {"endpoint": endpoint, "forcePathStyle": True}} if endpoint else {})},
                    "checkpoint": {"enabled": False}, "runPolicy": {"maxRestarts": 0},
                    "parallelism": {"dataParallelShardDegree": 1},
                    "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 1}}, name=name)
    return launch(ledger_config(obj, tmp / name, tmp / f"{name}.toml"), 1, name, env, timeout=240)


def _trained(dump: Path) -> tuple[dict[int, float], list[str]]:
    losses = {json.loads(x)["step"]: json.loads(x)["loss"]
              for x in (dump / "kubetitan" / "steps.jsonl").read_text().splitlines()}
    ledger = sorted(line for f in (dump / "kubetitan" / "ledger").glob("rank-*.txt") for line in f.read_text().splitlines())
    return losses, ledger


def test_a_run_from_s3_trains_what_the_local_run_trains_through_503s(s3_server, fault_proxy, bucket, s3_env,
                                                                      shards_dir, tmp_path):
    uri = upload(s3_server.endpoint, shards_dir, bucket, "prepared/corpus")
    f503 = fault_proxy.inject("503", "GET", 4, path_contains="/shard-")
    rc, log = _run(tmp_path, "remote", uri, fault_proxy.endpoint, s3_env)
    assert rc == 0, log[-4000:]
    assert f503.hits == 4
    assert f"Staged {uri} to " in log and "every CRC-32 verified" in log, log[-4000:]
    rc, log_local = _run(tmp_path, "local", str(shards_dir), "", {})
    assert rc == 0, log_local[-4000:]
    remote, local = _trained(tmp_path / "remote"), _trained(tmp_path / "local")
    assert remote[1] and remote[1] == local[1], "the sample stream from S3 differs from the local directory's"
    assert sorted(remote[0]) == [1, 2] and remote[0] == local[0], "losses differ (bit for bit)"


def test_a_corrupt_object_stops_the_trainer_with_exit_2_and_no_traceback(s3_server, bucket, s3_env, shards_dir,
                                                                           tmp_path):
    """(A missing bucket takes the same path, ConfigError -> exit 2: the in-process test above checks its message.)"""
    name = _file(shards_dir, 2)
    data = (shards_dir / name).read_bytes()
    uri = upload(s3_server.endpoint, shards_dir, bucket, "corrupt", replace={name: data[:-2] + b"\xff\xff"})
    rc, log = _run(tmp_path, "corrupt", uri, s3_server.endpoint, s3_env, steps=1)
    assert rc == ExitCode.CONFIG_ERROR == 2, log[-4000:]
    assert f"s3://{bucket}/corrupt/{name} is corrupt" in log and "Traceback" not in log, log[-4000:]


# ------------------------------------------------------------------------------------------ what the operator renders
def test_pods_reading_s3_shards_get_a_staging_emptydir_the_secret_and_the_rendered_settings():
    from kubetitan import plan
    from kubetitan_core import contract

    data = {"source": "shards", "shards": {"path": "s3://my-data/c4"},
            "s3": {"region": "us-west-2", "endpoint": "https://s3.example:9000", "forcePathStyle": True,
                   "credentialsSecretRef": {"name": "data-keys"}}}
    obj = tiny_lpt({"data": data})
    pod = plan.pod(obj, 0, 0)["spec"]
    c = pod["containers"][0]
    assert {"name": "data-stage", "mountPath": contract.DATA_STAGE_MOUNT} in c["volumeMounts"]
    assert {"name": "data-stage", "emptyDir": {}} in pod["volumes"]
    env = {e["name"]: e.get("valueFrom") for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "data-keys", "key": "AWS_ACCESS_KEY_ID"}}
    # nodes that stage first wait for the slowest in init_process_group: bounded by the start-up budget, not 300 s
    slow = tiny_lpt({"data": data, "runPolicy": {"startupTimeoutSeconds": 5400}})
    assert render.trainer_config(slow, dump_folder="/ck")["comm"]["init_timeout_seconds"] == 5400
    assert render.trainer_config(obj, dump_folder="/ck")["kubetitan"]["data_s3"] == {
        "region": "us-west-2", "endpoint": "https://s3.example:9000", "force_path_style": True,
        "stage_dir": contract.DATA_STAGE_MOUNT}
    # a local path: no staging volume, no settings
    local = tiny_lpt({"data": {"source": "shards", "shards": {"path": "/data/c4"}}})
    assert "data-stage" not in {v["name"] for v in plan.pod(local, 0, 0)["spec"]["volumes"]}
    assert "data_s3" not in render.trainer_config(local, dump_folder="/ck")["kubetitan"]
