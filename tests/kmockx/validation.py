"""What kmockx refuses at create/update, worded as kube-apiserver words it (a test tool, not product code).

- ``StructuralSchema``: a CRD version's ``openAPIV3Schema`` applied as apiextensions-apiserver does:
  defaults, pruning of unknown fields (unless ``x-kubernetes-preserve-unknown-fields``), then types, enums,
  bounds, lengths, patterns, required, and the CEL rules of ``x-kubernetes-validations`` (cel-python) with
  their ``message``/``messageExpression``, ``fieldPath`` and ``reason``.
- ``builtin_errors``: pods/services/configmaps/... against the Kubernetes OpenAPI schema of
  :data:`K8S_VERSION` shipped by kubernetes-validate (strict: unknown fields are errors), compiled once per kind.
- ``meta_errors``: object names (DNS-1123 subdomain / label, DNS-1035 for Services), label keys/values,
  total annotation size.
Each error is a ``Cause`` (field, reason, message); ``invalid_status`` renders the 422 ``Status``.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

K8S_VERSION = "1.32.0"
"""The Kubernetes version whose OpenAPI schemas built-in objects are checked against (matches kubectl 1.32)."""


@dataclass(frozen=True)
class Cause:
    field: str
    reason: str  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, FieldValueTooLong, ...
    message: str  # without the field, e.g. 'Invalid value: 0: ... should be greater than or equal to 1'

    def render(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


def _fmt(v: Any) -> str:
    """A value as the API server prints it in an error (Go's %#v-ish: strings quoted, objects by type)."""
    if isinstance(v, dict):
        return '"object"'
    if isinstance(v, list):
        return '"array"' if v else "[]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def invalid(path: str, value: Any, detail: str) -> Cause:
    return Cause(path, "FieldValueInvalid", f"Invalid value: {_fmt(value)}: {detail}")


def required(path: str, detail: str = "") -> Cause:
    return Cause(path, "FieldValueRequired", "Required value" + (f": {detail}" if detail else ""))


def invalid_status(kind_group: str, name: str, causes: list[Cause], group: str, kind: str) -> dict[str, Any]:
    """The 422 Status body (``Kind.group "name" is invalid: ...``) the API server answers."""
    rendered = [c.render() for c in causes]
    what = rendered[0] if len(rendered) == 1 else "[" + ", ".join(rendered) + "]"
    return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": 422,
            "reason": "Invalid", "message": f'{kind_group} "{name}" is invalid: {what}',
            "details": {"name": name, "group": group, "kind": kind,
                        "causes": [{"reason": c.reason, "message": c.message, "field": c.field} for c in causes]}}


# ---------------------------------------------------------------------------------------------- names
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUB = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SUB_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
            "must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
            "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
              "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
              "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
_1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
             "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
             "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
NAME_RULES = {  # plural -> (regex, max length, message)
    "services": (_DNS1035, 63, _1035_MSG),
    "namespaces": (_DNS1123_LABEL, 63, _LABEL_MSG),
}
TOTAL_ANNOTATION_BYTES = 256 * 1024


def name_errors(plural: str, name: str | None) -> list[Cause]:
    if not name:
        return [required("metadata.name", "name or generateName is required")]
    regex, limit, msg = NAME_RULES.get(plural, (_DNS1123_SUB, 253, _SUB_MSG))
    out = []
    if len(name) > limit:
        out.append(invalid("metadata.name", name, f"must be no more than {limit} characters"))
    if not regex.match(name):
        out.append(invalid("metadata.name", name, msg))
    return out


def _label_key_errors(path: str, key: str) -> list[Cause]:
    prefix, _, name = key.rpartition("/")
    out = []
    if prefix and (len(prefix) > 253 or not _DNS1123_SUB.match(prefix)):
        out.append(invalid(path, key, "prefix part " + _SUB_MSG))
    if not name or len(name) > 63 or not _QUALIFIED.match(name):
        out.append(invalid(path, key, "name part must consist of alphanumeric characters, '-', '_' or '.', and "
                           "must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or "
                           "'123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') "
                           "and must be no more than 63 characters"))
    return out


