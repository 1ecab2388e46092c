"""docs/api.md: generated from the API types, complete, and not drifting.

Completeness is checked against the pydantic models directly (not against the CRD schema
the generator reads), so a field the schema conversion lost would show up here.
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from kubetitan_core import contract
from kubetitan import apidoc
from kubetitan_core.api import LlamaPretrainSpec, LlamaPretrainStatus, RestartCause, model_in
from kubetitan_core.crd import _description
from kubetitan_core.validation import CEL_RULES

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / apidoc.DOC_FILE
DOC = apidoc.render()
ROWS = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*$", DOC, re.M)}


def model_fields(model: type[BaseModel], path: str):
    """(wire path, field info) of every field under a model, recursively."""
    for name, f in model.model_fields.items():
        full = f"{path}.{f.alias or name}"
        yield full, f
        sub = model_in(f.annotation)
        if sub is not None:
            is_list = typing.get_origin(f.annotation) is list
            yield from model_fields(sub, f"{full}[]" if is_list else full)


FIELDS = list(model_fields(LlamaPretrainSpec, "spec")) + list(model_fields(LlamaPretrainStatus, "status"))


def cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


def test_committed_doc_matches_generator():
    got = COMMITTED.read_text() if COMMITTED.exists() else ""
    assert got == DOC, (
        f"{COMMITTED.relative_to(ROOT)} is out of date with kubetitan_core/api.py; regenerate it with "
        f"`{apidoc.GENERATE_COMMAND}` and commit the result"
    )


def test_generator_output_option(tmp_path):
    out = tmp_path / "api.md"
    assert apidoc.main(["--output", str(out)]) == 0
    assert out.read_text() == DOC


@pytest.mark.parametrize("path, field", FIELDS, ids=[p for p, _ in FIELDS])
def test_every_field_is_documented(path, field):
    assert path in ROWS, f"{path} has no row in docs/api.md"
    row = cells(ROWS[path])
    assert len(row) == 5
    assert row[4] == _description(field.description or "").replace("|", "\\|"), "description differs"
    if field.is_required():
        assert row[2] == "required"
    else:
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            assert row[2] == "its fields' defaults"
        elif default is None:
            assert row[2] == "unset"
        elif default in ([], {}):
            assert row[2] == f"`{json.dumps(default)}`"
        else:
            want = default if isinstance(default, str) and default else json.dumps(default)
            assert row[2] == f"`{want}`"


def test_no_rows_for_fields_that_do_not_exist():
    field_rows = {p for p in ROWS if p.startswith(("spec.", "status."))}
    assert field_rows == {p for p, _ in FIELDS}


@pytest.mark.parametrize(
    "path, type_cell, bounds_cell",
    [
        ("spec.resources.nodes", "integer", "≥ 1, ≤ 4096"),
        ("spec.training.learningRate", "number", "> 0, ≤ 1"),
        ("spec.precision.float8.recipe", "string", "one of `tensorwise`, `rowwise`"),
        ("spec.resources.shmSize", "string", "pattern `^[0-9]+(Ki\\|Mi\\|Gi\\|Ti)?$`"),
        ("spec.checkpoint.storage.persistentVolumeClaim.claimName", "string", "length 1–253"),
        ("spec.resources.nodeSelector", "map[string]string", ""),
        ("spec.resources.tolerations", "[]object (free-form)", ""),
        ("spec.precision.float8.filterFqns", "[]string", ""),
        ("spec.model.custom", "[object](#specmodelcustom)", ""),
        ("status.conditions", "[[]object](#statusconditions)", ""),
    ],
    ids=lambda x: x if "." in str(x) and " " not in str(x) else None,
)
def test_types_and_bounds(path, type_cell, bounds_cell):
    row = cells(ROWS[path])
    assert (row[1], row[3]) == (type_cell, bounds_cell)


def test_links_point_at_headings():
    anchors = {apidoc._anchor(h) for h in re.findall(r"^#+ (.+)$", DOC, re.M)}
    links = set(re.findall(r"\]\(#([^)]+)\)", DOC))
    assert links and links <= anchors, links - anchors


@pytest.mark.parametrize("code", list(contract.ExitCode), ids=lambda c: c.name)
def test_exit_codes_with_their_docstrings(code):
    row = next(r for r in DOC.splitlines() if r.startswith(f"| {int(code)} | `{code.name}` |"))
    assert len(cells(row)[2]) > 20
    assert " ".join(dict((c, d) for c, _, d in apidoc.exit_codes())[int(code)].split()) in row


def test_signal_exit_codes_are_listed():
    assert "| 137 | `SIGKILL` |" in DOC and "| 143 | `SIGTERM` |" in DOC


def test_every_restart_cause_is_explained():
    """Each row of the causes table is a row of docs/api.md (the retried ones are the CRD's enum)."""
    from kubetitan_core import causes

    assert typing.get_args(RestartCause) == tuple(c.id for c in causes.CAUSES if c.retried)
    for cause in causes.CAUSES:
        assert apidoc.cause_row(cause) in DOC.splitlines()
        assert f"| `{cause.id}` | {cause.doc} |" in DOC


@pytest.mark.parametrize("rule", CEL_RULES, ids=lambda r: r.id)
def test_cel_rules_are_listed(rule):
    row = next(r for r in DOC.splitlines() if r.startswith(f"| `{rule.id}` |"))
    assert f"`spec{rule.field_path}`" in row and rule.message in row


def test_printer_columns_are_listed():
    for col in apidoc.PRINTER_COLUMNS:
        assert f"| {col['name']} | `{col['jsonPath']}` |" in DOC
