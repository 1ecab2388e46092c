"""What the operator keeps in memory per run between cycles: only what no read can give back.

Everything else a cycle needs is read into its :class:`~kubetitan.observation.snapshot.Snapshot` (the object, its
pods and nodes from the watches, rank 0's /metrics) or persisted in the run's status (timers, restart history,
pending Events: ``status.observation`` and ``status.pendingEvents``), so an operator restart or a fail-over loses
nothing a decision depends on. :class:`RunMemory` holds the rest, each field saying why it cannot be derived:

- synchronisation: the per-run lock and wake-up, the generation that wakes the daemon;
- the operator's own writes the watch has not delivered yet: the status it wrote last, the status re-read from
  the API, the creates and deletes in flight (:class:`~kubetitan.reconcile.expectations.Expectations`), the spec
  the current attempt was created from (as written to its ConfigMap), and the API's refusal of the last create
  with its backoff;
- de-duplication of what is reported outside the status (Warning Events for spec warnings and refused scraped
  values, the recovery-time metric), and the scrape's pace;
- caches of pure functions of the object (its parse, the spec-change gate), kept only for their cost.

With 2,000 runs this is a large part of the operator's memory, so the two pydantic models kept per run (the parse of
the spec, the status written last: ~12-15 KiB of objects each) are kept as their JSON (~2 KiB, :class:`Packed`) and
rebuilt when a cycle reads them (~20 us), and the parse's cache key is a digest of the spec, not a copy of it
(docs/benchmarks.md, "where the memory goes").

A new leader term drops the writes-in-flight part (``forget``) and the daemon re-reads the run from the API.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from kubetitan_core.api import LlamaPretrain, LlamaPretrainStatus
from kubetitan.observation import ChildError
from kubetitan.reconcile.expectations import Expectations

CREATE_RETRY_BASE_SECONDS = 0.5
CREATE_RETRY_CAP_SECONDS = 60.0

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Packed(Generic[M]):
    """A pydantic model kept as its JSON and rebuilt on each ``get()``: ~2 KiB of bytes instead of ~12-15 KiB of
    objects for a LlamaPretrain or its status, for ~20 us per rebuild.

    ``of`` checks that the JSON validates and gives back an equal model with the same JSON (so a float in an int
    field, or any value that would not survive the trip, is caught); a model that does not is kept as it is."""

    model_type: type[M]
    data: bytes | M
    """The model's JSON (``model_dump_json(by_alias=True, round_trip=True)``), or the model itself."""

    @classmethod
    def of(cls, model: M, previous: Packed[M] | None = None) -> Packed[M]:
        """``model`` packed; ``previous`` itself when it already holds the same JSON (a cycle that changed nothing:
        one dump, not a dump, a validation, a comparison and a second dump)."""
        data = model.model_dump_json(by_alias=True, round_trip=True).encode()
        if previous is not None and previous.model_type is type(model) and previous.data == data:
            return previous
        try:
            back = type(model).model_validate_json(data)
        except ValueError:  # pydantic's ValidationError: the JSON does not even validate
            return cls(type(model), model)
        same = back == model and back.model_dump_json(by_alias=True, round_trip=True).encode() == data
        return cls(type(model), data if same else model)

    def get(self) -> M:
        """The model (a new object for packed JSON: changing it changes nothing here)."""
        return self.model_type.model_validate_json(self.data) if isinstance(self.data, bytes) else self.data


def spec_digest(spec: Any) -> bytes:
    """A 128-bit digest of a spec's canonical JSON: the parse cache's key (a copy of the spec cost ~3.5 KiB a run)."""
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass
class CreateRefusals:
    """The API's refusal of this replica's last create round, and the backoff before the next round.

    Not derivable: a refused POST leaves no object behind to observe; the next decision reads the refusal
    (``ChildrenCreated=False``) and the retry waits for the backoff however often the run is woken meanwhile."""

    attempt: int = -1
    """The attempt whose children ``errors`` are about."""
    namespace: str = ""
    """The run's namespace (a ResourceQuota change there ends the backoff: ``retry_now``)."""
    errors: tuple[ChildError, ...] = ()
    """Children the API refused on the last create of ``attempt`` (fed to the next decision)."""
    failures: int = 0
    """Create rounds in a row that the API refused (the retry backoff doubles with each)."""
    retry_at: float = float("-inf")
    """Monotonic time before which no create is sent again after a refusal (the backoff)."""

    def of(self, attempt: int) -> tuple[ChildError, ...]:
        """The refusals of ``attempt`` (none for another attempt)."""
        return self.errors if self.attempt == attempt else ()

    def backoff_left(self) -> float:
        """Seconds before the next create round may go (<= 0: now)."""
        return self.retry_at - time.monotonic()

    def refused(self) -> float:
        """One more refused round: the capped, jittered backoff in seconds (recorded)."""
        self.failures += 1
        cap = min(CREATE_RETRY_CAP_SECONDS, CREATE_RETRY_BASE_SECONDS * 2 ** min(self.failures - 1, 10))
        delay = random.uniform(cap / 2, cap)  # real seconds: the API server's pace, not the training clock's
        self.retry_at = time.monotonic() + delay
        return delay

    def succeeded(self) -> None:
        self.failures, self.retry_at = 0, float("-inf")

    def retry_now(self) -> bool:
        """What refused the last round may have changed (a ResourceQuota of the namespace, the run's spec): the next
        cycle sends the round at once instead of waiting out the backoff (refused again, the backoff goes on
        doubling). True when a backoff was cut short."""
        waiting = bool(self.errors) and self.backoff_left() > 0
        self.retry_at = float("-inf")
        return waiting