def meta_errors(plural: str, meta: dict[str, Any]) -> list[Cause]:
    out = name_errors(plural, meta.get("name"))
    for k, v in (meta.get("labels") or {}).items():
        out += _label_key_errors("metadata.labels", k)
        if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.match(v):
            out.append(invalid("metadata.labels", v, "a valid label must be an empty string or consist of "
                               "alphanumeric characters, '-', '_' or '.', and must start and end with an "
                               "alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used "
                               "for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?') and must be no "
                               "more than 63 characters"))
    annotations = meta.get("annotations") or {}
    for k in annotations:
        out += _label_key_errors("metadata.annotations", k)
    # bytes, as the API server's ValidateAnnotationsSize counts them (Go's len of a string): not characters
    size = sum(len(k.encode()) + len(str(v).encode()) for k, v in annotations.items())
    if size > TOTAL_ANNOTATION_BYTES:
        out.append(Cause("metadata.annotations", "FieldValueTooLong",
                         f"Too long: may not be more than {TOTAL_ANNOTATION_BYTES} bytes"))
    return out


# ---------------------------------------------------------------------------------------------- built-ins
@functools.lru_cache(maxsize=None)
def _builtin_validator(kind: str, api_version: str) -> Any:
    """A compiled jsonschema validator for one built-in kind (kubernetes-validate's strict schemas), cached."""
    import jsonschema
    import kubernetes_validate.utils as kv
    from referencing import Registry, Resource

    group, _, version = api_version.rpartition("/")
    group = group.split(".")[0] if group else ""
    base = f"kubernetes-json-schema/v{K8S_VERSION}-local-strict/"
    suffix = f"{kind.lower()}-{group + '-' if group else ''}{version}.json"
    schema = kv.schema_contents(base + suffix, K8S_VERSION)
    defs = kv.schema_contents(base + "_definitions.json", K8S_VERSION)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    registry = registry.with_resource("_definitions.json", Resource.from_contents(defs))
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def _jpath(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def builtin_errors(obj: dict[str, Any]) -> tuple[list[Cause], list[str]]:
    """(422 causes, unknown fields) of a built-in object against its OpenAPI schema."""
    try:
        validator = _builtin_validator(obj.get("kind", ""), obj.get("apiVersion", ""))
    except Exception:  # noqa: BLE001 - a kind kubernetes-validate has no schema for is not checked
        return [], []
    causes, unknown = [], []
    for e in validator.iter_errors(obj):
        path = _jpath(e.absolute_path)
        if e.validator == "additionalProperties":
            extra = re.findall(r"'([^']+)'", e.message.split("(")[-1])
            unknown += [f"{path}.{x}" if path else x for x in extra]
        elif e.validator == "required":
            name = re.findall(r"'([^']+)'", e.message)
            causes.append(required(f"{path}.{name[0]}" if path and name else (name[0] if name else path)))
        elif e.validator == "enum":
            supported = ", ".join(json.dumps(x) for x in e.validator_value if x is not None)
            causes.append(Cause(path, "FieldValueNotSupported",
                                f"Unsupported value: {_fmt(e.instance)}: supported values: {supported}"))
        else:
            causes.append(invalid(path, e.instance, e.message))
    return causes, unknown


# ---------------------------------------------------------------------------------------------- CRD schemas
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def _is_type(value: Any, type_: str) -> bool:
    if type_ == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if type_ == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES.get(type_, object))


_MISSING = object()


def _lookup(obj: Any, field: str) -> Any:
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", field):
        if part.startswith("["):
            i = int(part[1:-1])
            obj = obj[i] if isinstance(obj, list) and i < len(obj) else _MISSING
        else:
            obj = obj.get(part, _MISSING) if isinstance(obj, dict) else _MISSING
        if obj is _MISSING:
            return _MISSING
    return obj


