"""The ``LlamaPretrain`` CustomResourceDefinition, generated from :mod:`kubetitan_core.api`.

``api.py`` is the one source of truth. This module turns the pydantic models into a
*structural* OpenAPI v3 schema the way controller-gen turns Go types into one:

- ``$ref`` and ``anyOf [X, null]`` are inlined to ``X``; no ``title``; every object has a type;
- every property keeps its docstring as ``description`` (what ``kubectl explain`` prints);
- enums from ``Literal``, bounds and patterns from ``Field``; ``exclusiveMinimum: N`` becomes
  OpenAPI v3's ``minimum: N`` + ``exclusiveMinimum: true``;
- defaults come from the models' fields: scalars and non-empty lists get their value,
  nested sections get ``default: {}`` so the API server's defaulting cascades into them
  (the result equals what pydantic fills in; ``tests/api/test_crd.py`` checks that);
- free-form Kubernetes types (tolerations, affinity, env items) keep unknown fields;
- cross-field rules are the CEL twins of :data:`kubetitan_core.validation.RULES` (the rule table), as
  ``x-kubernetes-validations`` on ``spec``.

Run ``python -m kubetitan_core.crd --write`` after changing ``api.py`` or the CEL rules; a test
fails when ``crds/`` drifts from this generator.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from kubetitan_core import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from kubetitan_core.api import LlamaPretrain, model_in

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{GROUP}_{PLURAL}.yaml"
CATEGORIES = ["kubetitan"]
GENERATE_COMMAND = "python -m kubetitan_core.crd --write"

# ValidationRule.reason and .fieldPath exist from Kubernetes 1.28 on; a 1.27 API server
# (and kubectl's strict field validation) rejects them as unknown fields.
_RULE_FIELD_PATH_SINCE = (1, 28)

# Keys of JSON Schema that are not part of a structural schema, or that we set ourselves.
_DROP_KEYS = {
    "title", "default", "additionalProperties", "$defs", "const", "exclusiveMinimum", "exclusiveMaximum",
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase",
     "description": "Summary of the conditions."},
    {"name": "Progress", "type": "string", "jsonPath": ".status.training.progress",
     "description": "Completed steps / total steps."},
    {"name": "Loss", "type": "number", "jsonPath": ".status.training.loss",
     "description": "Training loss at the last scraped step."},
    {"name": "Tok/s", "type": "number", "jsonPath": ".status.training.tokensPerSecond",
     "description": "Throughput over all GPUs, tokens per second."},
    {"name": "MFU", "type": "number", "jsonPath": ".status.training.mfu",
     "description": "Model FLOPs utilisation, ratio 0-1."},
    {"name": "Ckpt", "type": "integer", "jsonPath": ".status.training.lastCheckpointStep",
     "description": "Step of the newest complete checkpoint."},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restartCount",
     "description": "Gang restarts so far."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # After the fixed default columns (DESIGN.md): `kubectl get lpt -o wide` shows it.
    {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodes", "priority": 1,
     "description": "Nodes of the current attempt's gang (runPolicy.elastic shrinks and grows it)."},
    {"name": "Attempt", "type": "integer", "jsonPath": ".status.attempt", "priority": 1,
     "description": "Current attempt number."},
    # A string, not a date: kubectl prints future dates as "<invalid>".
    {"name": "ETA", "type": "string", "jsonPath": ".status.training.eta", "priority": 1,
     "description": "Estimated completion time."},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1,
     "description": "Summary of the current state."},
]


# ------------------------------------------------------------------ schema conversion
def _description(text: str) -> str:
    """Docstring -> one-paragraph-per-block text (docstrings wrap lines at ~90 columns)."""
    paragraphs = re.split(r"\n\s*\n", text.strip().replace("``", "`"))
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def _structural(node: dict[str, Any], defs: dict[str, Any], where: str) -> dict[str, Any]:
    """One pydantic JSON-schema node -> a structural OpenAPI v3 schema node (no defaults)."""
    description = node.get("description")
    # Inline $ref, and reduce `anyOf [X, null]` / `allOf [X]` to X; the outermost description wins.
    node = dict(node)
    while True:
        if "$ref" in node:
            target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
            node = {**target, **node}
            continue
        key = next((k for k in ("anyOf", "allOf", "oneOf") if k in node), None)
        if key is None:
            break
        options = [o for o in node.pop(key) if o != {"type": "null"}]
        if len(options) != 1:
            raise ValueError(f"{where}: {key} with {len(options)} non-null options is not "
                             "structural; use a single type in kubetitan_core/api.py")
        node = {**options[0], **node}
    if description is None:
        description = node.get("description")

    # Deep copies: shared lists would come out of yaml.safe_dump as &anchors.
    out: dict[str, Any] = {k: copy.deepcopy(v) for k, v in node.items() if k not in _DROP_KEYS}
    if description:
        out["description"] = _description(description)
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMinimum" in node:
        out["minimum"] = node["exclusiveMinimum"]
        out["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node:
        out["maximum"] = node["exclusiveMaximum"]
        out["exclusiveMaximum"] = True

    kind = out.get("type")
    if kind is None:
        raise ValueError(f"{where}: no type; every node of a structural schema needs one")
    if kind == "object":
        if "properties" in out:
            out["properties"] = {
                name: _structural(prop, defs, f"{where}.{name}")
                for name, prop in out["properties"].items()
            }
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra:  # a map with typed values
            out["additionalProperties"] = _structural(extra, defs, f"{where}[*]")
        elif extra is True or (isinstance(extra, dict) and not extra) or (
            "properties" not in out and extra is None
        ):  # dict[str, Any]: a free-form Kubernetes object (Toleration, Affinity, EnvVar)
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["items"] = _structural(out["items"], defs, f"{where}[]")
    return out


_KEY_ORDER = ["description", "type"]
_KEY_LAST = ["required", "properties", "additionalProperties", "items"]


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Readable key order, recursively: description and type first, children last.

    Properties keep the order of the model's fields.
    """
    first = [k for k in _KEY_ORDER if k in node]
    last = [k for k in _KEY_LAST if k in node]
    middle = sorted(k for k in node if k not in first and k not in last)
    out = {k: node[k] for k in first + middle + last}
    if "properties" in out:
        out["properties"] = {k: _ordered(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _ordered(out[key])
    return out


def _apply_defaults(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Put each field's default on its schema node, the way the API server should apply it.

    Sections (a nested model defaulted to ``Model()``) get ``{}``, and the server then
    defaults the section's own fields; ``None`` and empty lists/maps get no default (absent
    and empty mean the same to pydantic).
    """
    for name, field in model.model_fields.items():
        alias = field.alias or name
        prop = schema["properties"][alias]
        sub = model_in(field.annotation)
        if not field.is_required():
            value = field.get_default(call_default_factory=True)
            if isinstance(value, BaseModel):
                if value != type(value)():
                    raise ValueError(f"{model.__name__}.{name}: a section default must be "
                                     f"the section's own defaults, got {value!r}")
                prop["default"] = {}
            elif value is not None and value != [] and value != {}:
                prop["default"] = copy.deepcopy(value)
        if sub is not None:
            _apply_defaults(prop["items"] if prop["type"] == "array" else prop, sub)


def _section_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)
    schema = _structural(raw, raw.get("$defs", {}), model.__name__)
    _apply_defaults(schema, model)
    return schema


def _major_minor(version: str) -> tuple[int, int]:
    m = re.match(r"^v?(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"Kubernetes version {version!r} is not MAJOR.MINOR, e.g. 1.35")
    return int(m.group(1)), int(m.group(2))


def cel_validations(rules: Iterable[Any], kubernetes_version: str | None = None) -> list[dict[str, Any]]:
    """``x-kubernetes-validations`` entries for ``spec`` from rule objects.

    Each rule has ``.rule`` (CEL, ``self`` = the spec), ``.message`` and ``.field_path``
    (relative to ``spec``, e.g. ``.parallelism.dataParallelShardDegree``). Kubernetes
    before 1.28 knows neither ``fieldPath`` nor ``reason``; they are left out for it.
    """
    with_path = kubernetes_version is None or _major_minor(kubernetes_version) >= _RULE_FIELD_PATH_SINCE
    out = []
    for r in rules:
        entry: dict[str, Any] = {"rule": r.rule, "message": r.message}
        if with_path:
            if getattr(r, "field_path", None):
                entry["fieldPath"] = r.field_path
            entry["reason"] = "FieldValueInvalid"
        out.append(entry)
    return out


def _default_rules() -> Sequence[Any]:
    """The CEL twins of the rule table's entries, in table order (read at each call: the table is the source)."""
    from kubetitan_core import validation  # imported late: validation imports the catalog

    return [r.cel_rule for r in validation.RULES if r.cel_rule is not None]


def openapi_schema(rules: Iterable[Any] | None = None, kubernetes_version: str | None = None) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the LlamaPretrain resource."""
    root = _section_schema(LlamaPretrain)
    props = root["properties"]
    # The API server owns these three: only `type` (and, but for metadata, a description) may be said about them.
    props["apiVersion"] = {
        "type": "string",
        "description": "APIVersion defines the versioned schema of this representation of an object; "
        f"`{GROUP}/{VERSION}` for this resource.",
    }
    props["kind"] = {"type": "string", "description": f"Kind is the REST resource type; `{KIND}`."}
    # Only `type: object`: a real API server refuses anything more about metadata in a CRD, a description
    # included ("must not specify anything other than name and generateName").
    props["metadata"] = {"type": "object"}
    validations = cel_validations(_default_rules() if rules is None else rules, kubernetes_version)
    if validations:
        props["spec"]["x-kubernetes-validations"] = validations
        # No `default: {}` on spec itself: a real API server evaluates the CEL rules on a default value as written,
        # without the nested defaults, and refuses the CRD ("no such key: parallelism"). `spec: {}` as sent is
        # still defaulted section by section before the rules run; a run without spec is checked by the webhook.
        props["spec"].pop("default", None)
    conditions = props["status"]["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    # kopf's own bookkeeping (handler progress, the last handled spec): kept in status, never in annotations, so a
    # run whose annotations fill the API's 256 KiB limit is still reconciled and deleted. Not part of the API.
    props["status"]["properties"]["kopf"] = {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "description": "Bookkeeping of the operator's framework (kopf); written by the operator, not for users.",
    }
    return _ordered(root)


def crd(rules: Iterable[Any] | None = None, kubernetes_version: str | None = None) -> dict[str, Any]:
    """The apiextensions.k8s.io/v1 CustomResourceDefinition of LlamaPretrain.

    ``rules`` defaults to the CEL twins in :data:`kubetitan_core.validation.RULES`. ``kubernetes_version``
    (e.g. ``"1.27"``) leaves out fields that version does not know; unset targets 1.28+.
    """
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "annotations": {"kubetitan.io/generated-by": GENERATE_COMMAND},
            "labels": {"app.kubernetes.io/part-of": "kubetitan"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": list(CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                    "schema": {"openAPIV3Schema": openapi_schema(rules, kubernetes_version)},
                }
            ],
        },
    }


def apply_schema_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Default ``value`` the way the API server defaults a custom resource with ``schema``.

    A copy of apiextensions' structural defaulting: for each object, absent (or null)
    properties with a ``default`` get a copy of it, then every property is defaulted
    recursively, so ``default: {}`` on a section cascades into the section's own fields.
    Lets tests (and ``kubetitan``) see what the cluster stores without a cluster.
    """
    value = copy.deepcopy(value)
    _default_in_place(value, schema)
    return value


def _default_in_place(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, prop in props.items():
            if value.get(name) is None and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
        for name, item in value.items():
            if name in props:
                _default_in_place(item, props[name])
            elif isinstance(schema.get("additionalProperties"), dict):
                _default_in_place(item, schema["additionalProperties"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default_in_place(item, schema["items"])


def crd_yaml(rules: Iterable[Any] | None = None, kubernetes_version: str | None = None) -> str:
    """The CRD as YAML, exactly as committed under ``crds/`` (and as ``kubetitan crd`` prints)."""
    return yaml.safe_dump(crd(rules, kubernetes_version), sort_keys=False)


def default_path() -> Path:
    """``crds/kubetitan.io_llamapretrains.yaml`` of the source checkout (this file is operator/core/kubetitan_core/crd.py)."""
    return Path(__file__).resolve().parents[3] / "crds" / CRD_FILE


def emit(text: str, target: Path | None) -> None:
    """Print ``text``, or write it to ``target`` (the generators' shared ``--write``/``--output``)."""
    if target is None:
        sys.stdout.write(text)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"Wrote {target}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetitan_core.crd", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write crds/{CRD_FILE} of this checkout")
    parser.add_argument("--output", type=Path, help="write to this file instead")
    parser.add_argument("--kubernetes-version", help="target an older API server, e.g. 1.27 (drops "
                        "the CEL rules' fieldPath and reason, which 1.27 rejects)")
    args = parser.parse_args(argv)
    emit(crd_yaml(kubernetes_version=args.kubernetes_version), args.output or (default_path() if args.write else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
