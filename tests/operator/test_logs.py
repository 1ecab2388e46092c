"""Log levels an on-call engineer can use: ``kubetitan.logs``' rules on specific records, and a transient API
outage against kmockx (a warning without a traceback, counted apart from reconcile errors)."""

from __future__ import annotations

import logging

import pytest

from kmockx.harness import NS, Cluster, Operator, cpu_spec, lpt, wait_for
from kubetitan.kube import FencedWrite
from kubetitan.logs import Relevel


def _record(name: str, level: int, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, (type(exc), exc, None) if exc else None)


def _fenced() -> FencedWrite:
    return FencedWrite(None, (), status=503, message="replica-a does not hold the leader Lease")  # type: ignore[arg-type]


@pytest.mark.parametrize(("record", "threshold", "want"), [
    (_record("kopf.objects", logging.ERROR, "Request attempt #1/9 failed; will retry: PATCH /x -> 503"),
     logging.INFO, None),
    (_record("kopf.objects", logging.ERROR, "Request attempt #1/9 failed; will retry: PATCH /x -> 503"),
     logging.DEBUG, logging.DEBUG),
    (_record("kopf.objects", logging.ERROR, "Request attempt #9/9 failed; escalating: PATCH /x -> 503"),
     logging.INFO, logging.ERROR),
    (_record("kopf._core.actions.throttlers", logging.ERROR, "Throttling for 1 seconds due to an unexpected error",
             _fenced()), logging.INFO, None),
    (_record("kopf._core.engines.posting", logging.WARNING,
             "Failed to post an event. Ignoring and continuing. Event: FencedWrite(503)"), logging.INFO, None),
    (_record("kubetitan.operator", logging.WARNING, "LlamaPretrain ml/bad has a spec the operator refuses: x"),
     logging.INFO, logging.WARNING),
    (_record("kubetitan.operator", logging.ERROR, "Reconcile of LlamaPretrain ml/a failed", ValueError("bug")),
     logging.INFO, logging.ERROR),
], ids=["kopf-retry-hidden", "kopf-retry-at-debug-with-v", "kopf-gave-up-stays-error", "standby-fenced-kopf-write",
        "standby-fenced-event-post", "tenant-error-stays-warning", "operator-bug-stays-error"])
def test_relevel_rules(record: logging.LogRecord, threshold: int, want: int | None) -> None:
    kept = Relevel(threshold=threshold).filter(record)
    assert (record.levelno if kept else None) == want
    if kept and want is not None and want < logging.WARNING:
        assert record.exc_info is None


@pytest.mark.xdist_group("operator-kmock")
def test_a_transient_api_outage_is_a_warning_not_a_reconcile_error(cluster: Cluster,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Every status write of one cycle answered 503 (the client's 6 attempts): the cycle ends with one warning
    naming the run, no traceback, counted in api_unavailable and not in reconcile_errors; the next cycle writes."""
    caplog.set_level(logging.INFO, logger="kubetitan")
    fault = cluster.k.inject(code=503, resource="llamapretrains/status", verbs={"patch"}, count=6)
    with Operator(cluster, scan_interval=0.2) as op:
        cluster.apply(lpt("flaky", cpu_spec(nodes=1)))
        wait_for(lambda: cluster.status(NS, "flaky").get("phase") == "Starting", 30, "the status after the outage")
        assert fault.hits == 6
        assert op.metric("kubetitan_operator_api_unavailable_cycles_total") == 1
        assert not [s for m in op.registry.collect() if m.name == "kubetitan_operator_reconcile_errors"
                    for s in m.samples if s.value]
    records = [r for r in caplog.records if "API was unavailable" in r.getMessage()]
    assert [(r.levelno, r.exc_info) for r in records] == [(logging.WARNING, None)], records
    assert "ml/flaky" in records[0].getMessage() and "503" in records[0].getMessage()
    assert not [r for r in caplog.records if r.name.startswith("kubetitan") and r.levelno >= logging.ERROR]
