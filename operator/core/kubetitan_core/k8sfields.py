"""Checks of the spec fields that the operator passes through into its pods, as the API server checks them.

``spec.resources.env``, ``tolerations``, ``affinity`` and friends are copied into every trainer pod. A typo
(``vaule``, ``nodeAfinity``) or a malformed value would be accepted by the CRD (these fields preserve unknown
fields) and refused only when the operator creates the pod, long after ``kubectl apply`` said yes. Here they
are checked up front against the same Kubernetes OpenAPI schema (:data:`K8S_VERSION`, the strict variant
shipped by kubernetes-validate: unknown fields are errors) and the name/label syntax rules the API server
applies to the pod fields they become.

Pure: no kopf, no client, no torch. Every error is ``(path, message)`` with the fix in the message.
"""

from __future__ import annotations

import functools
import re
from typing import Any

K8S_VERSION = "1.32.0"
"""Kubernetes version whose OpenAPI schemas the pass-through fields are checked against."""

_DEFS_FILE = f"kubernetes-json-schema/v{K8S_VERSION}-local-strict/_definitions.json"

ENV_VAR = "io.k8s.api.core.v1.EnvVar"
TOLERATION = "io.k8s.api.core.v1.Toleration"
AFFINITY = "io.k8s.api.core.v1.Affinity"


@functools.lru_cache(maxsize=1)
def _definitions() -> dict[str, Any]:
    import kubernetes_validate.utils as kv

    return kv.schema_contents(_DEFS_FILE, K8S_VERSION)


@functools.lru_cache(maxsize=None)
def _validator(definition: str) -> Any:
    import jsonschema

    defs = _definitions()
    schema = {"$schema": defs["$schema"], "$defs": defs["$defs"], "$ref": f"#/$defs/{definition}"}
    return jsonschema.validators.Draft202012Validator(schema)


def _join(base: str, parts: Any) -> str:
    out = base
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def schema_errors(definition: str, value: Any, path: str) -> list[tuple[str, str]]:
    """Errors of ``value`` against the Kubernetes OpenAPI definition ``definition`` (e.g. :data:`ENV_VAR`)."""
    short = definition.rsplit(".", 1)[-1]
    out: list[tuple[str, str]] = []
    for e in sorted(_validator(definition).iter_errors(value), key=lambda e: list(map(str, e.absolute_path))):
        where = _join(path, e.absolute_path)
        if e.validator == "additionalProperties":
            for extra in sorted(set(value_keys(e.instance)) - set(e.schema.get("properties", {}))):
                known = ", ".join(sorted(e.schema.get("properties", {})))
                out.append((f"{where}.{extra}", f"unknown field of a Kubernetes {_kind_at(e, short)}; "
                            f"check the spelling and use one of its fields: {known}"))
        elif e.validator == "required":
            missing = re.findall(r"'([^']+)'", e.message)
            out.append((where, f"add the required field {missing[0] if missing else e.message!r} of a Kubernetes "
                        f"{_kind_at(e, short)}"))
        elif e.validator == "type":
            out.append((where, f"must be of type {e.validator_value} (got {_show(e.instance)}); change the value"))
        else:
            out.append((where, f"{e.message}; change the value"))
    return out


def value_keys(x: Any) -> list[str]:
    return [str(k) for k in x] if isinstance(x, dict) else []


def _kind_at(e: Any, fallback: str) -> str:
    """The definition the failing part of the value has to match, e.g. EnvVarSource, by its schema's identity."""
    defs = _definitions()["$defs"]
    for name, d in defs.items():
        if d is e.schema:
            return name.rsplit(".", 1)[-1]
    return fallback if not e.relative_path else "object"


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------- names
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
"""Environment variable names the API server accepts (kube-apiserver's IsEnvVarName)."""
CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
"""Secret/ConfigMap keys (IsConfigMapKey), at most 253 characters."""
# The image reference grammar of the distribution project: [domain[:port]/]path[:tag][@digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
IMAGE_REFERENCE = re.compile(
    rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{{32,}})?$"
)


def subdomain_error(value: str, what: str) -> str | None:
    """Why ``value`` cannot be a DNS-1123 subdomain name (Secret, ServiceAccount, PriorityClass, ...), or None."""
    if len(value) > 253:
        return f"{value!r} is {len(value)} characters; a {what} name has at most 253"
    if not DNS1123_SUBDOMAIN.match(value):
        return (f"{value!r} is not a valid {what} name: use lower-case letters, digits, '-' and '.', starting and "
                "ending with a letter or digit (a DNS-1123 subdomain, e.g. 'my-name')")
    return None


