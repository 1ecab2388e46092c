"""Where checkpoints live: a local (or PVC-mounted) folder, or an S3 prefix. The one storage layer of the trainer.

Every module that needs the checkpoint store goes through a :class:`CheckpointStore`:

- **DCP writer/reader** (:meth:`CheckpointStore.writer`, :meth:`CheckpointStore.reader`): None for a local folder
  (DCP picks its ``FileSystemWriter``/``Reader`` from the path, exactly as before); for S3, s3torchconnector's
  ``S3StorageWriter``/``S3StorageReader`` on a client this module configures (endpoint, path-style addressing,
  retries: :func:`kubetitan_trainer.compat.s3_storage_writer`).
- **Newest-complete discovery** (:meth:`CheckpointStore.entries`): ``(step-N, has .metadata)`` pairs for the one
  resume rule (``kubetitan_core.contract.newest_complete_step``). DCP writes ``.metadata`` last (on S3: a copy of
  ``.metadata.tmp`` once every rank's files are written), so a save cut off mid-way is never resumed from.
- **What a checkpoint holds** (:meth:`CheckpointStore.saved_keys`): the flattened state-dict keys of its DCP
  metadata, so a load can leave out what an older trainer did not save.
- **Keep-latest-K** (:meth:`CheckpointStore.purge`): the K newest complete steps stay, everything older goes.
- **Pre-flight** (:meth:`CheckpointStore.preflight`): a bucket that does not exist or denies access is a
  configuration error (exit code 2) that names the bucket and the fix, found before the model is built.

With checkpoints in S3, everything else the trainer writes stays in ``job.dump_folder`` on the pod's local
filesystem (the pod's scratch ``emptyDir``, or the checkpoint PVC when one is mounted too): the torch.compile
cache, the step log (``kubetitan/steps.jsonl``), the downloaded tokenizer, TensorBoard events and the restore tier.
None of them must outlive the pod for a resume: the checkpoint alone carries the training state.
"""

from __future__ import annotations

import dataclasses
import logging
import contextlib
import os
import queue
import re
import shutil
import threading
from typing import Any

from kubetitan_core import contract

log = logging.getLogger(__name__)

S3_SCHEME = "s3://"
_STEP = re.compile(r"^step-(\d+)$")


def is_remote(path: str) -> bool:
    """Whether a checkpoint location is an object-store URI (``s3://...``) rather than a filesystem path."""
    return str(path).startswith(S3_SCHEME)


