"""The causes table (``kubetitan_core.causes.CAUSES``) against what documents and alerts on it: docs/runbook.md has one
entry per row, in the table's order, under "Restart causes"; docs/api.md's cause tables link to those entries; every
alert a row names exists and has its runbook entry; the causes that end a run are the operator's failure reasons."""

from __future__ import annotations

import re

import pytest

from kubetitan import conditions as C
from kubetitan.monitoring import alerts as al
from kubetitan_core import causes
from support.paths import REPO

RUNBOOK = (REPO / "docs" / "runbook.md").read_text()
API_DOC = (REPO / "docs" / "api.md").read_text()


def cause_headings(text: str) -> list[str]:
    """The ``###`` headings of the runbook's "## Restart causes" section, in order."""
    section = text.split("\n## Restart causes\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^### (.+)$", section, re.M)


def test_the_runbook_has_one_entry_per_cause_in_the_tables_order() -> None:
    assert cause_headings(RUNBOOK) == [c.id for c in causes.CAUSES]


def test_a_missing_or_extra_entry_is_seen() -> None:
    """The check above can fail: a runbook without the GPUXidError entry, or with an entry of no row."""
    without = RUNBOOK.replace("\n### GPUXidError\n", "\n")
    assert cause_headings(without) != [c.id for c in causes.CAUSES]
    assert cause_headings(RUNBOOK + "\n### MadeUpCause\n") != [c.id for c in causes.CAUSES]


@pytest.mark.parametrize("cause", causes.CAUSES, ids=lambda c: c.id)
def test_api_doc_links_each_cause_to_its_runbook_entry(cause: causes.Cause) -> None:
    assert f"[runbook](runbook.md#{cause.runbook})" in API_DOC
    assert cause.runbook == cause.id.lower()  # GitHub's anchor of the heading `### <id>`


@pytest.mark.parametrize("cause", [c for c in causes.CAUSES if c.alert], ids=lambda c: c.id)
def test_a_cause_that_names_an_alert_has_it(cause: causes.Cause) -> None:
    names = {a.name: a for a in al.alerts()}
    assert cause.alert in names
    assert f"\n## {cause.alert.lower()}\n" in RUNBOOK
    if cause.retried:  # generated from the row: its severity and its restarts
        assert names[cause.alert].severity == cause.severity and f'cause="{cause.id}"' in names[cause.alert].expr
    else:  # a failure that ends the run has its own alert, so KubeTitanRunFailed leaves it out
        assert cause.id in al.OWN_ALERT_REASONS


def test_causes_that_end_a_run_are_the_operators_failure_reasons() -> None:
    reasons = {v for k, v in vars(C).items() if k.isupper() and isinstance(v, str)}
    fatal = [c.id for c in causes.CAUSES if not c.retried]
    assert fatal and set(fatal) <= reasons


def test_every_exit_code_but_ok_has_its_cause() -> None:
    """Every documented trainer exit code (and the two signals) maps to exactly one row."""
    from kubetitan_core.contract import EXIT_SIGKILL, EXIT_SIGTERM, ExitCode

    for code in [*(int(c) for c in ExitCode if c != ExitCode.OK), EXIT_SIGKILL, EXIT_SIGTERM]:
        assert len([c for c in causes.CAUSES if code in c.exit_codes]) == 1, code
    ids = [c.id for c in causes.CAUSES]
    assert len(ids) == len(set(ids))
