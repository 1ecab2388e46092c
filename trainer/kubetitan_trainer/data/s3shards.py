"""Token shards in S3: staged to node-local disk at start, every file's CRC-32 checked against ``index.json``.

A shards path ``s3://bucket/prefix`` (``spec.data.shards.path``, a mixture source's, the held-out set's) names the
objects ``aws s3 sync`` made of a ``kubetitan prepare-data`` output directory: ``<prefix>/index.json`` and the
``shard-*.bin``/``.idx`` it lists. :func:`stage` copies them to ``<stage_dir>/<bucket>/<prefix>/`` and returns that
directory, which :class:`~kubetitan_trainer.data.shards.ShardSet` then opens like any other.

**Why staging, not ranged reads with a cache.** The loader reads a seeded permutation of windows: with a cache
smaller than the data nearly every read misses, so training would pay an S3 round trip (tens of ms) per sample and
stall on every slow or throttled GET, for the whole run. Staged once, the run reads from local disk at memory-map
speed, a fault can only happen before the first step (where retries and exit codes are simple), and a restart in
place finds the files already there. The cost is node-local disk for the whole dataset (docs/storage.md) and the
time to download it, which counts against the start-up timeout (``runPolicy.startupTimeoutSeconds``).

**How.** One LIST of the prefix gives every object's size: a missing or truncated object is a configuration error
before a byte is downloaded. Each file is fetched in parts of ``part_size_bytes`` by ranged GETs, ``threads`` at a
time across all files (s3torchconnector's range-based reader; the CRT client retries 503 SlowDown, 5xx, resets and
timeouts with backoff, ``max_attempts`` per request, and a part that still fails is retried here a bounded number of
times). A finished file's CRC-32 is computed from the bytes on disk and compared with the index: a mismatch is
downloaded once more (a fault on the way), then it is the object that is corrupt, a configuration error (exit 2)
naming the object and the fix. Verified files are recorded in a manifest (name, size, CRC, mtime) and renamed into
place; a restart, in place or a new attempt on the same node, re-downloads only what the manifest does not vouch for.

**Who downloads.** Every process of the node calls :func:`stage` under one file lock (``flock``) on the staging
directory: the first to get it downloads, the others wait on the lock and then find every file verified. No
collective is involved in the staging itself, but it runs before torchtitan's ``init_distributed``: on a multi-node
run the nodes that finish first wait for the slowest in the process group's initialisation, bounded by
``comm.init_timeout_seconds``. The operator renders that as ``runPolicy.startupTimeoutSeconds``
(``kubetitan_core.render``), the same budget the operator gives the whole start (torchtitan's own default, 300 s,
applies only to a hand-written config); a download-time spread between nodes beyond it ends the attempt.

Errors: a bucket that does not exist or denies access → ConfigError with the bucket and the fix
(:func:`kubetitan_trainer.storage.describe_access_error`, as for checkpoints); no ``index.json`` under the prefix,
an object the index lists missing or of the wrong size, a corrupt object → ConfigError naming ``s3://bucket/key``;
requests that still fail after the retries → :class:`~kubetitan_trainer.errors.TransientError` (exit 6, the run is
restarted).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from kubetitan_core.contract import is_s3_uri, split_s3_uri
from kubetitan_core.contract.trainer_toml import table_shards_paths
from kubetitan_trainer.errors import ConfigError, TransientError
from kubetitan_trainer import atomic
from kubetitan_trainer.data.shards import INDEX_FILE, RERUN, ShardSet, crc32_bytes, crc32_file
from kubetitan_trainer.retry import retry
from kubetitan_trainer.storage import S3Settings, access_error_kind, describe_access_error

log = logging.getLogger("kubetitan.s3shards")

MANIFEST = ".kubetitan-staged.json"
LOCK = ".kubetitan-staging.lock"
PROGRESS_EVERY_SECONDS = 5.0
PART_ATTEMPTS = 3
"""Attempts per part here, each after the client's own ``max_attempts`` retries of its request."""
FREE_MARGIN_BYTES = 64 * 2**20
"""Free space kept beyond the files to download (the manifest, the index, the file system's own blocks)."""
SYNC_HINT = "aws s3 sync <the prepare-data output directory> {uri}/"


