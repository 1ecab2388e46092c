"""Log levels an on-call engineer can use: what the operator did at info, problems at warning, bugs at error.

kopf and aiohttp log some routine things louder than they are (kopf: every retried API request at error, with
the request; aiohttp: one access-log line per liveness probe). ``configure`` sets the levels, and
``Relevel`` rewrites the level of such records by a table of rules, one row per kind of record, before any
handler sees them. The operator's own records are logged at the right level where they are made (tenant spec
errors at warning with the run's name, transient API outages at warning without a traceback).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    """Records of ``logger`` (a prefix) whose message starts with ``prefix`` and contains ``contains`` (or carry an
    exception named in ``exceptions``) are logged at ``level``."""

    level: int
    why: str
    logger: str = ""
    prefix: str = ""
    contains: str = ""
    exceptions: tuple[str, ...] = ()

    def matches(self, record: logging.LogRecord) -> bool:
        if self.logger and not record.name.startswith(self.logger):
            return False
        if self.exceptions:
            exc = record.exc_info[1] if record.exc_info else None
            return exc is not None and type(exc).__name__ in self.exceptions
        msg = record.getMessage() if self.prefix or self.contains else ""
        return msg.startswith(self.prefix) and self.contains in msg


RULES: tuple[Rule, ...] = (
    Rule(logging.DEBUG, "kopf retries 429/5xx/connection errors itself; only a request that gives up matters",
         logger="kopf", prefix="Request attempt", contains="will retry"),
    Rule(logging.DEBUG, "a standby's kopf write refused by the leader fence (kube.FencedWrite): expected while "
         "another replica leads", exceptions=("FencedWrite", "NotLeader")),
    Rule(logging.DEBUG, "kopf logs each refused write of a standby as a failed event post",
         logger="kopf", prefix="Failed to post an event", contains="FencedWrite"),
)


class Relevel(logging.Filter):
    """A handler filter: records matching a row of ``rules`` get its level, and are dropped below ``threshold``."""

    def __init__(self, rules: tuple[Rule, ...] = RULES, threshold: int = logging.INFO) -> None:
        super().__init__()
        self.rules, self.threshold = rules, threshold

    def filter(self, record: logging.LogRecord) -> bool:
        for rule in self.rules:
            if rule.matches(record):
                record.levelno, record.levelname = rule.level, logging.getLevelName(rule.level)
                if rule.level < logging.WARNING:
                    record.exc_info, record.exc_text = None, None
                return record.levelno >= self.threshold
        return True


def configure(verbose: bool = False, root: Any = None) -> None:
    """Set the levels after ``kopf.configure`` (which installs the root handler)."""
    threshold = logging.DEBUG if verbose else logging.INFO
    if not verbose:
        # kopf logs every handler call per object at info ("Handler '_pod_changed' succeeded", once per pod
        # event); keep its warnings and errors, and the operator's own info lines.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # No access log: the kubelet probes /healthz every few seconds (kopf's liveness server is aiohttp's).
    logging.getLogger("aiohttp.access").setLevel(logging.DEBUG if verbose else logging.WARNING)
    root = root or logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, Relevel) for f in handler.filters):
            handler.addFilter(Relevel(threshold=threshold))


__all__ = ["RULES", "Relevel", "Rule", "configure"]
