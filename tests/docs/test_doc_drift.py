"""Docs name only what exists: every condition type/reason, restart cause, phase, field path, metric, exit code and
CLI subcommand/flag referenced in README.md, docs/*.md, the generated alert rules and the dashboards is checked
against the code that defines it:

- conditions, reasons: ``kubetitan.conditions``; restart causes and phases: ``kubetitan_core.api`` (``RestartCause``,
  ``Phase``);
- field paths: the CRD in ``crds/`` (``spec.*``, ``status.*``, also written without ``spec.``), torchtitan 0.2.2's
  ``JobConfig`` and kubetitan's ``[kubetitan]`` table (the trainer.toml keys), the chart's ``values.yaml``;
- metrics: the trainer's and the operator's Prometheus registries (with the suffixes Prometheus adds);
- exit codes: ``kubetitan_core.contract.ExitCode`` and the two signal codes there;
- CLI: the argparse parsers of ``kubetitan`` (and its forwarded ``operator`` / ``prepare-data``) and of
  ``kubetitan_trainer.launch``.

How a reference is recognised is in the ``refs_*`` functions; each has a unit test below on a tiny doc string that
holds a made-up name, so that the check is shown to fail.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import re
import typing
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from pathlib import Path

import pytest

from kubetitan_core import api, contract
from kubetitan import conditions as C
from support.pyparse import parse_file
from support import yamlio

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GENERATED = [REPO / "charts/kubetitan/files/kubetitan-rules.yaml",
             *sorted((REPO / "charts/kubetitan/files/dashboards").glob("*.json"))]
TEXTS = DOCS + GENERATED
pytestmark = pytest.mark.xdist_group("trainer-exporter")  # imports the trainer's exporter (torch) once


# ---------------------------------------------------------------------------------------------- what exists
@cache
def condition_words() -> frozenset[str]:
    """Condition types, reasons, restart causes and phases: every word a doc may call a condition/reason/cause."""
    reasons = {v for k, v in vars(C).items() if k.isupper() and isinstance(v, str)}
    causes = set(typing.get_args(api.RestartCause))
    phases = set(typing.get_args(api.Phase))
    return frozenset(reasons | set(C.ALL_TYPES) | causes | phases | {"True", "False", "Unknown"} | KUBERNETES_REASONS)


KUBERNETES_REASONS = frozenset({"FieldValueInvalid", "Status"})
"""Kubernetes' own names that the docs put next to "reason": the API server's reason for a failed CEL rule, and
its `Status` object (whose reason an API error carries)."""
KUBERNETES_PATHS = frozenset({"spec.nodeName"})
"""Fields of built-in kinds that the docs name with a path that also starts a LlamaPretrain's (a pod's binding)."""


def _crd_paths() -> set[str]:
    crd = yamlio.load(next((REPO / "crds").glob("*.yaml")).read_text())
    out: set[str] = set()

    def walk(node: dict, prefix: str) -> None:
        for key, child in (node.get("properties") or {}).items():
            out.add(prefix + key)
            walk(child, prefix + key + ".")
        if node.get("type") == "array" and "items" in node:
            walk(node["items"], prefix)

    for version in crd["spec"]["versions"]:
        walk(version["schema"]["openAPIV3Schema"], "")
    out |= {p.removeprefix("spec.") for p in out if p.startswith("spec.")}  # `training.steps` = `spec.training.steps`
    return out


def _dataclass_paths(cls: type, prefix: str) -> set[str]:
    out: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        out.add(prefix + f.name)
        if is_dataclass(hints[f.name]):
            out |= _dataclass_paths(hints[f.name], prefix + f.name + ".")
    return out


def _torchtitan_paths() -> set[str]:
    """torchtitan 0.2.2's JobConfig keys, read from its source (importing it would import torch)."""
    spec = importlib.util.find_spec("torchtitan")
    assert spec and spec.submodule_search_locations, "torchtitan is not installed"
    src = Path(next(iter(spec.submodule_search_locations))) / "config" / "job_config.py"
    classes = {n.name: n for n in parse_file(src).body if isinstance(n, ast.ClassDef)}

    def walk(name: str, prefix: str) -> set[str]:
        out: set[str] = set()
        for stmt in classes[name].body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                key = prefix + stmt.target.id
                out.add(key)
                ann = stmt.annotation
                if isinstance(ann, ast.Name) and ann.id in classes:
                    out |= walk(ann.id, key + ".")
        return out

    return walk("JobConfig", "")