def label_value_error(value: str) -> str | None:
    if len(value) > 63 or not LABEL_VALUE.match(value):
        return (f"{value!r} is not a valid label value: at most 63 characters of letters, digits, '-', '_' and '.', "
                "starting and ending with a letter or digit (or empty); change the value")
    return None


def label_key_error(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
        return f"{key!r}: the prefix before '/' must be a DNS-1123 subdomain such as 'example.com'"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return (f"{key!r} is not a valid label key: the name part has at most 63 letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit, optionally after a 'prefix/' (e.g. 'node.example.com/pool'); "
                "change the key")
    return None


def image_error(image: str) -> str | None:
    digest = image.partition("@")[2]
    if digest.startswith("sha256:") and not re.fullmatch(r"sha256:[a-f0-9]{64}", digest):
        return (f"{image!r}: a sha256 digest is 64 lower-case hex characters (the kubelet refuses others); copy the "
                "digest exactly, e.g. from `docker buildx imagetools inspect`")
    if image != image.strip() or not IMAGE_REFERENCE.match(image):
        return (f"{image!r} is not a container image reference; use [registry[:port]/]name[:tag][@sha256:digest] "
                "with a lower-case name and no spaces, e.g. 'ghcr.io/org/kubetitan-trainer:0.1.0'")
    return None


# ---------------------------------------------------------------------------------------------- objects
_TOLERATION_OPERATORS = ("Exists", "Equal")
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
_LABEL_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def _plain_env_var(item: Any) -> bool:
    """Whether ``item`` has the shape nearly every env var has, which the EnvVar schema accepts as it stands: a
    string ``name``, a string (or null) ``value``, and a ``valueFrom`` (or null) holding only ``secretKeyRef`` or
    ``configMapKeyRef`` selectors of a string ``key``, a string (or null) ``name`` and a boolean (or null)
    ``optional``, with no other field anywhere. The schema check (jsonschema, ~0.2 ms an item: a spec with 5,000 env
    vars cost the webhook ~1 CPU s) is then skipped; any other shape goes through it. The EnvVar, EnvVarSource and
    KeySelector definitions this mirrors are those of :data:`K8S_VERSION` (tests/api/test_k8sfields.py compares
    the two over generated items)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item.keys() <= _ENV_VAR_FIELDS:
        return False
    if not isinstance(item.get("value"), (str, type(None))):
        return False
    source = item.get("valueFrom")
    if source is None:
        return True
    if not isinstance(source, dict) or not source.keys() <= _KEY_REF_SOURCES:
        return False
    for ref in source.values():
        if ref is None:
            continue
        if not isinstance(ref, dict) or not ref.keys() <= _KEY_SELECTOR_FIELDS or not isinstance(ref.get("key"), str):
            return False
        if not isinstance(ref.get("name"), (str, type(None))) or not isinstance(ref.get("optional"), (bool, type(None))):
            return False
    return True


_ENV_VAR_FIELDS = frozenset({"name", "value", "valueFrom"})
_KEY_REF_SOURCES = frozenset({"secretKeyRef", "configMapKeyRef"})
_KEY_SELECTOR_FIELDS = frozenset({"key", "name", "optional"})


def env_errors(env: list[Any], path: str) -> list[tuple[str, str]]:
    """``spec.resources.env``: each item a Kubernetes EnvVar with a valid name, value xor one valueFrom source."""
    out: list[tuple[str, str]] = []
    for i, item in enumerate(env):
        where = f"{path}[{i}]"
        errs = [] if _plain_env_var(item) else schema_errors(ENV_VAR, item, where)
        out += errs
        if errs or not isinstance(item, dict):
            continue
        name = item["name"]
        if not ENV_NAME.match(name):
            out.append((f"{where}.name", f"{name!r} is not a valid environment variable name: use letters, digits, "
                        "'_', '-' and '.', not starting with a digit"))
        vf = item.get("valueFrom")
        if vf is not None:
            if item.get("value"):
                out.append((f"{where}.valueFrom", "may not be set together with value; keep one of them"))
            sources = [k for k in ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef") if vf.get(k)]
            if len(sources) != 1:
                out.append((f"{where}.valueFrom", "must name exactly one of fieldRef, resourceFieldRef, "
                            f"configMapKeyRef, secretKeyRef (got {len(sources)})"))
            out += _env_source_errors(vf, f"{where}.valueFrom")
            for k in ("configMapKeyRef", "secretKeyRef"):
                ref = vf.get(k)
                if isinstance(ref, dict):
                    kind = "Secret" if k == "secretKeyRef" else "ConfigMap"
                    if (msg := subdomain_error(ref.get("name") or "", kind)) is not None:  # (null: the schema allows it)
                        out.append((f"{where}.valueFrom.{k}.name", msg))
                    if (msg := key_error(ref["key"], kind)) is not None:
                        out.append((f"{where}.valueFrom.{k}.key", msg))
    return out


ENV_FIELD_PATHS = ("metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName", "spec.serviceAccountName",
                   "status.hostIP", "status.hostIPs", "status.podIP", "status.podIPs")
"""Pod fields an env var's fieldRef may read (the API server's validEnvDownwardAPIFieldPathExpressions), besides
``metadata.labels['KEY']`` and ``metadata.annotations['KEY']``."""
ENV_RESOURCES = ("limits.cpu", "limits.memory", "limits.ephemeral-storage", "requests.cpu", "requests.memory",
                 "requests.ephemeral-storage")
"""Container resources an env var's resourceFieldRef may read (besides ``limits|requests.hugepages-<size>``)."""
_SUBSCRIPTED = re.compile(r"^(metadata\.labels|metadata\.annotations)\['(.+)'\]$")