@dataclasses.dataclass(frozen=True)
class StageSettings:
    """``[kubetitan.data_s3]``: how shards paths ``s3://...`` are reached and where they are staged."""

    s3: S3Settings
    stage_dir: str
    threads: int = 8
    """Ranged GETs in flight (each holds one part in memory: ``threads x part_size_bytes`` bytes at most)."""
    settings_field: str = "spec.data.s3"


def settings_from(job_config: Any, uri: str) -> StageSettings:
    """The staging settings of a trainer config for one ``s3://`` shards path."""
    c = job_config.kubetitan.data_s3
    stage_dir = c.stage_dir or os.path.join(job_config.job.dump_folder, "kubetitan", "data-cache")
    return StageSettings(S3Settings(uri=uri, region=c.region or "us-east-1", endpoint=c.endpoint,
                                    force_path_style=c.force_path_style, max_attempts=c.max_attempts,
                                    part_size_bytes=c.part_size_bytes),
                         stage_dir=stage_dir, threads=c.threads)


_STAGED: dict[str, str] = {}
"""URI -> local directory, of what this process staged (the loader and the eval loader open the same paths)."""


def local_path(path: str, job_config: Any, field: str) -> str:
    """``path`` itself for a directory in the pod; for ``s3://...`` the local directory it was staged to."""
    if not is_s3_uri(path):
        return path
    if path not in _STAGED:
        _STAGED[path] = str(stage(path, settings_from(job_config, path), field))
    return _STAGED[path]


def stage_all(job_config: Any) -> None:
    """Stage every ``s3://`` shards path the config reads (source, mixture, eval) now: the trainer calls it before
    torchtitan builds anything, so a bad bucket or object ends the process with exit code 2 and its message alone."""
    d = job_config.kubetitan.data
    for p in table_shards_paths(d):
        if not p.held_out or d.eval_samples > 0:
            local_path(p.path, job_config, p.field)


class _Uri(str):
    """An ``s3://`` URI that joins like a Path (``uri / "index.json"``), so the index's errors name the object."""

    def __truediv__(self, other: str) -> _Uri:
        return _Uri(f"{self}/{other}")


def _key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


class _Progress:
    """Bytes downloaded so far, logged every few seconds with the rate."""

    def __init__(self, uri: str, total: int) -> None:
        self.uri, self.total, self.done = uri, total, 0
        self.start = self._last = time.monotonic()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last < PROGRESS_EVERY_SECONDS:
                return
            self._last = now
        log.info("Staging %s: %.1f of %.1f MB (%.0f%%), %.1f MB/s", self.uri, self.done / 1e6, self.total / 1e6,
                 100 * self.done / max(self.total, 1), self.rate())

    def rate(self) -> float:
        return self.done / 1e6 / max(time.monotonic() - self.start, 1e-9)