@dataclass
class Reported:
    """What was last reported outside the status, so that it is reported once (not every cycle)."""

    warned: frozenset[tuple[str, str]] = frozenset()
    """The spec warnings (rule id, message: ``kubetitan_core.warning_rules``) last sent as Warning Events: each is
    sent once, and again only after it went away and came back."""
    refused_values: frozenset[tuple[str, str]] = frozenset()
    """The scraped values last refused (``scraped.signature``): a Warning Event only when this changes."""
    recovered_attempt: int = -1
    """The attempt whose recovery time (restart to created) was observed in the metric (once per attempt)."""
    spec_errors: str | None = None
    """The spec errors last logged for the run (logged again only when they change)."""
    last_scrape: float = float("-inf")
    """Clock time of the last scrape of rank 0 (scrapes are paced by ``--scrape-interval``)."""


@dataclass
class Memo:
    """Caches of pure functions of the object, kept for their cost only (a cycle of 2,000 runs re-validates none)."""

    parsed_from: bytes | None = None
    """``spec_digest`` of the ``spec`` the parse below came from: a cycle re-validates only when the spec changed."""
    parsed: tuple[Packed[LlamaPretrain] | None, list[Any], dict[str, Any]] | None = None
    """(LlamaPretrain or None, validation errors, the spec dumped in wire form)."""
    changes_for: tuple[Any, Any] | None = None
    """The (applied, desired) specs ``gate`` was computed for (by identity)."""
    gate: tuple[str | None, str | None, str | None] = (None, None, None)
    """``status.spec_gate`` (block, its reason, deferred) for that pair."""


@dataclass
class RunMemory:
    """One run's in-memory state between cycles (the module's docstring says why each part exists)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One cycle of a run at a time (the daemon and a wake-up never overlap)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by a watch event of the run or a child: the daemon's next cycle starts at once."""
    generation: Any = None
    """The run's ``metadata.generation`` last seen by the run's event handler (a new one wakes the daemon)."""
    packed_written: Packed[LlamaPretrainStatus] | None = None
    """The status this replica wrote last (``written``): the watch may still deliver an older one, and a cycle must
    not start from it (it would undo its own last step)."""
    reread: dict[str, Any] | None = None
    """The status as just read from the API (a new term, or a stale status): the next cycle starts from it, not
    from the watched one, which may be older."""
    applied_spec: dict[str, Any] | None = None
    """The spec the current attempt was created from: the ConfigMap's ``applied-spec.json``, read once per
    attempt (one GET, not one per cycle) or as this replica wrote it."""
    applied_loaded: bool = False
    """Whether ``applied_spec`` was read or written (None may be the answer: an attempt from an older operator)."""
    expected: Expectations = field(default_factory=Expectations)
    """The creates and deletes in flight (the indexes lag behind our own writes)."""
    refusals: CreateRefusals = field(default_factory=CreateRefusals)
    """The API's refusal of the last create round and its backoff."""
    reported: Reported = field(default_factory=Reported)
    """What was reported once outside the status."""
    memo: Memo = field(default_factory=Memo)
    """Caches of pure functions of the object."""

    @property
    def written(self) -> LlamaPretrainStatus | None:
        """The status this replica wrote last, rebuilt from ``packed_written`` (a new object on every read: assign it
        back after changing it)."""
        return None if self.packed_written is None else self.packed_written.get()

    @written.setter
    def written(self, status: LlamaPretrainStatus | None) -> None:
        self.packed_written = None if status is None else Packed.of(status, self.packed_written)

    def forget_children(self) -> None:
        """Drop what this replica believes about children (after a fail-over, re-read from the API)."""
        self.expected.forget()
        self.applied_spec, self.applied_loaded = None, False

    def start_from(self, raw_status: dict[str, Any] | None) -> None:
        """Take ``raw_status`` (just read from the API) as the status the next cycle starts from."""
        self.written, self.reread = None, raw_status
