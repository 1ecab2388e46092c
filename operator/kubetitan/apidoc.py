"""The API reference (``docs/api.md``), generated from the same schema as the CRD.

Every row comes from :func:`kubetitan_core.crd.openapi_schema`, which comes from the docstrings,
defaults and bounds in :mod:`kubetitan_core.api`; so the reference, ``kubectl explain`` and the
defaults the operator applies cannot disagree. The exit codes come from
:class:`kubetitan_core.contract.ExitCode` and its member docstrings, the restart causes from
:data:`kubetitan_core.causes.CAUSES`.

Run ``python -m kubetitan.apidoc --write`` after changing the API; a test fails when
``docs/api.md`` drifts from this generator.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import signal
from pathlib import Path
from typing import Any

from kubetitan_core import API_VERSION, KIND, PLURAL, SHORT_NAMES, causes, contract
from kubetitan_core.crd import GENERATE_COMMAND as CRD_COMMAND
from kubetitan_core.crd import PRINTER_COLUMNS, _description, emit, openapi_schema

GENERATE_COMMAND = "python -m kubetitan.apidoc --write"
DOC_FILE = "api.md"

# ------------------------------------------------------------------------ formatting
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n\n", "<br><br>").replace("\n", " ")


def _code(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return f"`{text}`" if text != "" else '`""`'


def _type(node: dict[str, Any]) -> str:
    kind = node.get("type", "")
    if kind == "array":
        return f"[]{_type(node['items'])}"
    if kind == "object":
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            return f"map[string]{_type(extra)}"
        if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
            return "object (free-form)"
    return kind


def _bound(node: dict[str, Any], key: str, op: str, strict_op: str) -> str | None:
    if key not in node:
        return None
    strict = node.get(f"exclusive{key.capitalize()}") is True
    return f"{strict_op if strict else op} {node[key]}"


def _constraints(node: dict[str, Any]) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(_code(v) for v in node["enum"]))
    lo = _bound(node, "minimum", "≥", ">")
    hi = _bound(node, "maximum", "≤", "<")
    parts += [b for b in (lo, hi) if b]
    if "minLength" in node or "maxLength" in node:
        parts.append(f"length {node.get('minLength', 0)}–{node.get('maxLength', '∞')}")
    if "pattern" in node:
        parts.append(f"pattern {_code(node['pattern'])}")
    return ", ".join(parts)


def _default(node: dict[str, Any], required: bool) -> str:
    if required:
        return "required"
    if "default" in node:
        if node["default"] == {} and "properties" in node:
            return "its fields' defaults"
        return _code(node["default"])
    if node.get("type") == "array":
        return "`[]`"
    if node.get("type") == "object" and "additionalProperties" in node:
        return "`{}`"
    return "unset"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, spaces to dashes, punctuation dropped."""
    return "".join(c for c in heading.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _has_fields(node: dict[str, Any]) -> bool:
    return "properties" in node


# ------------------------------------------------------------------------- sections
def _sections(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """Every object with fields under ``node``, depth first, parents before children."""
    out = [(path, node)]
    for name, child in node.get("properties", {}).items():
        if _has_fields(child):
            out += _sections(child, f"{path}.{name}")
        elif child.get("type") == "array" and _has_fields(child.get("items", {})):
            out += _sections(child["items"], f"{path}.{name}[]")
    return out


def _field_table(path: str, node: dict[str, Any]) -> list[str]:
    required = set(node.get("required", []))
    rows = [
        "| Field | Type | Default | Bounds / values | Description |",
        "|---|---|---|---|---|",
    ]
    for name, child in node["properties"].items():
        full = f"{path}.{name}"
        kind = _type(child)
        target = full if _has_fields(child) else f"{full}[]" if _has_fields(child.get("items", {})) else None
        if target:
            kind = f"[{kind}](#{_anchor(target)})"
        rows.append(
            f"| `{full}` | {kind} | {_cell(_default(child, name in required))} | "
            f"{_cell(_constraints(child))} | {_cell(child.get('description', ''))} |"
        )
    return rows


def _rules_table(spec: dict[str, Any], rules: list[Any]) -> list[str]:
    by_rule = {r.rule: r for r in rules}
    rows = ["| Id | Field | Rule (CEL, `self` = `spec`) | Message |", "|---|---|---|---|"]
    for v in spec.get("x-kubernetes-validations", []):
        r = by_rule[v["rule"]]
        rows.append(f"| `{r.id}` | `spec{r.field_path}` | `{_cell(r.rule)}` | {_cell(r.message)} |")
    return rows


def exit_codes() -> list[tuple[int, str, str]]:
    """(code, name, meaning) of every trainer exit code, from contract.py's docstrings."""
    tree = ast.parse(inspect.getsource(contract.ExitCode))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for stmt, nxt in zip(body, body[1:] + [None]):
        if isinstance(stmt, ast.Assign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[stmt.targets[0].id] = inspect.cleandoc(nxt.value.value)  # type: ignore[attr-defined]
    out = [(int(c), c.name, docs.get(c.name, "")) for c in contract.ExitCode]
    for code in (contract.EXIT_SIGKILL, contract.EXIT_SIGTERM):
        sig = signal.Signals(code - 128).name
        out.append((code, sig, f"Killed by {sig} (128 + {code - 128}) before the trainer could exit "
                    "on its own. Retried (cause `ContainerFailed`, or `OOMKilled` if the OOM killer sent it)."))
    return sorted(out)


def render(rules: list[Any] | None = None) -> str:
    """The whole of ``docs/api.md``."""
    if rules is None:
        from kubetitan_core.validation import CEL_RULES

        rules = list(CEL_RULES)
    root = openapi_schema(rules)
    spec, status = root["properties"]["spec"], root["properties"]["status"]
    # status.kopf is the framework's bookkeeping (crd.py keeps it in the schema), not part of the API
    status = {**status, "properties": {k: v for k, v in status["properties"].items() if k != "kopf"}}
    spec_sections = _sections(spec, "spec")
    status_sections = _sections(status, "status")
    out = _head(root, spec_sections + status_sections)
    out += ["## Spec", ""]
    for path, node in spec_sections:
        out += [f"### `{path}`", "", _cell(node.get("description", "")), "", *_field_table(path, node), ""]
    out += _rules_sections(spec, rules)
    out += ["## Status", "", "Written only by the operator, through the `status` subresource.", ""]
    for path, node in status_sections:
        out += [f"### `{path}`", "", _cell(node.get("description", "")), "", *_field_table(path, node), ""]
    out += _printer_columns() + _exit_codes() + restart_causes() + names_and_pod_fields() + _admin_policy()
    return "\n".join(out)


def _head(root: dict[str, Any], sections: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Title, introduction and contents."""
    out = [
        f"# {KIND} API reference (`{API_VERSION}`)",
        "",
        f"<!-- Generated by `{GENERATE_COMMAND}` from operator/core/kubetitan_core/api.py; do not edit by hand. -->",
        "",
        f"{_cell(root['description'])} Resource `{PLURAL}`, short name "
        f"{', '.join(f'`{s}`' for s in SHORT_NAMES)}, namespaced. The same descriptions are shown by "
        f"`kubectl explain {SHORT_NAMES[0]}.spec.<field>`; the CRD in `crds/` comes from the same types "
        f"(`{CRD_COMMAND}`).",
        "",
        "Defaults are applied by the API server (from the CRD) and by `kubetitan validate` / the operator "
        "(from the same types): a field shown as *unset* is absent unless you set it. "
        "Sections default to their fields' defaults, so an empty `spec: {}` is Llama 3 8B on one 8-GPU node.",
        "",
        "## Contents",
        "",
    ]
    for path, _ in sections:
        out.append(f"{'  ' * path.count('.')}- [`{path}`](#{_anchor(path)})")
    out += ["- [Cross-field rules](#cross-field-rules)", "- [Warnings](#warnings)", "- [Printer columns](#printer-columns)",
            "- [Trainer exit codes](#trainer-exit-codes)", "- [Restart causes](#restart-causes)",
            "- [Names and pod fields](#names-and-pod-fields)", "- [Admin policy](#admin-policy)", ""]
    return out


def _rules_sections(spec: dict[str, Any], rules: list[Any]) -> list[str]:
    """The CEL rules, the whole rule table and the warnings."""
    from kubetitan_core.validation import RULES
    from kubetitan_core.warning_rules import WARNINGS

    out = [
        "## Cross-field rules",
        "",
        "Checked by the API server (`x-kubernetes-validations` on `spec`, reason `FieldValueInvalid`) and, "
        "with the same ids, by `kubetitan validate` and the operator. The Python validator also checks "
        "what CEL cannot see (model dimensions, instance types, FP8 hardware); run `kubetitan validate FILE` "
        "before applying.",
        "",
        *_rules_table(spec, rules),
        "",
    ]
    out += ["All semantic rules, one table (`kubetitan_core.validation.RULES`): `kubetitan validate` and the operator "
            "check each; CEL: its twin is generated into the CRD and also enforced by the API server; Trainer: the "
            "trainer.toml key on which the trainer checks it again when it starts (`kubetitan_trainer.checks`, "
            "exit code 2):", "",
            "| Rule | Field | Checks | CEL | Trainer |", "|---|---|---|---|---|"]
    out += [f"| {r.id} | {_cell(r.field)} | {_cell(r.checks)} | {'yes' if r.cel else ''} | {_cell(r.trainer)} |"
            for r in RULES]
    out.append("")
    out += ["## Warnings", "", _cell(
        "Valid specs that are probably not what was meant, one table (`kubetitan_core.warning_rules.WARNINGS`). A "
        "warning never refuses anything: `kubetitan validate` prints each as `warning [id] path: message` and "
        "exits 0, and the operator sends each as a Warning Event. File warnings compare the documents of one "
        "file (`kubetitan validate` only)."), "",
            "| Warning | Field | Flags | Scope |", "|---|---|---|---|"]
    out += [f"| {w.id} | {_cell(w.field)} | {_cell(w.flags)} | {w.scope} |" for w in WARNINGS]
    out.append("")
    return out


def _printer_columns() -> list[str]:
    out = ["## Printer columns", "", "`kubectl get lpt` shows the first group; `-o wide` adds the rest.", "",
           "| Column | Field | Type | Wide only | Description |", "|---|---|---|---|---|"]
    for c in PRINTER_COLUMNS:
        out.append(f"| {c['name']} | `{c['jsonPath']}` | {c['type']} | {'yes' if c.get('priority') else ''} | "
                   f"{_cell(c.get('description', 'Time since the resource was created.'))} |")
    out.append("")
    return out


def _exit_codes() -> list[str]:
    out = ["## Trainer exit codes", "", _description(contract.ExitCode.__doc__ or ""), "",
           "| Code | Name | Meaning |", "|---|---|---|"]
    out += [f"| {code} | `{name}` | {_cell(doc)} |" for code, name, doc in exit_codes()]
    out.append("")
    return out


def cause_row(c: causes.Cause) -> str:
    """One row of the cause tables: what it means, what follows, what it counts against, severity, runbook."""
    follows = "in place, else re-created" if c.in_place and c.recreate else "re-created" if c.recreate else \
        "in place" if c.in_place else "the run fails"
    return (f"| `{c.id}` | {_cell(c.doc)} | {follows} | {_cell(c.budgets())} | {c.severity} | "
            f"[runbook](runbook.md#{c.runbook}) |")


def restart_causes() -> list[str]:
    """The restart causes and the failures that end a run, from ``kubetitan_core.causes.CAUSES``."""
    head = ["| Cause | Meaning | What follows | Counts against | Severity | Runbook |", "|---|---|---|---|---|---|"]
    return [
        "## Restart causes", "", _cell(
            "Values of `status.restarts[].cause` (and of the `cause` label of `kubetitan_operator_restarts_total`), "
            "one row each of `kubetitan_core.causes.CAUSES`, the table the operator's restart decision, the "
            "launcher's in-place decision, this list, the CRD's enum and the alerts are all read from. *In place*: "
            "the launchers restart every rank's workers in the same pods while `runPolicy.maxInPlaceRestarts` "
            "lasts (a worker failure); *re-created*: the operator deletes the gang and creates the next attempt, "
            "which resumes from the newest checkpoint."), "", *head,
        *[cause_row(c) for c in causes.CAUSES if c.retried], "",
        "Failures that end the run (the `Failed` condition's reason; never retried, never restarted in place):", "",
        *head, *[cause_row(c) for c in causes.CAUSES if not c.retried], "",
    ]


def _admin_policy() -> list[str]:
    from kubetitan import policy

    out = ["## Admin policy", "", _cell(
        "What the cluster admin allows runs to put into their pods (operator/kubetitan/policy.py). A valid spec "
        "outside it is refused at reconcile: `Ready=False`/`SpecAccepted=False` with reason "
        f"`{policy.REASON}`, the field path and the fix in the message, a Warning Event, no child. A run that "
        "had started before (the operator restarted with a stricter policy) is not abandoned: its running pods "
        "are still observed (failures, hangs, success, clean-up), the same condition and one Warning Event say "
        "what is refused, and no new attempt (restart, resume) starts until the spec complies or the policy "
        "allows it; the same holds for a started run whose edited spec becomes invalid (reason `InvalidSpec`). "
        "`kubetitan validate --policy FILE` checks the same (FILE: these keys, or a Helm values file with a "
        "`policy` block). The list knobs hold what is allowed: `[\"*\"]` allows anything, `[]` nothing; "
        "docs/install.md states the trust model (what creating a LlamaPretrain lets a user do, and what each knob "
        "bounds) and shows how an admin sets them."), "",
        "| Helm value | Operator flag | Default | Meaning |", "|---|---|---|---|"]
    out += [f"| `{value}` | `{flag}` | `{default}` | {_cell(help_)} |"
            for value, flag, default, help_ in policy.knob_table()]
    out.append("")
    return out + _code_loading_env()


def _code_loading_env() -> list[str]:
    python = " ".join(contract.TRAINER_COMMAND)
    out = ["### Code-loading environment", "", _cell(
        "`policy.codeLoadingEnv` refuses a `spec.resources.env` variable that matches one of these patterns unless "
        "it lists the name (`kubetitan_core.contract.CODE_LOADING_ENV`, defined once for the policy, this table "
        "and the tests). Matching names that only tune are allowed: "
        + ", ".join(f"`{n}`" for n in sorted(contract.TUNING_ENV)) + ". Whatever the environment, the trainer "
        f"container's command is `{python}`: an absolute interpreter path (never `python` looked up through "
        "`PATH`), with Python's user site directory off (`-s`), and the operator sets "
        f"`{contract.ENV_NO_USER_SITE}=1` (reserved) so that no Python process of the pod reads `.pth` files "
        "from a home directory."), "", "| Pattern | What it makes the trainer load or run | Names it refuses, e.g. |",
        "|---|---|---|"]
    out += [f"| `{e.pattern}` | {_cell(e.loads)} | {', '.join(f'`{n}`' for n in e.names())} |"
            for e in contract.CODE_LOADING_ENV]
    out.append("")
    return out


def names_and_pod_fields() -> list[str]:
    """The name limit (computed), the reserved environment variables and the checks of pass-through fields."""
    from kubetitan_core import k8sfields
    from kubetitan_core.api import LlamaPretrainSpec, ResourcesSpec
    from kubetitan_core.validation import ATTEMPT_DIGITS, max_name_length

    def limit(nodes: int) -> int:
        return max_name_length(LlamaPretrainSpec(resources=ResourcesSpec(nodes=nodes)))

    top = ResourcesSpec.model_fields["nodes"].metadata
    most = max(getattr(m, "le", 0) or 0 for m in top)
    bands, start = [], 1
    for nodes in range(1, most + 1):
        if nodes == most or limit(nodes + 1) != limit(nodes):
            bands.append((start, nodes, limit(nodes)))
            start = nodes + 1
    out = ["## Names and pod fields", "", _cell(
        "`metadata.name` names the run's headless Service, so it must be a DNS-1035 label (lower-case letters, "
        "digits and `-`, starting with a letter, ending with a letter or digit). Each pod's hostname is "
        "`<name>-a<attempt>-<rank>` and must be a DNS label of at most 63 characters, so the longest name is "
        f"63 - len(\"-a\") - {ATTEMPT_DIGITS} (attempt digits) - len(\"-\") - digits of the last rank "
        "(`resources.nodes - 1`):"), "", "| `resources.nodes` | Longest `metadata.name` |", "|---|---|"]
    out += [f"| {a}–{b} | {n} |" if a != b else f"| {a} | {n} |" for a, b, n in bands]
    out += ["", _cell(
        "Environment variables the operator or the launcher set and `spec.resources.env` may not set (rule "
        "`env.reserved`): names starting with " + ", ".join(f"`{p}`" for p in contract.RESERVED_ENV_PREFIXES)
        + ", and " + ", ".join(f"`{n}`" for n in contract.RESERVED_ENV_NAMES) + ". The operator's other defaults "
        "(`NCCL_DEBUG`, `FI_*`, `TORCH_NCCL_*`) are replaced by a spec variable of the same name. "
        f"`{contract.SECRET_ENV_TOKEN}` comes from `spec.tokenizer.tokenSecretRef` when that is set, and a spec "
        "variable of that name is then refused (`env.secret-backed`)."), "", _cell(
        "Fields copied into the pods are checked as the API server checks the pod fields they become, against "
        f"the Kubernetes {k8sfields.K8S_VERSION} OpenAPI schema (unknown fields such as `vaule` or `nodeAfinity` "
        "are errors): `resources.env` (EnvVar: name syntax, `value` xor one `valueFrom` source, Secret/ConfigMap "
        "names and keys), `resources.tolerations` (Toleration: operator, effect, key/value syntax), "
        "`resources.affinity` (Affinity: selector operators and values, weights, topology keys), "
        "`resources.nodeSelector` (label keys and values), `resources.image` (an image reference), and the "
        "names `resources.imagePullSecrets`, `resources.serviceAccountName`, `resources.priorityClassName`, "
        "`scheduling.schedulerName`, `tokenizer.tokenSecretRef.name` and `tokenizer.tokenSecretRef.key`, the claim names (DNS-1123 "
        "subdomains, Secret keys) and `scheduling.queueName` (a label value). Paths (`checkpoint.mountPath`, "
        "`data.mountPath`, `checkpoint.storage.hostPath`, `tokenizer.path`, `data.shards.path`) are absolute "
        f"without `..`; no mount may be at, above or inside another (`{contract.CONFIG_MOUNT}`, "
        f"`{contract.SHM_MOUNT}`, the checkpoint and data mounts). The builtin tokenizer has "
        f"{contract.BUILTIN_TOKENIZER_VOCAB} tokens: a custom model using it needs `vocabSize` ≥ "
        f"{contract.BUILTIN_TOKENIZER_VOCAB}."), ""]
    return out


def default_path() -> Path:
    """``docs/api.md`` of the source checkout."""
    return Path(__file__).resolve().parents[2] / "docs" / DOC_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetitan.apidoc", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write docs/{DOC_FILE} of this checkout")
    parser.add_argument("--output", type=Path, help="write to this file instead")
    args = parser.parse_args(argv)
    emit(render(), args.output or (default_path() if args.write else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
