"""Hub downloads that survive a flaky network and run once per node, and the one retry policy of every hub access
(:func:`with_retries`, over ``kubetitan_trainer.retry``: the tokenizer download here, a hub dataset's opening in
``kubetitan_trainer.data``).

- **Once per node**: local rank 0 of each pod downloads into a private folder next to the destination, moves
  the files in (one atomic rename each) and then writes the done-marker :data:`DONE_MARKER`; the pod's other
  ranks wait for that marker (bounded by ``wait_timeout``; a clear error names the marker and the log to read).
  A destination that already has the marker (an earlier attempt, or another pod on a shared volume) is used
  as it is, without asking the hub.
- **Retries**: connection errors, timeouts, HTTP 408/429 and 5xx are retried with capped exponential backoff
  and full jitter (the n-th wait is uniform in ``[0, min(cap, base * 2**n)]``). When they outlast the retries the
  trainer raises :class:`~kubetitan_trainer.errors.TransientError` (exit 6, ``RETRYABLE``: the operator
  restarts the run).
- **Hub datasets** (``datasets.load_dataset``) are classified by :func:`classify_dataset`, which reads the
  ``datasets`` library's own exceptions (it cuts their chains).
- **Config errors** (exit 2, not retried): the repository does not exist, is gated or refuses the token
  (HTTP 401/403/404), the revision does not exist, or the name is not a valid repository id.
  Anything else is not guessed at: it propagates (exit 1, restarted).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetitan_trainer import atomic
from kubetitan_trainer.errors import ConfigError, TransientError
from kubetitan_trainer.retry import first_line, retry

DONE_MARKER = ".kubetitan-download-complete"
RETRIES = 5
"""Retries after the first try (so 6 tries): waits of at most 1, 2, 4, 8, 16 s with the defaults below."""
BACKOFF_BASE_SECONDS = 1.0
BACKOFF_CAP_SECONDS = 30.0
WAIT_TIMEOUT_SECONDS = 900.0
"""How long a pod's other ranks wait for local rank 0's download (6 tries of the hub's own 10 s timeouts plus
the waits fit several times)."""

CONFIG, TRANSIENT = "config", "transient"


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _transport_errors() -> tuple[type[BaseException], ...]:
    kinds: list[type[BaseException]] = [ConnectionError, TimeoutError, socket.timeout]
    for mod, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                       ("requests", ("ConnectionError", "Timeout"))):
        try:
            m = __import__(mod)
        except ImportError:
            continue
        kinds += [getattr(m, n) for n in names if hasattr(m, n)]
    return tuple(kinds)


def classify(exc: BaseException) -> str | None:
    """``CONFIG``, ``TRANSIENT`` or None (neither: not retried, not a config error) for a hub failure.

    Walks the exception chain: ``snapshot_download`` wraps a failed repository look-up (a 503, a reset
    connection) in a ``LocalEntryNotFoundError`` whose cause is the real error."""
    from huggingface_hub import errors as hf

    for e in _chain(exc):
        if isinstance(e, hf.OfflineModeIsEnabled):
            return CONFIG  # HF_HUB_OFFLINE is set: no retry can help
        if isinstance(e, (hf.RepositoryNotFoundError, hf.RevisionNotFoundError, hf.DisabledRepoError,
                          hf.HFValidationError)):
            return CONFIG  # GatedRepoError is a RepositoryNotFoundError
        status = _status(e)
        if status is not None:
            if status in (401, 403, 404):
                return CONFIG
            if status in (408, 429) or status >= 500:
                return TRANSIENT
            return None
        if isinstance(e, _transport_errors()):
            return TRANSIENT
    return None


def with_retries(fn: Callable[[], Any], what: str, *, retries: int | None = None, base: float | None = None,
                 cap: float | None = None, sleep: Callable[[float], None] = time.sleep,
                 rand: Callable[[], float] = random.random, log: Callable[[str], None] = print,
                 kind: Callable[[BaseException], str | None] | None = None,
                 hint: str = "check the pod's network access to the hub (or HF_ENDPOINT)") -> Any:
    """``fn()``, retrying transient failures (``kind``, default :func:`classify`) with capped exponential backoff and
    full jitter (``kubetitan_trainer.retry``): the hub's retry policy (the tokenizer download, a hub dataset's
    opening).

    Raises :class:`TransientError` once ``retries`` retries failed too (its message ends with ``hint``); re-raises
    anything else at once. Unset knobs take :data:`RETRIES`, :data:`BACKOFF_BASE_SECONDS` and
    :data:`BACKOFF_CAP_SECONDS` (read at call time)."""
    kind = classify if kind is None else kind
    retries = RETRIES if retries is None else retries
    try:
        return retry(fn, what=what, transient=lambda e: kind(e) == TRANSIENT, attempts=retries + 1,
                     first_wait=BACKOFF_BASE_SECONDS if base is None else base,
                     max_wait=BACKOFF_CAP_SECONDS if cap is None else cap, jitter=rand, sleep=sleep, say=log)
    except Exception as e:  # noqa: BLE001 - only the transient ones that outlasted the retries are turned
        if kind(e) != TRANSIENT:
            raise
        raise TransientError(f"{what}: still failing after {retries + 1} tries ({type(e).__name__}: "
                             f"{first_line(e)}). The run is restarted (exit code 6); if it keeps "
                             f"failing, {hint}") from e


_OFFLINE_KINDS: tuple[type[BaseException], ...] = (OSError,)
"""What a hub or file look-up raises (a ConnectionError, a missing file): with ``HF_HUB_OFFLINE`` set that is the
setting's doing, a configuration error; any other exception (a tokenizer error mid-stream, a bug) is classified as
without it."""


def classify_dataset(exc: BaseException) -> str | None:
    """:func:`classify` for ``datasets.load_dataset`` and for reading a streamed dataset.

    ``datasets`` re-raises its own exceptions with the chain cut (``raise e from None``), so its classes are read
    first: no such dataset, no data files, an empty dataset, a gated one (``DatasetNotFoundError``) are ``CONFIG``; so
    is a hub or file look-up failure (an ``OSError``, a hub error) while ``HF_HUB_OFFLINE`` is set (it never asks the hub,
    so no retry can help); other exceptions keep their classification. A hub file that is
    neither reachable nor cached (``LocalEntryNotFoundError``) and a connection the library's own retries gave up
    on (``ConnectionError``) are ``TRANSIENT``."""
    from huggingface_hub import constants, errors as hf

    try:
        from datasets.data_files import EmptyDatasetError
        from datasets.exceptions import DataFilesNotFoundError, DatasetNotFoundError
        missing: tuple[type[BaseException], ...] = (DatasetNotFoundError, DataFilesNotFoundError, EmptyDatasetError)
    except ImportError:  # datasets is the trainer's dependency; without it nothing here raised its classes
        missing = ()
    for e in _chain(exc):
        if isinstance(e, missing):
            return CONFIG
    if constants.HF_HUB_OFFLINE and any(isinstance(e, _OFFLINE_KINDS + (hf.HfHubHTTPError, hf.LocalEntryNotFoundError,
                                                                        hf.OfflineModeIsEnabled))
                                        for e in _chain(exc)):
        return CONFIG
    for e in _chain(exc):
        if isinstance(e, hf.LocalEntryNotFoundError):
            return TRANSIENT
    return classify(exc)


def fetch_once(dest: str | Path, fetch: Callable[[str], Any], *, local_rank: int, what: str,
               wait_timeout: float | None = None, poll: float = 0.2,
               log: Callable[[str], None] = print) -> Path:
    """Make ``dest`` hold a complete download, fetched by local rank 0 only; returns ``dest``.

    ``fetch(folder)`` downloads into ``folder`` (a fresh private one). Local rank 0 moves its files into
    ``dest`` and writes ``dest/DONE_MARKER`` last; every other local rank waits for that marker."""
    dest = Path(dest)
    wait_timeout = WAIT_TIMEOUT_SECONDS if wait_timeout is None else wait_timeout
    marker = dest / DONE_MARKER
    if marker.is_file():
        return dest
    if local_rank != 0:
        deadline = time.monotonic() + wait_timeout
        while not marker.is_file():
            if time.monotonic() > deadline:
                raise TransientError(
                    f"{what}: local rank 0 of this pod did not finish the download within {wait_timeout:.0f} s "
                    f"({marker} is missing); its log says why. The run is restarted (exit code 6)")
            time.sleep(poll)
        return dest
    part = dest.parent / f".{dest.name}.part-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    try:
        fetch(str(part))
        dest.mkdir(parents=True, exist_ok=True)
        for f in part.iterdir():
            if f.is_file():
                os.replace(f, dest / f.name)  # atomic per file: a peer on a shared volume may do the same
        atomic.write_text(marker, f"{what}\n", fsync=False)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    log(f"{what}: done ({dest})")
    return dest


def hub_snapshot(repo: str, patterns: list[str], token: str | None, endpoint: str | None = None,
                 **retry: Any) -> Callable[[str], None]:
    """A ``fetch`` for :func:`fetch_once`: ``snapshot_download`` of ``patterns`` with retries; a config error
    (:func:`classify`) becomes :class:`ConfigError` naming spec.tokenizer.repo."""
    from huggingface_hub import snapshot_download

    def fetch(folder: str) -> None:
        try:
            with_retries(lambda: snapshot_download(repo, local_dir=folder, allow_patterns=patterns, token=token,
                                                   endpoint=endpoint), f"Downloading {repo} from the hub", **retry)
        except TransientError:
            raise
        except Exception as e:  # noqa: BLE001 - only the config class is turned into a ConfigError
            if classify(e) != CONFIG:
                raise
            raise ConfigError("kubetitan.tokenizer.repo (spec.tokenizer.repo)",
                              f"the hub refused {repo}: {type(e).__name__}: {first_line(e)}",
                              "check the repository name, and for a gated or private one accept its licence "
                              "and set spec.tokenizer.tokenSecretRef to a Secret holding a token with access") from None

    return fetch