def _values_paths() -> set[str]:
    out: set[str] = set()

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                out.add(prefix + str(k))
                walk(v, prefix + str(k) + ".")

    walk(yamlio.load((REPO / "charts/kubetitan/values.yaml").read_text()), "")
    return out


@cache
def field_paths() -> frozenset[str]:
    from kubetitan_trainer.job_config import JobConfig as KubetitanConfig

    return frozenset(_crd_paths() | _torchtitan_paths() | _dataclass_paths(KubetitanConfig, "") | _values_paths()
                     | KUBERNETES_PATHS)


def _python_attr(dotted: str) -> bool:
    """`kubetitan.plan.attempt_children`, `status.track`, `decide.RULES`: a name in the operator package."""
    import importlib

    parts = dotted.split(".")
    if parts[0] != "kubetitan":
        parts = ["kubetitan", *parts]
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return i > 1 or len(parts) == 1
    return False


@cache
def rule_ids() -> frozenset[str]:
    """Ids of the cross-field rules (docs/api.md's rule table names them, e.g. `parallelism.product`)."""
    from kubetitan_core import validation

    return frozenset(getattr(r, "id", None) or getattr(r, "name", None) or r[0] for r in validation.CEL_RULES)


@cache
def path_roots() -> frozenset[str]:
    """A dotted token is taken for a field path only when its first segment starts one."""
    return frozenset(p.split(".", 1)[0] for p in field_paths() if "." in p)


def _registry_names(registry) -> set[str]:
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count", ""], "info": ["_info"],
                "summary": ["_sum", "_count", ""], "gauge": [""]}
    out: set[str] = set()
    for family in registry.collect():
        out |= {family.name + s for s in suffixes.get(family.type, [""])}
    return out


@cache
def metric_names() -> frozenset[str]:
    from kubetitan.operator_metrics import OperatorMetrics
    from kubetitan_trainer.metrics import Exporter

    trainer = Exporter(peak_flops=989e12, total_steps=100, attempt=1, job_start=1.7e9, checkpoint_interval=10)
    trainer.set_loss(2.5)  # the loss metric is registered at the first logged step
    trainer.eval_done(10, 2.7)  # the eval metrics at the first held-out evaluation
    trainer.source_losses({"a": 2.5})  # a mixture's per-source losses at its first logged step and evaluation
    trainer.source_eval_losses({"a": 2.7})
    return frozenset(_registry_names(trainer.registry) | _registry_names(OperatorMetrics().registry))