def folder_key(path: str) -> str:
    """A stable identity of a checkpoint location (an absolute path, or the URI itself)."""
    return str(path).rstrip("/") if is_remote(path) else os.path.abspath(path)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")`` (no leading or trailing slash)."""
    if not is_remote(uri):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, prefix = uri[len(S3_SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    return bucket, prefix.strip("/")


@dataclasses.dataclass(frozen=True)
class S3Settings:
    """How to reach the bucket (``[kubetitan.checkpoint_storage]``)."""

    uri: str
    region: str = "us-east-1"
    endpoint: str = ""
    """Empty: AWS's regional endpoint. Otherwise an S3-compatible server's URL (``https://...``)."""
    force_path_style: bool = False
    max_attempts: int = 10
    """Attempts per request by the client's own retry strategy (exponential backoff with jitter): 503 SlowDown,
    500s, throttling, connection resets and timeouts are retried there before a save or load sees an error."""
    part_size_bytes: int = 16 * 2**20
    """Multipart upload/ranged download part size (at least 5 MiB)."""
    throughput_target_gbps: float = 10.0
    """The CRT client's throughput target; it sizes its connection pool from it."""
    thread_count: int = 4
    """DCP writer threads per rank (each writes its own ``.distcp`` file: files per save = ranks x this)."""


def dir_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (a checkpoint step's folder); files that vanish meanwhile count 0."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # a file that vanished meanwhile counts 0
                total += os.path.getsize(os.path.join(root, f))
    return total


class CheckpointStore:
    """A place for step-N checkpoints: ``root`` is the folder or the URI that ``step-N`` names go under."""

    root: str
    remote: bool = False

    def step_id(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/step-{step}" if self.remote else os.path.join(self.root, f"step-{step}")

    def entries(self) -> list[tuple[str, bool]]:
        raise NotImplementedError

    def newest_complete_step(self) -> int | None:
        return contract.newest_complete_step(self.entries())

    def writer(self, checkpoint_id: str) -> Any:
        return None

    def reader(self, checkpoint_id: str) -> Any:
        return None

    def saved_keys(self, checkpoint_id: str) -> set[str]:
        """The flattened state-dict keys (``train_state.step``, ...) the checkpoint ``checkpoint_id`` holds, read
        from its DCP metadata with the store's reader (DCP's filesystem reader for a local folder)."""
        from torch.distributed.checkpoint import FileSystemReader

        reader = self.reader(checkpoint_id) or FileSystemReader(checkpoint_id)
        return set(reader.read_metadata().state_dict_metadata)

    def delete_step(self, step: int) -> None:
        raise NotImplementedError

    def step_bytes(self, step: int) -> int:
        raise NotImplementedError

    def preflight(self) -> None:
        """Raise :class:`~kubetitan_trainer.errors.ConfigError` when the store cannot be used at all."""

    def to_purge(self, keep_latest_k: int) -> list[int]:
        """Steps keep-latest-K removes: all older than the K-th newest complete step (complete or cut off). A step
        newer than the newest complete one may be a save still in flight and is never removed."""
        if keep_latest_k <= 0:
            return []
        complete = sorted(int(m.group(1)) for n, done in self.entries() if done and (m := _STEP.match(n)))
        if len(complete) <= keep_latest_k:
            return []
        oldest_kept = complete[-keep_latest_k]
        every = sorted(int(m.group(1)) for n, _ in self.entries() if (m := _STEP.match(n)))
        return [s for s in every if s < oldest_kept]

    def purge(self, keep_latest_k: int) -> list[int]:
        gone = self.to_purge(keep_latest_k)
        for step in gone:
            self.delete_step(step)
        return gone


class LocalStore(CheckpointStore):
    """A folder on a local disk or a mounted volume (PVC, hostPath): DCP's own filesystem writer and reader."""

    def __init__(self, folder: str) -> None:
        self.root = folder

    def entries(self) -> list[tuple[str, bool]]:
        if not os.path.isdir(self.root):
            return []
        return [(n, os.path.isfile(os.path.join(self.root, n, contract.DCP_METADATA_FILE))) for n in os.listdir(self.root)]

    def delete_step(self, step: int) -> None:
        path = self.step_id(step)
        meta = os.path.join(path, contract.DCP_METADATA_FILE)
        if os.path.exists(meta):
            os.unlink(meta)  # first: a half-deleted step never looks complete
        shutil.rmtree(path, ignore_errors=True)

    def step_bytes(self, step: int) -> int:
        return dir_bytes(self.step_id(step))


class S3Store(CheckpointStore):
    """An S3 prefix (AWS or an S3-compatible server) through s3torchconnector: ``<uri>/step-N/...`` objects."""

    remote = True

    def __init__(self, settings: S3Settings) -> None:
        from kubetitan_trainer import compat

        self.settings = settings
        self.root = settings.uri.rstrip("/")
        self.bucket, self.prefix = parse_s3_uri(self.root)
        self._config = compat.s3_client_config(settings)
        self._client = compat.s3_client(settings, self._config)

    # ---- objects
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def list_keys(self, under: str = "") -> list[tuple[str, int]]:
        """(key relative to the prefix, size) of every object under ``<prefix>/<under>``."""
        base = self._key(under)
        start = f"{base}/" if base else ""
        out: list[tuple[str, int]] = []
        for page in self._client.list_objects(self.bucket, start):
            for info in page.object_info:
                out.append((info.key[len(self._key()) + 1 if self.prefix else 0:], info.size))
        return out

    def entries(self) -> list[tuple[str, bool]]:
        seen: dict[str, bool] = {}
        for key, _size in self.list_keys():
            step, _, rest = key.partition("/")
            if _STEP.match(step):
                seen[step] = seen.get(step, False) or rest == contract.DCP_METADATA_FILE
        return sorted(seen.items())

    def step_bytes(self, step: int) -> int:
        return sum(size for _k, size in self.list_keys(f"step-{step}"))

    def delete_step(self, step: int) -> None:
        keys = [k for k, _ in self.list_keys(f"step-{step}")]
        # .metadata first: a step whose deletion is cut off is incomplete, never resumed from
        keys.sort(key=lambda k: not k.endswith("/" + contract.DCP_METADATA_FILE))
        for k in keys:
            self._client.delete_object(self.bucket, self._key(k))

    def preflight(self) -> None:
        from kubetitan_trainer.errors import ConfigError

        try:
            for _page in self._client.list_objects(self.bucket, self._key() + "/" if self.prefix else "", max_keys=1):
                break
        except Exception as e:  # S3Exception: the message is all the client gives
            raise ConfigError(*describe_access_error(self.settings, self.bucket, e)) from e

    # ---- DCP
    def writer(self, checkpoint_id: str) -> Any:
        from kubetitan_trainer import compat

        return compat.s3_storage_writer(checkpoint_id, self.settings, self._config)

    def reader(self, checkpoint_id: str) -> Any:
        from kubetitan_trainer import compat

        return compat.s3_storage_reader(checkpoint_id, self.settings, self._config)


_NO_BUCKET = re.compile(r"bucket does not exist|\bnosuchbucket\b", re.I)
_DENIED = re.compile(r"\baccess ?denied\b|\bforbidden\b|\b(?:status|http|code|response)\D{0,16}\b403\b", re.I)
"""Access denied: the error code or reason, or 403 as a whole number after "status"/"HTTP"/"code" (a bare ``403``
can be part of a request id or a byte range)."""
_CREDENTIALS = re.compile(r"credentials", re.I)
_PROVIDER_TRANSIENT = re.compile(r"tim(?:ed|e) ?out|timeout|connection (?:refused|reset|closed)|connect(?:ion)? "
                                 r"failed|socket|temporar|unavailable|throttl|\b5\d\d\b", re.I)
"""A credentials error that says the provider could not be reached (the EKS Pod Identity agent or the instance
metadata service not answering yet at node start): transient, not a configuration error."""


def access_error_kind(e: BaseException) -> str | None:
    """``no-bucket``, ``denied`` or ``credentials`` when an S3 error says the configuration is wrong (retrying cannot
    help), None for anything else (network, server, a credentials provider not reachable yet).
    s3torchconnector's S3Exception carries only a message; tests/s3/test_storage_units.py has the table."""
    text = str(e)
    if _NO_BUCKET.search(text):
        return "no-bucket"
    if _DENIED.search(text):
        return "denied"
    if _CREDENTIALS.search(text) and not _PROVIDER_TRANSIENT.search(text):
        return "credentials"
    return None


def describe_access_error(s: S3Settings, bucket: str, e: BaseException, *,
                          field: str = "spec.checkpoint.storage.s3.uri", settings_field: str = "spec.checkpoint.storage.s3",
                          actions: str = "s3:GetObject/PutObject/DeleteObject") -> tuple[str, str, str]:
    """(field, problem, fix) for a bucket the trainer cannot reach: ``field`` is the location's field,
    ``settings_field`` the block with its region, endpoint and credentials (checkpoints' or the data's), ``actions``
    the object permissions the pod's identity needs there (:func:`access_error_kind` classifies the error)."""
    text = str(e)
    kind = access_error_kind(e)
    where = f" at {s.endpoint}" if s.endpoint else f" in region {s.region}"
    if kind == "no-bucket":
        return (field, f"the bucket {bucket!r} does not exist{where} ({text})",
                f"create the bucket {bucket!r} (or correct the URI {s.uri!r}), then re-create the run")
    if kind == "denied":
        return (field, f"access to s3://{bucket} was denied{where} ({text})",
                "give the pod's identity (its service account's EKS Pod Identity association or IRSA role, or the "
                f"credentials Secret) s3:ListBucket on arn:aws:s3:::{bucket} and {actions} "
                f"on arn:aws:s3:::{bucket}/*, then re-create the run")
    if kind == "credentials":
        return (field, f"no AWS credentials to reach s3://{bucket} ({text})",
                "associate the run's service account with an IAM role (EKS Pod Identity or IRSA) or set "
                f"{settings_field}.credentialsSecretRef, then re-create the run")
    return (field, f"cannot list s3://{bucket}{where} ({text})",
            f"check {settings_field} (uri, region, endpoint) and that the endpoint is reachable from the pod")


def from_config(job_config: Any) -> CheckpointStore:
    """The store of a trainer config: S3 when ``[kubetitan.checkpoint_storage] s3_uri`` is set, else the local
    folder torchtitan uses (``job.dump_folder``/``checkpoint.folder``)."""
    cs = job_config.kubetitan.checkpoint_storage
    if cs.s3_uri:
        return S3Store(S3Settings(uri=cs.s3_uri, region=cs.region or "us-east-1", endpoint=cs.endpoint,
                                  force_path_style=cs.force_path_style, max_attempts=cs.max_attempts,
                                  thread_count=cs.thread_count))
    return LocalStore(os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder))


def open_store(location: str | CheckpointStore) -> CheckpointStore:
    """A store from a folder path (a :class:`CheckpointStore` passes through)."""
    return location if isinstance(location, CheckpointStore) else LocalStore(location)


class Purger:
    """Keep-latest-K on a background thread of rank 0 (deleting thousands of objects must not stall training);
    :meth:`close` waits for the queued purges."""

    def __init__(self, store: CheckpointStore, keep_latest_k: int) -> None:
        self.store, self.k = store, keep_latest_k
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._run, name="kubetitan-purge", daemon=True)
        self._t.start()

    def request(self) -> None:
        self._q.put(True)

    def _run(self) -> None:
        while self._q.get():
            try:
                gone = self.store.purge(self.k)
                if gone:
                    log.info("keep-latest-%d: deleted %s from %s", self.k, ", ".join(f"step-{s}" for s in gone),
                             self.store.root)
            except Exception as e:  # never fatal: the next purge tries again
                log.warning("keep-latest-%d: could not delete old checkpoints from %s: %s", self.k, self.store.root, e)

    def close(self) -> None:
        if self._t.is_alive():
            self._q.put(False)
            self._t.join()