class StructuralSchema:
    """One CRD version's structural schema: ``apply(obj, old)`` defaults + prunes in place, returns causes."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self._cel: dict[str, Any] = {}

    # -- defaulting and pruning (apiextensions: defaults from the schema, then unknown fields dropped)
    def default_and_prune(self, value: Any, schema: dict[str, Any], path: str, pruned: list[str]) -> Any:
        if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
            return value
        if isinstance(value, dict) and (schema.get("type") == "object" or "properties" in schema):
            props = schema.get("properties")
            addl = schema.get("additionalProperties")
            for k, sub in (props or {}).items():
                if k not in value and "default" in sub:
                    value[k] = copy.deepcopy(sub["default"])
            for k in list(value):
                sub_path = f"{path}.{k}" if path else k
                if props is not None and k in props:
                    value[k] = self.default_and_prune(value[k], props[k], sub_path, pruned)
                elif isinstance(addl, dict):
                    value[k] = self.default_and_prune(value[k], addl, sub_path, pruned)
                elif addl is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                    continue
                elif path in ("", "metadata") and not path and k in ("apiVersion", "kind", "metadata"):
                    continue
                else:
                    pruned.append(sub_path)
                    del value[k]
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            value = [self.default_and_prune(v, schema["items"], f"{path}[{i}]", pruned) for i, v in enumerate(value)]
        return value

    # -- validation (the OpenAPI value checks, then CEL)
    def validate(self, value: Any, schema: dict[str, Any], path: str, old: Any, out: list[Cause]) -> None:
        if value is None:
            if not schema.get("nullable"):
                if schema.get("type"):
                    out.append(invalid(path, value, f'{path} in body must be of type {schema["type"]}: "null"'))
            return
        type_ = schema.get("type")
        if schema.get("x-kubernetes-int-or-string"):
            if not (isinstance(value, str) or _is_type(value, "integer")):
                out.append(invalid(path, value, f"{path} in body must be of type integer-or-string"))
                return
        elif type_ and not _is_type(value, type_):
            got = "object" if isinstance(value, dict) else "array" if isinstance(value, list) else \
                "string" if isinstance(value, str) else "boolean" if isinstance(value, bool) else "number"
            out.append(invalid(path, got, f'{path} in body must be of type {type_}: "{got}"'))
            return
        if "enum" in schema and value not in schema["enum"]:
            supported = ", ".join(json.dumps(x) for x in schema["enum"])
            out.append(Cause(path, "FieldValueNotSupported",
                             f"Unsupported value: {_fmt(value)}: supported values: {supported}"))
        if type_ == "integer" and isinstance(value, int) and not -2**63 <= value < 2**63:
            out.append(invalid(path, value, f"{path} in body must be of type int64"))
            return
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if "minimum" in schema:
                lo = schema["minimum"]
                if value < lo or schema.get("exclusiveMinimum") and value == lo:
                    op = "greater than" if schema.get("exclusiveMinimum") else "greater than or equal to"
                    out.append(invalid(path, value, f"{path} in body should be {op} {lo}"))
            if "maximum" in schema:
                hi = schema["maximum"]
                if value > hi or schema.get("exclusiveMaximum") and value == hi:
                    op = "less than" if schema.get("exclusiveMaximum") else "less than or equal to"
                    out.append(invalid(path, value, f"{path} in body should be {op} {hi}"))
        if isinstance(value, str):
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                out.append(Cause(path, "FieldValueTooLong", f"Too long: may not be more than {schema['maxLength']} bytes"))
            if "minLength" in schema and len(value) < schema["minLength"]:
                out.append(invalid(path, value, f"{path} in body should be at least {schema['minLength']} chars long"))
            if "pattern" in schema and not re.search(schema["pattern"], value):
                out.append(invalid(path, value, f"{path} in body should match '{schema['pattern']}'"))
        if isinstance(value, list):
            if "maxItems" in schema and len(value) > schema["maxItems"]:
                out.append(Cause(path, "FieldValueTooMany",
                                 f"Too many: {len(value)}: must have at most {schema['maxItems']} items"))
            if "minItems" in schema and len(value) < schema["minItems"]:
                out.append(invalid(path, len(value), f"{path} in body should have at least {schema['minItems']} items"))
            if isinstance(schema.get("items"), dict):
                for i, v in enumerate(value):
                    self.validate(v, schema["items"], f"{path}[{i}]", None, out)
        if isinstance(value, dict):
            for r in schema.get("required", []):
                if r not in value:
                    out.append(required(f"{path}.{r}" if path else r))
            props = schema.get("properties") or {}
            addl = schema.get("additionalProperties")
            for k, v in value.items():
                sub = props.get(k) if k in props else addl if isinstance(addl, dict) else None
                if sub is not None:
                    sub_old = old.get(k) if isinstance(old, dict) else None
                    self.validate(v, sub, f"{path}.{k}" if path else k, sub_old, out)
            if "maxProperties" in schema and len(value) > schema["maxProperties"]:
                out.append(Cause(path, "FieldValueTooMany",
                                 f"Too many: {len(value)}: must have at most {schema['maxProperties']} items"))
        for key in ("oneOf", "anyOf"):
            if key in schema:
                fits = sum(not self._errors_of(value, s, path) for s in schema[key])
                if fits == 0 or key == "oneOf" and fits > 1:
                    out.append(invalid(path, value, f"{path} in body must validate {'one and only one' if key == 'oneOf' else 'at least one'} schema ({key})"))
        for s in schema.get("allOf", []):
            self.validate(value, s, path, old, out)
        if "not" in schema and not self._errors_of(value, schema["not"], path):
            out.append(invalid(path, value, f"{path} in body must not validate the schema (not)"))
        if out and any(c.field == path or c.field.startswith(path + ".") for c in out) and schema.get("type") == "object":
            pass  # CEL still runs on objects with errors below, as the API server does for schema-valid parts
        for rule in schema.get("x-kubernetes-validations", []):
            self._cel_rule(rule, value, old, path, out)

    def _errors_of(self, value: Any, schema: dict[str, Any], path: str) -> list[Cause]:
        out: list[Cause] = []
        self.validate(value, schema, path, None, out)
        return out

    def _program(self, expr: str) -> Any:
        if expr not in self._cel:
            import celpy
            env = celpy.Environment()
            self._cel[expr] = env.program(env.compile(expr))
        return self._cel[expr]

    def _cel_rule(self, rule: dict[str, Any], value: Any, old: Any, path: str, out: list[Cause]) -> None:
        import celpy
        expr = rule["rule"]
        if "oldSelf" in expr and old is None:
            return  # a transition rule runs on updates only
        field = path + (rule.get("fieldPath") or "")
        field = field.lstrip(".")
        try:
            act = {"self": celpy.json_to_cel(value)}
            if "oldSelf" in expr:
                act["oldSelf"] = celpy.json_to_cel(old)
        except ValueError as e:  # e.g. an integer beyond int64: the API server cannot represent it either
            out.append(invalid(field, value, f"cannot evaluate {expr!r}: {e}"))
            return
        try:
            ok = self._program(expr).evaluate(act)
        except Exception as e:  # noqa: BLE001 - a rule that cannot be evaluated is an error, as in the server
            out.append(invalid(field, value, f"{expr}: {e}"))
            return
        if isinstance(ok, celpy.celtypes.BoolType) and bool(ok):
            return
        if not isinstance(ok, celpy.celtypes.BoolType) and not isinstance(ok, Exception):
            out.append(invalid(field, value, f"rule {expr!r} did not evaluate to a bool"))
            return
        message = rule.get("message") or f"failed rule: {expr}"
        if rule.get("messageExpression"):
            try:
                message = str(self._program(rule["messageExpression"]).evaluate(act))
            except Exception:  # noqa: BLE001 - the server falls back to message too
                pass
        reason = rule.get("reason") or "FieldValueInvalid"
        if reason == "FieldValueForbidden":
            out.append(Cause(field, reason, f"Forbidden: {message}"))
        elif reason == "FieldValueRequired":
            out.append(Cause(field, reason, f"Required value: {message}"))
        elif reason == "FieldValueDuplicate":
            out.append(Cause(field, reason, f"Duplicate value: {message}"))
        else:
            out.append(invalid(field, value, message))

    def apply(self, obj: dict[str, Any], old: dict[str, Any] | None) -> tuple[list[Cause], list[str]]:
        """Default and prune ``obj`` in place; return (causes, pruned field paths). On updates, errors on values
        that did not change are dropped (CRD validation ratcheting, on by default since 1.30), so a status write
        to an object stored before its schema tightened still goes through."""
        if old is not None:  # the stored object as read back: defaulted and pruned by the current schema too
            old = copy.deepcopy(old)
            self._apply(old, None)
        causes, pruned = self._apply(obj, old)
        if old is not None:
            causes = [c for c in causes if _lookup(obj, c.field) != _lookup(old, c.field)]
        return causes, pruned

    def _apply(self, obj: dict[str, Any], old: dict[str, Any] | None) -> tuple[list[Cause], list[str]]:
        pruned: list[str] = []
        for k, sub in (self.schema.get("properties") or {}).items():
            if k in ("metadata", "apiVersion", "kind"):
                continue
            if k not in obj and "default" in sub:
                obj[k] = copy.deepcopy(sub["default"])
            if k in obj:
                obj[k] = self.default_and_prune(obj[k], sub, k, pruned)
        for k in list(obj):
            if k not in ("apiVersion", "kind", "metadata") and k not in (self.schema.get("properties") or {}) \
                    and not self.schema.get("x-kubernetes-preserve-unknown-fields"):
                pruned.append(k)
                del obj[k]
        out: list[Cause] = []
        for k, sub in (self.schema.get("properties") or {}).items():
            if k in ("metadata", "apiVersion", "kind") or k not in obj:
                continue
            self.validate(obj[k], sub, k, (old or {}).get(k), out)
        for r in self.schema.get("required", []):
            if r not in obj:
                out.append(required(r))
        return out, pruned