@cache
def exit_codes() -> frozenset[int]:
    return frozenset({int(c) for c in contract.ExitCode} | {contract.EXIT_SIGKILL, contract.EXIT_SIGTERM})


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _help_flags(parse_args) -> set[str]:
    """Flags of a parser that a module builds inside its parse function: read from its --help."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse_args(["--help"])
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", out.getvalue()))


@cache
def cli() -> dict[str, frozenset[str]]:
    """Subcommand -> its flags; '' = the top-level parser; 'launch' = kubetitan_trainer.launch.launcher."""
    from kubetitan import cli as kcli
    from kubetitan import runner
    from kubetitan_trainer.data import prepare
    from kubetitan_trainer.launch import launcher as launch

    top = kcli.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    out = {"": frozenset(_flags(top))}
    for name, p in sub.choices.items():
        out[name] = frozenset(_flags(p))
    out["operator"] = frozenset(_flags(runner.build_parser()))
    out["prepare-data"] = frozenset(_help_flags(prepare.parse_args))
    out["launch"] = frozenset(_help_flags(launch.parse_args))
    return out


# ---------------------------------------------------------------------------------------------- references
@dataclass(frozen=True)
class Ref:
    kind: str
    name: str
    line: int


CAMEL = r"[A-Z][A-Za-z0-9]+"
_TYPED = re.compile(rf"`?({CAMEL})=(True|False|Unknown)(?:/({CAMEL}))?`?")
"""`Type=Status/Reason` (backticked or not)."""
_NEAR = re.compile(rf"\b(?:[Cc]ondition|[Rr]eason|[Cc]ause|[Pp]hase)s?:?\s+`({CAMEL})`|"
                   rf"(?:`({CAMEL})`|\(({CAMEL}))\s+(?:condition|reason|cause|phase)s?\b")
"""A backticked CamelCase word right before or after "condition", "reason", "cause" or "phase", or
"(Word condition)" as alert texts write it."""
_LIST_BEFORE = re.compile(rf"((?:`{CAMEL}`\s*(?:/|,|or|and)\s*)+`{CAMEL}`)\s+(?:condition|reason|cause)s?\b")
"""`A` / `B` conditions."""
_TICKED = re.compile(r"`([^`\n]+)`")


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def refs_conditions(text: str) -> list[Ref]:
    out: list[Ref] = []
    for m in _TYPED.finditer(text):
        out.append(Ref("condition", m.group(1), _line(text, m.start())))
        if m.group(3):
            out.append(Ref("condition", m.group(3), _line(text, m.start())))
    for m in _NEAR.finditer(text):
        word = m.group(1) or m.group(2) or m.group(3)
        if not _TYPED.fullmatch(text[m.start():m.end()]):
            out.append(Ref("condition", word, _line(text, m.start())))
    for m in _LIST_BEFORE.finditer(text):
        out += [Ref("condition", w, _line(text, m.start())) for w in re.findall(rf"`({CAMEL})`", m.group(1))]
    # markdown tables: the cells of a column headed Cause / Condition / Reason
    lines = text.splitlines()
    for i, header in enumerate(lines):
        if not header.startswith("|") or i + 1 >= len(lines) or not re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            continue
        cols = [j for j, h in enumerate(header.strip("|").split("|")) if re.search(r"cause|condition|reason", h, re.I)]
        for k in range(i + 2, len(lines)):
            if not lines[k].startswith("|"):
                break
            cells = lines[k].strip("|").split("|")
            for j in cols:
                if j < len(cells):
                    out += [Ref("condition", w, k + 1) for w in re.findall(rf"`({CAMEL})`", cells[j])]
    return out


_PATH = re.compile(r"^\.?([a-z][A-Za-z0-9]*(?:\[[*0-9]*\])?(?:\.(?:[a-z][A-Za-z0-9_]*\*?|\*[A-Za-z0-9]*)(?:\[[*0-9]*\])?)+)$")


def refs_paths(text: str) -> list[Ref]:
    """Backticked dotted names whose first segment starts a known field path: `training.steps`,
    `spec.runPolicy.suspend`, `status.restarts[*].cause`, `runPolicy.*`; a slash list `a.b / c / d` is
    `a.b`, `a.c`, `a.d`; a leading `[table]` names the trainer.toml table (`[kubetitan] metrics_port`)."""
    out: list[Ref] = []
    for m in _TICKED.finditer(text):
        token = m.group(1).strip()
        table = re.match(r"^\[([a-z_.]+)\]\s+(.+)$", token)
        if table:
            out += [Ref("path", f"{table.group(1)}.{k}", _line(text, m.start()))
                    for k in table.group(2).split() if re.fullmatch(r"[a-z_]+", k)]
            continue
        parts = [p.strip() for p in token.split(" / ")]
        if not _PATH.match(parts[0]) or re.search(r"\.(py|json|jsonl|ya?ml|md|toml|txt|bin|log|sh|png)$", parts[0]):
            continue
        first = _PATH.match(parts[0]).group(1)
        names = [first] + [first.rsplit(".", 1)[0] + "." + p for p in parts[1:] if re.fullmatch(r"[A-Za-z_]+", p)]
        for name in names:
            name = re.sub(r"\[[*0-9]*\]", "", name)
            if name.split(".", 1)[0] in path_roots():
                out.append(Ref("path", name, _line(text, m.start())))
    return out


_METRIC = re.compile(r"(?<![\w.])(kubetitan_(?:trainer|operator|build)_[a-z0-9_]*[a-z0-9])(?![\w(])")


def refs_metrics(text: str) -> list[Ref]:
    return [Ref("metric", m.group(1), _line(text, m.start())) for m in _METRIC.finditer(text)]


_EXIT = re.compile(r"\bexit(?:s|ed)?(?: with)?(?: (?:status|code)s?)?:? (\d+)\b", re.I)


def refs_exit_codes(text: str) -> list[Ref]:
    out = [Ref("exit", m.group(1), _line(text, m.start())) for m in _EXIT.finditer(text)]
    # the first column of a table under an "Exit codes" heading
    for sec in re.finditer(r"^#+ [^\n]*[Ee]xit codes[^\n]*\n(.*?)(?=^#)", text + "\n#", re.M | re.S):
        base = _line(text, sec.start(1))
        for k, row in enumerate(sec.group(1).splitlines()):
            cell = re.match(r"^\|\s*`?(\d+)`?\s*\|", row)
            if cell:
                out.append(Ref("exit", cell.group(1), base + k))
    return out


_CMD = re.compile(r"^(?:\$\s+)?(?:\S*/)?(?:kubetitan|python3? -m kubetitan\.cli)\s+([a-z][a-z-]*)(.*)$")
_LAUNCH = re.compile(r"-m kubetitan_trainer\.launch\b(.*)$")
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def _code(text: str) -> list[tuple[int, str]]:
    """(line, command) for every command in fenced code blocks and inline code spans: a line is cut at a
    comment and split at `|`, `;` and `&&`; a trailing backslash continues it."""
    out: list[tuple[int, str]] = []
    pieces: list[tuple[int, str]] = []
    fence = False
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fence = not fence
        elif fence:
            start = i
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            pieces.append((start + 1, line))
        else:
            pieces += [(i + 1, m.group(1)) for m in _TICKED.finditer(line)]
        i += 1
    for n, piece in pieces:
        piece = re.split(r"(?:^|\s)#", piece, maxsplit=1)[0]
        piece = re.sub(r"\[[^\]]*\]", lambda m: m.group(0).replace("|", " "), piece)  # [a|b]: alternatives
        out += [(n, part.strip()) for part in re.split(r"\||;|&&", piece)]
    return out


def refs_cli(text: str) -> list[Ref]:
    """`kubetitan SUB --flag ...` (also .venv/bin/kubetitan and python -m kubetitan.cli) at the start of a
    command in code, and `python -m kubetitan_trainer.launch --flag ...` anywhere in code."""
    out: list[Ref] = []
    for n, cmd in _code(text):
        m = _CMD.match(cmd)
        if m:
            out.append(Ref("cli", m.group(1), n))
            out += [Ref("cli", f"{m.group(1)} {f}", n) for f in _FLAG.findall(m.group(2))]
        m = _LAUNCH.search(cmd)
        if m:
            out += [Ref("cli", f"launch {f}", n) for f in _FLAG.findall(m.group(1))]
    return out


# ---------------------------------------------------------------------------------------------- checks
def unknown(ref: Ref) -> bool:
    if ref.kind == "condition":
        return ref.name not in condition_words()
    if ref.kind == "path":
        if "*" in ref.name:
            rx = re.compile(re.escape(ref.name).replace(r"\*", r"[A-Za-z0-9_.]*") + "$")
            return not any(rx.match(p) for p in field_paths())
        return ref.name not in field_paths() | rule_ids() and not _python_attr(ref.name)
    if ref.kind == "metric":
        return ref.name not in metric_names()
    if ref.kind == "exit":
        return int(ref.name) not in exit_codes()
    if ref.kind == "cli":
        sub, _, flag = ref.name.partition(" ")
        commands = cli()
        if sub not in commands:
            return True
        return bool(flag) and flag not in commands[sub] and flag not in commands[""] | {"-h", "--help"}
    raise AssertionError(ref.kind)


def check(text: str) -> list[Ref]:
    refs = refs_conditions(text) + refs_paths(text) + refs_metrics(text) + refs_exit_codes(text) + refs_cli(text)
    return [r for r in refs if unknown(r)]


@pytest.mark.parametrize("path", TEXTS, ids=[str(p.relative_to(REPO)) for p in TEXTS])
def test_every_name_in_the_docs_exists_in_the_code(path: Path) -> None:
    bad = check(path.read_text())
    assert not bad, "\n".join(f"{path.relative_to(REPO)}:{r.line}: unknown {r.kind} {r.name!r}" for r in bad)


def test_the_docs_reference_enough_names_to_check() -> None:
    """The extractors find the real references (a regex that matches nothing would pass everything)."""
    text = "\n".join(p.read_text() for p in TEXTS)
    kinds = {}
    for r in refs_conditions(text) + refs_paths(text) + refs_metrics(text) + refs_exit_codes(text) + refs_cli(text):
        kinds.setdefault(r.kind, set()).add(r.name)
    assert {"SpecAccepted", "ImmutableFieldChanged", "ContainerFailed", "MetricsAvailable"} <= kinds["condition"]
    assert {"training.steps", "runPolicy.suspend", "status.restarts.cause"} <= kinds["path"]
    assert {"kubetitan_trainer_step", "kubetitan_operator_reconcile_errors_total"} <= kinds["metric"]
    assert {"2", "3", "75"} <= kinds["exit"]
    assert {"validate", "render", "run", "run --steps", "crd --kubernetes-version"} <= kinds["cli"]


# ---------------------------------------------------------------------------------------------- the check fails
@pytest.mark.parametrize(("doc", "kind", "name"), [
    ("1. `kubectl describe lpt`: the `Hung` / `Progressing` conditions and recent events.", "condition", "Hung"),
    ("1. `kubectl describe lpt`: the `Hung` / `Progressing` conditions and recent events.", "condition",
     "Progressing"),
    ("Check `kubectl describe lpt` (Hung condition), the trainer logs", "condition", "Hung"),
    ("refused: condition `SpecAccepted=False/SpecFrozen`, the attempt keeps running", "condition", "SpecFrozen"),
    ("status shows `Healthy=False` and no progress", "condition", "Healthy"),
    ("| Cause in `status.restarts` | What |\n|---|---|\n| `GpuFellOff` | a GPU fell off the bus |\n",
     "condition", "GpuFellOff"),
    ("2. Lower `training.lr` or lengthen `training.warmupSteps`", "path", "training.lr"),
    ("`spec.runPolicy.retryLimit` caps the restarts", "path", "spec.runPolicy.retryLimit"),
    ("`status.restarts[*].nodeCount`", "path", "status.restarts.nodeCount"),
    ("| `training.steps / seqLen / batchSize` | ... |", "path", "training.batchSize"),
    ("`parallelism.*Factor`", "path", "parallelism.*Factor"),
    ("`[kubetitan] metrics_hostname`", "path", "kubetitan.metrics_hostname"),
    ("the series `kubetitan_trainer_tokens_seen_total` counts", "metric", "kubetitan_trainer_tokens_seen_total"),
    ("expr: rate(kubetitan_operator_reconciles_total[5m]) > 1", "metric", "kubetitan_operator_reconciles_total"),
    ("the trainer exits 97 when the disk is gone", "exit", "97"),
    ("## Exit codes\n\n| Code | Meaning |\n|---|---|\n| 42 | made up |\n", "exit", "42"),
    ("```\nkubetitan frobnicate examples/debug-cpu.yaml\n```", "cli", "frobnicate"),
    ("```\n.venv/bin/kubetitan run my-run.yaml --max-steps 20\n```", "cli", "run --max-steps"),
    ("`python -m kubetitan.cli operator --namespaces ml`", "cli", "operator --namespaces"),
    ("`kubetitan prepare-data FILES -o DIR [--tokenizer builtin|DIR] [--text-column text]`", "cli",
     "prepare-data --text-column"),
    ("```\npod: python -m kubetitan_trainer.launch --config=x --node-count=2\n```", "cli", "launch --node-count"),
])
def test_a_made_up_name_fails_the_check(doc: str, kind: str, name: str) -> None:
    assert any(r.kind == kind and r.name == name for r in check(doc)), (check(doc), doc)


@pytest.mark.parametrize("doc", [
    "refused: condition `SpecAccepted=False/ImmutableFieldChanged`, the attempt keeps running",
    "| Cause in `status.restarts` | What |\n|---|---|\n| `Hang` / `StartupTimeout` | no step |\n",
    "the `Restarting` condition and the `Ready` condition",
    "`training.steps / seqLen / localBatchSize`, `runPolicy.*`, `status.restarts[*].cause`, `.status.phase`",
    "`[kubetitan] metrics_port`, `checkpoint.enable`, `monitoring.rules.runbookBaseURL`",
    "`kubetitan_trainer_step_duration_seconds_bucket`, kubetitan_operator_reconcile_errors_total",
    "exits 75; exit code 4; `kubetitan_trainer.launch` is a module, `kubetitan_llama3` a TrainSpec",
    "```\nkubetitan run my-run.yaml --steps 20 --output-dir /tmp/x\nkubetitan crd | kubectl apply -f -\n```",
    "python -m kubetitan_trainer.launch --config=/etc/kubetitan/trainer.toml --nnodes=N --master-port=29500",
])
def test_real_names_pass_the_check(doc: str) -> None:
    assert check(doc) == []
