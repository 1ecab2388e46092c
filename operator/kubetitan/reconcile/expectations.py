"""Expectations: the creates and deletes this replica has in flight until its watch shows them.

The pod, ConfigMap and Service indexes (kopf watches) lag behind the operator's own writes: a cycle woken by the
first pod event of a gang it has just created still sees most of the gang missing, and one woken by the first
DELETED event still sees the other pods it deleted. Kubernetes' own controllers keep *expectations* for this
(``ControllerExpectations`` and ``UIDTrackingControllerExpectations`` in kubernetes/pkg/controller/controller_utils.go:
creates and deletes in flight per controller, lowered as the informer observes them, expired after a timeout) and do
not act again until the cache has caught up. These are the same idea, kept by name and expired by time only:

- a child created (or found existing) within ``ttl`` seconds counts as existing although its index does not show
  it yet; after ``ttl`` a child the index still does not show is gone and is created again;
- a pod deleted within ``ttl`` is not deleted again with the same (or a longer) grace; a force delete (grace 0) of a
  pod deleted gracefully still goes, and after ``ttl`` a pod still shown is deleted again (a lost request);
- a ConfigMap/Service the index has shown once and no longer shows was deleted (by hand): it is missing at once.

Creates are kept for one attempt (a new attempt's children have new names; the ConfigMap and Service, shared by
every attempt, are written again for it). Pure: the clock is injected, no I/O; ``forget`` drops everything (a new
leader term re-reads the run from the API).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

ENSURED_SECONDS = 10.0
"""How long a child we created counts as existing while the index has not shown it yet (and a pod we deleted as
deleted: the same DELETE is not sent again while the index still shows the pod)."""


@dataclass
class Expectations:
    """One run's creates and deletes in flight (see the module's docstring)."""

    ttl: float = ENSURED_SECONDS
    clock: Callable[[], float] = time.monotonic
    """Monotonic seconds (real time: the API server's and the watch's pace, not the training clock's)."""
    attempt: int = -1
    """The attempt whose creates are recorded (another attempt's are dropped when it is asked about)."""
    created: dict[str, float] = field(default_factory=dict)
    """Children of ``attempt`` this replica created (or found existing), by name -> monotonic time."""
    seen: set[str] = field(default_factory=set)
    """The run's ConfigMap/Service names the indexes have shown (for ``attempt``)."""
    deleted: dict[str, tuple[float, int | None]] = field(default_factory=dict)
    """Pods this replica sent a DELETE for: name -> (monotonic time, grace seconds or None)."""
    pod_groups_deleted: set[str] = field(default_factory=set)
    """PodGroups of ended attempts the API has deleted (or found gone) on this replica's DELETE: not sent again while
    the decision still lists them (their pods are still terminating)."""

    def now(self) -> float:
        return self.clock()

    def forget(self) -> None:
        """Drop every expectation (after a fail-over the run is read from the API again)."""
        self.attempt, self.created, self.seen, self.deleted = -1, {}, set(), {}
        self.pod_groups_deleted = set()

    # ------------------------------------------------------------------ creates
    def creating(self, attempt: int) -> None:
        """About to create children of ``attempt``: the creates recorded for another attempt no longer count."""
        if self.attempt != attempt:
            self.attempt, self.created = attempt, {}

    def expect_created(self, names: Iterable[str], at: float) -> None:
        """``names`` were created (or found existing) at ``at``: they count as existing until ``at + ttl``."""
        for n in names:
            self.created[n] = at

    def recreated(self, names: Iterable[str], at: float) -> None:
        """``names`` (shown, then gone) were created again: not missing until the index has shown them again."""
        for n in names:
            self.seen.discard(n)
            self.created[n] = at

    def ever_created(self, name: str) -> bool:
        """Whether ``name`` was created (or written) for the current attempt at all, however long ago."""
        return name in self.created

    def in_flight(self, name: str, now: float) -> bool:
        """Whether ``name`` was created less than ``ttl`` ago (the index may not show it yet)."""
        return now - self.created.get(name, float("-inf")) < self.ttl

    def missing(self, attempt: int, shown: Mapping[str, bool]) -> tuple[str, ...]:
        """Of the run's ConfigMap/Service (``shown``: name -> whether its index shows it, in order), those that are
        gone: shown once and no longer, or never shown and not created moments ago."""
        if self.attempt != attempt:
            self.attempt, self.created, self.seen = attempt, {}, set()
        now, out = self.now(), []
        for child, is_shown in shown.items():
            if is_shown:
                self.seen.add(child)
            elif child in self.seen or not self.in_flight(child, now):
                out.append(child)
        return tuple(out)

    # ------------------------------------------------------------------ deletes
    def to_delete(self, names: Iterable[str], skip: Iterable[str], grace: int | None) -> list[str]:
        """``names`` less ``skip`` and those deleted less than ``ttl`` ago with the same grace (or by force);
        records the rest as deleted now, and drops deletes older than ``ttl``."""
        now, out, skipped = self.now(), [], set(skip)
        for n in names:
            if n in skipped:
                continue
            at, g = self.deleted.get(n, (float("-inf"), None))
            if now - at < self.ttl and (g == grace or g == 0):
                continue
            self.deleted[n] = (now, grace)
            out.append(n)
        for n, (at, _g) in list(self.deleted.items()):
            if now - at >= self.ttl:
                del self.deleted[n]
        return out

    def pod_groups_to_delete(self, names: Iterable[str]) -> list[str]:
        """Of ``names`` (the decision's PodGroups of ended attempts), those not deleted yet; forgets the deletions of
        PodGroups no longer listed (their pods are gone: the set stays as small as the decision's list)."""
        listed = list(dict.fromkeys(names))
        self.pod_groups_deleted &= set(listed)
        return [n for n in listed if n not in self.pod_groups_deleted]

    def pod_group_deleted(self, name: str) -> None:
        """The API deleted PodGroup ``name`` (or it was gone)."""
        self.pod_groups_deleted.add(name)