def _env_source_errors(vf: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """fieldRef and resourceFieldRef: only the paths and resources the API server serves to env vars."""
    out: list[tuple[str, str]] = []
    fr = vf.get("fieldRef")
    if isinstance(fr, dict):
        fp = fr.get("fieldPath", "")
        sub = _SUBSCRIPTED.match(fp)
        if sub is not None:
            if (msg := label_key_error(sub.group(2))) is not None:
                out.append((f"{where}.fieldRef.fieldPath", msg))
        elif fp not in ENV_FIELD_PATHS:
            out.append((f"{where}.fieldRef.fieldPath", f"{fp!r} cannot be read into an environment variable; use one "
                        f"of {', '.join(ENV_FIELD_PATHS)}, metadata.labels['KEY'] or metadata.annotations['KEY']"))
        if fr.get("apiVersion") not in (None, "", "v1"):
            out.append((f"{where}.fieldRef.apiVersion", f"{fr['apiVersion']!r} is not supported; use v1 or leave it unset"))
    rf = vf.get("resourceFieldRef")
    if isinstance(rf, dict):
        res = rf.get("resource", "")
        if res not in ENV_RESOURCES and not res.startswith(("limits.hugepages-", "requests.hugepages-")):
            out.append((f"{where}.resourceFieldRef.resource", f"{res!r} cannot be read into an environment variable; "
                        f"use one of {', '.join(ENV_RESOURCES)} or limits.hugepages-<size>"))
    return out


def key_error(key: str, kind: str = "Secret") -> str | None:
    if len(key) > 253 or not CONFIG_KEY.match(key) or key in (".", ".."):
        return (f"{key!r} is not a valid {kind} key: use letters, digits, '-', '_' and '.' (at most 253 characters), "
                "e.g. 'token'")
    return None


def toleration_errors(tolerations: list[Any], path: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for i, t in enumerate(tolerations):
        where = f"{path}[{i}]"
        errs = schema_errors(TOLERATION, t, where)
        out += errs
        if errs:
            continue
        op = t.get("operator", "Equal") or "Equal"
        key, effect = t.get("key", ""), t.get("effect", "")
        if key and (msg := label_key_error(key)) is not None:
            out.append((f"{where}.key", msg))
        if op not in _TOLERATION_OPERATORS:
            out.append((f"{where}.operator", f"{op!r} is not supported: use Exists or Equal"))
        elif op == "Exists" and t.get("value"):
            out.append((f"{where}.value", "must be empty when operator is Exists; remove it or use operator Equal"))
        elif op == "Equal" and not key:
            out.append((f"{where}.operator", "must be Exists when key is empty (a toleration of every taint)"))
        elif op == "Equal" and (msg := label_value_error(t.get("value", ""))) is not None:
            out.append((f"{where}.value", msg))
        if effect and effect not in _TAINT_EFFECTS:
            out.append((f"{where}.effect", f"{effect!r} is not supported: use NoSchedule, PreferNoSchedule or NoExecute"))
        if t.get("tolerationSeconds") is not None and effect != "NoExecute":
            out.append((f"{where}.effect", "must be NoExecute when tolerationSeconds is set"))
    return out


def _selector_requirement_errors(req: dict[str, Any], where: str, operators: tuple[str, ...]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    op, values = req.get("operator"), req.get("values") or []
    if (msg := label_key_error(req.get("key", ""))) is not None:
        out.append((f"{where}.key", msg))
    if op not in operators:
        out.append((f"{where}.operator", f"{op!r} is not supported: use one of {', '.join(operators)}"))
    elif op in ("In", "NotIn") and not values:
        out.append((f"{where}.values", f"must be non-empty when operator is {op}"))
    elif op in ("Exists", "DoesNotExist") and values:
        out.append((f"{where}.values", f"must be empty when operator is {op}"))
    elif op in ("Gt", "Lt") and (len(values) != 1 or not re.fullmatch(r"-?[0-9]+", str(values[0]))):
        out.append((f"{where}.values", f"must be a single integer when operator is {op}"))
    if op in ("In", "NotIn"):
        for j, v in enumerate(values):
            if (msg := label_value_error(v)) is not None:
                out.append((f"{where}.values[{j}]", msg))
    return out


def affinity_errors(affinity: Any, path: str) -> list[tuple[str, str]]:
    errs = schema_errors(AFFINITY, affinity, path)
    if errs:
        return errs
    out: list[tuple[str, str]] = []
    node = affinity.get("nodeAffinity") or {}
    req = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    terms: list[tuple[str, dict[str, Any]]] = []
    if req is not None and not req.get("nodeSelectorTerms"):
        out.append((f"{path}.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
                    "must have at least one node selector term; add one or remove requiredDuringScheduling..."))
    if req is not None:
        terms += [(f"{path}.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{i}]", t)
                  for i, t in enumerate(req.get("nodeSelectorTerms", []))]
    for i, p in enumerate(node.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
        w = p.get("weight", 0)
        if not 1 <= w <= 100:
            out.append((f"{path}.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[{i}].weight",
                        f"{w} is out of range: use 1..100"))
        terms.append((f"{path}.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[{i}].preference",
                      p.get("preference", {})))
    for where, term in terms:
        for j, r in enumerate(term.get("matchExpressions") or []):
            out += _selector_requirement_errors(r, f"{where}.matchExpressions[{j}]", _SELECTOR_OPERATORS)
        for j, r in enumerate(term.get("matchFields") or []):  # a node field selector: metadata.name only
            at = f"{where}.matchFields[{j}]"
            if r.get("key") != "metadata.name":
                out.append((f"{at}.key", f"{r.get('key')!r} is not supported: matchFields can only select "
                            "metadata.name; use matchExpressions for node labels"))
            if r.get("operator") not in ("In", "NotIn"):
                out.append((f"{at}.operator", f"{r.get('operator')!r} is not supported here: use In or NotIn"))
            elif len(r.get("values") or []) != 1:
                out.append((f"{at}.values", f"must hold exactly one node name with operator {r['operator']}"))
    for kind in ("podAffinity", "podAntiAffinity"):
        pa = affinity.get(kind) or {}
        items = [(f"{path}.{kind}.requiredDuringSchedulingIgnoredDuringExecution[{i}]", t)
                 for i, t in enumerate(pa.get("requiredDuringSchedulingIgnoredDuringExecution") or [])]
        for i, w in enumerate(pa.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
            base = f"{path}.{kind}.preferredDuringSchedulingIgnoredDuringExecution[{i}]"
            if not 1 <= w.get("weight", 0) <= 100:
                out.append((f"{base}.weight", f"{w.get('weight')} is out of range: use 1..100"))
            items.append((f"{base}.podAffinityTerm", w.get("podAffinityTerm", {})))
        for where, term in items:
            if not term.get("topologyKey"):
                out.append((f"{where}.topologyKey", "is required: e.g. kubernetes.io/hostname"))
            elif (msg := label_key_error(term["topologyKey"])) is not None:
                out.append((f"{where}.topologyKey", msg))
            sel = term.get("labelSelector") or {}
            for k, v in (sel.get("matchLabels") or {}).items():
                if (msg := label_key_error(k) or label_value_error(v)) is not None:
                    out.append((f"{where}.labelSelector.matchLabels", msg))
            for j, r in enumerate(sel.get("matchExpressions") or []):
                out += _selector_requirement_errors(r, f"{where}.labelSelector.matchExpressions[{j}]",
                                                    _LABEL_SELECTOR_OPERATORS)
    return out


def node_selector_errors(selector: dict[str, str], path: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for k, v in selector.items():
        if (msg := label_key_error(k)) is not None:
            out.append((f"{path}[{k}]", msg))
        elif (msg := label_value_error(v)) is not None:
            out.append((f"{path}[{k}]", msg))
    return out