class Stager:
    """One ``s3://bucket/prefix`` shards directory and its local copy (see the module docstring)."""

    def __init__(self, uri: str, settings: StageSettings, field: str) -> None:
        from kubetitan_trainer import compat

        self.uri, self.settings, self.field = uri.rstrip("/"), settings, field
        self.bucket, self.prefix = split_s3_uri(self.uri)
        self.dest = Path(settings.stage_dir) / self.bucket / self.prefix
        self._client = compat.s3_client(settings.s3, compat.s3_client_config(settings.s3))

    # ---------------------------------------------------------------------------------------------- errors
    def _fail(self, problem: str, fix: str) -> ConfigError:
        return ConfigError(self.field, problem, fix)

    def _no_space(self, needed: int, free: int) -> ConfigError:
        """The node-local staging disk cannot hold the files (checked before downloading, and at ENOSPC: the
        ``.part`` files are sparse, so a full disk shows only when a part is written)."""
        return self._fail(f"the node-local staging directory {self.settings.stage_dir} has {free / 2**30:.2f} GiB free; "
                          f"staging {self.uri} needs {needed / 2**30:.2f} GiB more",
                          "give the nodes more local disk (a larger root volume or ephemeral storage for the staging "
                          "emptyDir, docs/storage.md), or read fewer or smaller shards")

    def _request_error(self, e: BaseException, what: str) -> Exception:
        """A request that failed after every retry: a configuration error when S3 says the bucket or the access is
        wrong, else a transient one (the operator restarts the run)."""
        if access_error_kind(e) is not None:
            return ConfigError(*describe_access_error(self.settings.s3, self.bucket, e, field=self.field,
                                                      settings_field=self.settings.settings_field,
                                                      actions="s3:GetObject"))
        return TransientError(f"{what} from {self.uri} failed after the client's retries ({e}); the run is restarted")

    # ---------------------------------------------------------------------------------------------- listing
    def _list(self) -> dict[str, Any]:
        """name -> ObjectInfo of every object directly under the prefix (one LIST per 1000 objects)."""
        start = f"{self.prefix}/" if self.prefix else ""
        out: dict[str, Any] = {}
        try:
            for page in self._client.list_objects(self.bucket, start):
                for info in page.object_info:
                    out[info.key[len(start):]] = info
        except Exception as e:  # S3Exception: the message is all the client gives
            raise self._request_error(e, "listing the shards") from None
        return out

    def _index(self, objects: dict[str, Any]) -> tuple[bytes, ShardSet]:
        if INDEX_FILE not in objects:
            raise self._fail(f"there is no {INDEX_FILE} under {self.uri}/ (found {len(objects)} object(s))",
                             f"upload the whole directory `kubetitan prepare-data` wrote: {SYNC_HINT.format(uri=self.uri)}")
        raw = bytes(self._get(INDEX_FILE, objects[INDEX_FILE], 0, objects[INDEX_FILE].size))
        try:
            index = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._fail(f"{self.uri}/{INDEX_FILE} cannot be read as JSON ({e})",
                             f"{RERUN}, then {SYNC_HINT.format(uri=self.uri)}") from None
        if not isinstance(index, dict):
            raise self._fail(f"{self.uri}/{INDEX_FILE} is not a kubetitan shards index (a JSON object)", RERUN)
        return raw, ShardSet._from_index(_Uri(self.uri), index, self.field)  # type: ignore[arg-type]

    # ---------------------------------------------------------------------------------------------- transfer
    def _get(self, name: str, info: Any, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of an object: one ranged GET (tried ``PART_ATTEMPTS`` times, kubetitan_trainer.retry;
        access denied or no bucket is not retried)."""
        from kubetitan_trainer import compat

        buf = bytearray(end - start)
        what = f"GET s3://{self.bucket}/{_key(self.prefix, name)}"

        def get() -> bytearray:
            reader = self._client.get_object(self.bucket, _key(self.prefix, name), object_info=info,
                                             reader_constructor=compat.s3_range_reader())
            reader.seek(start)
            got = reader.readinto(buf) if buf else 0
            if got != len(buf):
                raise OSError(f"short read: {got} of {len(buf)} bytes at offset {start}")
            return buf

        try:  # S3Exception after the client's own retries, or a dropped body
            return retry(get, what=what, transient=lambda e: isinstance(e, Exception) and access_error_kind(e) is None,
                         attempts=PART_ATTEMPTS, first_wait=0.5, max_wait=8.0)
        except Exception as e:  # noqa: BLE001 - the request's error says what failed and what to do
            raise self._request_error(e, what) from None

    def _download(self, name: str, info: Any, progress: _Progress, pool: cf.Executor, abort: threading.Event) -> None:
        """The object into ``.<name>.part`` by parallel ranged GETs (parts written at their offsets). A part not
        started when ``abort`` is set (another file failed) is skipped, so the failure surfaces after the GETs in
        flight, not after the whole download."""
        tmp = self.dest / f".{name}.part"
        part = self.settings.s3.part_size_bytes
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        futures: list[cf.Future[None]] = []
        try:
            os.ftruncate(fd, info.size)

            def fetch(start: int) -> None:
                if abort.is_set():
                    raise _Aborted()
                data = self._get(name, info, start, min(start + part, info.size))
                try:
                    os.pwrite(fd, data, start)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    raise self._no_space(len(data), shutil.disk_usage(self.dest).free) from None
                progress.add(len(data))

            futures = [pool.submit(fetch, s) for s in range(0, info.size, part)]
            for f in futures:
                f.result()
            os.fsync(fd)
        finally:
            for f in futures:  # no part still writing when the descriptor is closed
                if not f.cancel():  # running or done (a cancelled one never runs; cf.wait would not see it end)
                    f.exception()
            os.close(fd)

    # ---------------------------------------------------------------------------------------------- staging
    def _manifest(self) -> dict[str, Any]:
        try:
            m = json.loads((self.dest / MANIFEST).read_text())
            return m if isinstance(m, dict) and m.get("uri") == self.uri else {"uri": self.uri, "files": {}}
        except (OSError, ValueError):
            return {"uri": self.uri, "files": {}}

    def _reusable(self, manifest: dict[str, Any], name: str, size: int, crc: str | None) -> bool:
        """Whether the manifest vouches for the local file: same size and mtime as when it was downloaded, and the
        CRC-32 the index gives (a version-1 index gives none: then size and mtime alone, as its download had)."""
        m = manifest["files"].get(name)
        try:
            st = (self.dest / name).stat()
        except FileNotFoundError:
            return False
        return bool(m) and (crc is None or m.get("crc32") == crc) and m.get("size") == size == st.st_size \
            and m.get("mtime_ns") == st.st_mtime_ns

    def _wanted(self, ss: ShardSet) -> list[tuple[str, int, str | None]]:
        """(name, size, CRC-32) of every file the index lists (:meth:`ShardSet.files`)."""
        return [(name, size, crc) for name, size, crc, _what in ss.files()]

    def _check_listing(self, wanted: list[tuple[str, int, str | None]], objects: dict[str, Any]) -> None:
        for name, size, _crc in wanted:
            obj = f"s3://{self.bucket}/{_key(self.prefix, name)}"
            if name not in objects:
                raise self._fail(f"{INDEX_FILE} lists {name}, but {obj} does not exist",
                                 f"upload the whole directory `kubetitan prepare-data` wrote: "
                                 f"{SYNC_HINT.format(uri=self.uri)}")
            got = objects[name].size
            if got != size:
                what = "is truncated" if got < size else "is larger than the index says"
                raise self._fail(f"{obj} {what}: {got} bytes where {INDEX_FILE} says {size}",
                                 f"upload it again from the prepare-data output directory "
                                 f"(aws s3 cp <dir>/{name} {obj}), or {RERUN}")

    def stage(self) -> Path:
        self.dest.mkdir(parents=True, exist_ok=True)
        with open(self.dest / LOCK, "w") as lock:
            t0 = time.monotonic()
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other processes of the node wait here, then reuse the files
            waited = time.monotonic() - t0
            if waited > 1:
                log.info("Waited %.1f s for another process of this node to stage %s", waited, self.uri)
            return self._stage_locked()

    # long: one pass over listing, reuse, parallel download and verification, logged; split it would scatter the flow
    def _stage_locked(self) -> Path:
        objects = self._list()
        raw_index, ss = self._index(objects)
        wanted = self._wanted(ss)
        self._check_listing(wanted, objects)
        manifest = self._manifest()
        todo = [(n, size, crc) for n, size, crc in wanted if not self._reusable(manifest, n, size, crc)]
        total = sum(size for _n, size, _c in todo)
        if todo and (free := shutil.disk_usage(self.dest).free) < total + FREE_MARGIN_BYTES:
            raise self._no_space(total + FREE_MARGIN_BYTES, free)
        progress = _Progress(self.uri, total)
        abort = threading.Event()
        if todo:
            log.info("Staging %s to %s: %d of %d file(s), %.1f MB (%d reused); %d ranged GETs in flight",
                     self.uri, self.dest, len(todo), len(wanted), total / 1e6, len(wanted) - len(todo),
                     self.settings.threads)
        with cf.ThreadPoolExecutor(self.settings.threads, thread_name_prefix="kubetitan-stage") as parts, \
                cf.ThreadPoolExecutor(max(1, min(len(todo), self.settings.threads)),
                                      thread_name_prefix="kubetitan-stage-file") as files:

            def one(name: str, size: int, crc: str | None) -> None:
                for attempt in (1, 2):
                    self._download(name, objects[name], progress, parts, abort)
                    got = crc32_file(self.dest / f".{name}.part")
                    if crc is None or got == crc:
                        break
                    if attempt == 2:
                        obj = f"s3://{self.bucket}/{_key(self.prefix, name)}"
                        raise self._fail(f"{obj} is corrupt: its CRC-32 is {got}, {INDEX_FILE} says {crc} (downloaded "
                                         "twice)", f"upload it again from the prepare-data output directory "
                                         f"(aws s3 cp <dir>/{name} {obj}), or {RERUN}")
                    log.warning("%s/%s: CRC-32 %s, the index says %s; downloading it once more", self.uri, name, got, crc)
                os.replace(self.dest / f".{name}.part", self.dest / name)
                st = (self.dest / name).stat()
                with manifest_lock:
                    manifest["files"][name] = {"size": size, "crc32": got, "mtime_ns": st.st_mtime_ns}

            manifest_lock = threading.Lock()
            try:
                _first_failure([files.submit(one, *t) for t in todo], abort, (files, parts))
            finally:
                _write_json(self.dest / MANIFEST, manifest)  # what was verified survives a failure of the rest
        atomic.write_bytes(self.dest / INDEX_FILE, raw_index)
        if todo:
            secs = time.monotonic() - progress.start
            log.info("Staged %s to %s: %.1f MB in %.1f s (%.1f MB/s), every CRC-32 verified (index %s)", self.uri,
                     self.dest, total / 1e6, secs, progress.rate(), crc32_bytes(raw_index))
        else:
            log.info("Reused the staged copy of %s in %s: %d file(s), every one verified when it was downloaded",
                     self.uri, self.dest, len(wanted))
        return self.dest


class _Aborted(Exception):
    """A part skipped because another file already failed."""


def _first_failure(futures: list[cf.Future[None]], abort: threading.Event, pools: tuple[cf.Executor, ...]) -> None:
    """Wait for every file; at the first failure, stop the rest (queued files and parts cancelled, parts not yet
    started skipped) and raise it, so a bad object is reported after the GETs in flight, not after every other
    file has downloaded."""
    done, _pending = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
    failed = [f for f in futures if f in done and not f.cancelled() and f.exception() is not None]
    if not failed:
        return
    for pool in pools:  # the files' pool first: no queued file starts once its parts begin to fail
        pool.shutdown(wait=False, cancel_futures=True)
    abort.set()
    errors = [f.exception() for f in failed]
    raise next((e for e in errors if not isinstance(e, _Aborted)), errors[0])


def _write_json(path: Path, obj: Any) -> None:
    atomic.write_json(path, obj, indent=1, sort_keys=True)


def stage(uri: str, settings: StageSettings, field: str) -> Path:
    """Stage ``s3://bucket/prefix`` (a prepare-data directory) to node-local disk; the local directory."""
    return Stager(uri, settings, field).stage()
