"""What kmockx refuses at create/update, worded as kube-apiserver words it (a test tool, not product code).

- ``StructuralSchema``: a CRD version's ``openAPIV3Schema`` applied as apiextensions-apiserver does:
  defaults, pruning of unknown fields (unless ``x-kubernetes-preserve-unknown-fields``), then types, enums,
  bounds, lengths, patterns, required, and the CEL rules of ``x-kubernetes-validations`` (cel-python) with
  their ``message``/``messageExpression``, ``fieldPath`` and ``reason``.
- ``builtin_errors``: pods/services/configmaps/... against the Kubernetes OpenAPI schema of
  :data:`K8S_VERSION` shipped by kubernetes-validate (strict: unknown fields are errors), compiled once per kind; an
  object is first checked by a function compiled from the same schema (``kmockx.schemacheck``, as strict and ~20x
  faster) and only one it refuses goes through jsonschema's ``iter_errors`` for the errors.
- ``meta_errors``: object names (DNS-1123 subdomain / label, DNS-1035 for Services), label keys/values,
  total annotation size.
Each error is a ``Cause`` (field, reason, message); ``invalid_status`` renders the 422 ``Status``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
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


# ---------------------------------------------------------------------------------------------- JSON bodies
class _GoRefuses(ValueError):
    pass


_GO_CONSTANT_ERRORS = {"NaN": "invalid character 'N' looking for beginning of value",
                       "Infinity": "invalid character 'I' looking for beginning of value",
                       "-Infinity": "invalid character 'I' in numeric literal"}


def _refuse_constant(name: str) -> Any:
    raise _GoRefuses(_GO_CONSTANT_ERRORS[name])


def _go_number(text: str) -> Any:
    v = float(text)
    if math.isinf(v):  # Python reads 1e400 as inf; Go's decoder refuses a number beyond float64
        raise _GoRefuses(f"json: cannot unmarshal number {text} into Go value of type float64")
    return int(text) if text.lstrip("-").isdigit() else v


def go_json_error(text: str) -> str | None:
    """What Go's JSON decoder (the API server's) says about a body Python's ``json`` accepts but Go refuses:
    ``NaN``, ``Infinity``, ``-Infinity`` (not JSON, RFC 8259 section 6) and numbers beyond float64. None when Go
    accepts it, or when Python refuses it too (kmock answers that already)."""
    try:
        json.loads(text, parse_constant=_refuse_constant, parse_float=_go_number, parse_int=_go_number)
    except _GoRefuses as e:
        return str(e)
    except ValueError:
        return None
    return None


def summarize_body(body: str, limit: int = 30) -> str:
    """The API server's ``summarizeData``: the body's first 30 bytes in a decode error."""
    if not body:
        return "<empty>"
    return body[:limit] + " ..." if len(body) > limit else body


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
def _builtin_schema(kind: str, api_version: str, version: str = K8S_VERSION) -> tuple[dict[str, Any], Any]:
    """One built-in kind's schema (kubernetes-validate's strict schemas) and the ``referencing`` registry its
    ``$ref``s resolve in, loaded once."""
    import kubernetes_validate.utils as kv
    from referencing import Registry, Resource

    group, _, gv_version = api_version.rpartition("/")
    group = group.split(".")[0] if group else ""
    base = f"kubernetes-json-schema/v{version}-local-strict/"
    suffix = f"{kind.lower()}-{group + '-' if group else ''}{gv_version}.json"
    schema = kv.schema_contents(base + suffix, version)
    defs = kv.schema_contents(base + "_definitions.json", version)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return schema, registry.with_resource("_definitions.json", Resource.from_contents(defs))


@functools.lru_cache(maxsize=None)
def _builtin_validator(kind: str, api_version: str, version: str = K8S_VERSION) -> Any:
    """A compiled jsonschema validator for one built-in kind (of Kubernetes ``version``), cached."""
    import jsonschema

    schema, registry = _builtin_schema(kind, api_version, version)
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


@functools.lru_cache(maxsize=None)
def _builtin_check(kind: str, api_version: str, version: str = K8S_VERSION) -> Any:
    """``_builtin_validator(kind, api_version).is_valid`` compiled to one function (``kmockx.schemacheck``), cached
    like it; None when the schema holds a keyword the compiler does not model (then jsonschema alone decides)."""
    from kmockx import schemacheck

    schema, registry = _builtin_schema(kind, api_version, version)
    validator = _builtin_validator(kind, api_version, version)
    try:
        return schemacheck.compile_check(schema, registry, type(validator), validator.format_checker)
    except schemacheck.Unsupported:
        return None


def _jpath(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def builtin_errors(obj: dict[str, Any], version: str = K8S_VERSION) -> tuple[list[Cause], list[str]]:
    """(422 causes, unknown fields) of a built-in object against its OpenAPI schema of Kubernetes ``version``."""
    try:
        validator = _builtin_validator(obj.get("kind", ""), obj.get("apiVersion", ""), version)
    except Exception:  # noqa: BLE001 - a kind kubernetes-validate has no schema for is not checked
        return [], []
    check = _builtin_check(obj.get("kind", ""), obj.get("apiVersion", ""), version)
    if check is not None and check(obj):
        return [], []  # valid, as jsonschema would find it (kmockx.schemacheck): its errors are needed only when not
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


def _same(a: Any, b: Any) -> bool:
    """Go's reflect.DeepEqual on decoded JSON: 1 and 1.0 differ, and so do true and 1."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _correlate_items(value: list[Any], old: Any, schema: dict[str, Any], ratchet: bool) -> list[Any]:
    """The old item each new item correlates to (``_MISSING`` where none): by key in a map list; by index in a list
    without a list type (for ratcheting only: CEL's ``oldSelf`` correlates map-list items only); never in a set or
    atomic list."""
    if not isinstance(old, list):
        return [_MISSING] * len(value)
    kind = schema.get("x-kubernetes-list-type")
    if kind == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []

        def key(item: Any) -> Any:
            return tuple(json.dumps(item.get(k), sort_keys=True) for k in keys) if isinstance(item, dict) else None

        by_key = {key(o): o for o in old}
        return [by_key.get(key(v), _MISSING) for v in value]
    if kind is None and ratchet:
        return [old[i] if i < len(old) else _MISSING for i in range(len(value))]
    return [_MISSING] * len(value)


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

    # -- validation (the OpenAPI value checks, then CEL), with CRD validation ratcheting
    def validate(self, value: Any, schema: dict[str, Any], path: str, old: Any, out: list[Cause],
                 parent_unchanged: bool = False, old_self: Any = _MISSING) -> None:
        """Append the causes ``value`` breaks to ``out``.

        Ratcheting (KEP-4008, on by default since 1.30, as apiextensions-apiserver does it): ``old`` is the value
        correlated to this node on an update (``_MISSING`` on create or when it cannot be correlated: a key absent
        from the old object, an item of a set or atomic list, an item past the old list's end; map lists correlate
        by their keys, other lists by index). An error raised at this node, by an OpenAPI check or by a CEL rule
        *defined* here (whatever its ``fieldPath`` names), is dropped when this node, or failing a correlation the
        nearest correlated ancestor (``parent_unchanged``), deep-equals its old value: "unchanged" is the whole
        object at the rule's ``self``, so a rule on ``spec`` is evaluated and reported as soon as any field under
        ``spec`` changed. Transition rules (they read ``oldSelf``) run only where an old value is passed to CEL
        (``old_self``: properties and map-list items, never items of other lists, never under atomic maps) and are
        never ratcheted. ``optionalOldSelf`` is not modelled (kubetitan's CRD does not use it)."""
        unchanged = _same(value, old) if old is not _MISSING else parent_unchanged
        mark = len(out)
        local: list[Cause] = []  # this node's own causes: ratcheted when ``unchanged``

        def own(c: Cause) -> None:
            local.append(c)
            out.append(c)

        self._value_checks(value, schema, path, own)
        if value is None or not self._type_ok(value, schema):
            pass
        else:
            if isinstance(value, list):
                if isinstance(schema.get("items"), dict):
                    olds = _correlate_items(value, old, schema, ratchet=True)
                    old_selves = _correlate_items(value, old_self, schema, ratchet=False)
                    for i, v in enumerate(value):
                        self.validate(v, schema["items"], f"{path}[{i}]", olds[i], out, unchanged, old_selves[i])
            if isinstance(value, dict):
                for r in schema.get("required", []):
                    if r not in value:
                        own(required(f"{path}.{r}" if path else r))
                props = schema.get("properties") or {}
                addl = schema.get("additionalProperties")
                atomic = schema.get("x-kubernetes-map-type") == "atomic"
                for k, v in value.items():
                    sub = props.get(k) if k in props else addl if isinstance(addl, dict) else None
                    if sub is not None:
                        sub_old = old.get(k, _MISSING) if isinstance(old, dict) else _MISSING
                        sub_self = old_self.get(k, _MISSING) if isinstance(old_self, dict) and not atomic \
                            else _MISSING
                        self.validate(v, sub, f"{path}.{k}" if path else k, sub_old, out, unchanged, sub_self)
                if "maxProperties" in schema and len(value) > schema["maxProperties"]:
                    own(Cause(path, "FieldValueTooMany",
                              f"Too many: {len(value)}: must have at most {schema['maxProperties']} items"))
            for key in ("oneOf", "anyOf"):
                if key in schema:
                    fits = sum(not self._errors_of(value, sub, path) for sub in schema[key])
                    if fits == 0 or key == "oneOf" and fits > 1:
                        own(invalid(path, value, f"{path} in body must validate "
                                    f"{'one and only one' if key == 'oneOf' else 'at least one'} schema ({key})"))
            for sub in schema.get("allOf", []):  # not ratcheted at this node, only by its ancestors (as the server)
                self.validate(value, sub, path, _MISSING, out, parent_unchanged, old_self)
            if "not" in schema and not self._errors_of(value, schema["not"], path):
                own(invalid(path, value, f"{path} in body must not validate the schema (not)"))
            as_cel: dict[str, Any] = {}  # ``self`` (and ``oldSelf``) converted for CEL once for this node's rules
            for rule in schema.get("x-kubernetes-validations", []):
                if "oldSelf" in rule["rule"]:
                    self._cel_rule(rule, value, old_self, path, out, as_cel)  # a transition rule: never ratcheted
                elif not unchanged:  # at an unchanged node ratcheting drops whatever the rule says: not evaluated
                    found: list[Cause] = []
                    self._cel_rule(rule, value, _MISSING, path, found, as_cel)
                    for c in found:
                        own(c)
        if unchanged and local:
            out[mark:] = [c for c in out[mark:] if not any(c is x for x in local)]

    @staticmethod
    def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
        if schema.get("x-kubernetes-int-or-string"):
            return isinstance(value, str) or _is_type(value, "integer")
        type_ = schema.get("type")
        if type_ and not _is_type(value, type_):
            return False
        return not (type_ == "integer" and isinstance(value, int) and not -2**63 <= value < 2**63)

    def _value_checks(self, value: Any, schema: dict[str, Any], path: str, own: Any) -> None:
        """The OpenAPI checks of one value on its own (null, type, enum, bounds, lengths, pattern, items count)."""
        if value is None:
            if not schema.get("nullable") and schema.get("type"):
                own(invalid(path, value, f'{path} in body must be of type {schema["type"]}: "null"'))
            return
        type_ = schema.get("type")
        if schema.get("x-kubernetes-int-or-string"):
            if not (isinstance(value, str) or _is_type(value, "integer")):
                own(invalid(path, value, f"{path} in body must be of type integer-or-string"))
                return
        elif type_ and not _is_type(value, type_):
            got = "object" if isinstance(value, dict) else "array" if isinstance(value, list) else \
                "string" if isinstance(value, str) else "boolean" if isinstance(value, bool) else "number"
            own(invalid(path, got, f'{path} in body must be of type {type_}: "{got}"'))
            return
        if "enum" in schema and value not in schema["enum"]:
            supported = ", ".join(json.dumps(x) for x in schema["enum"])
            own(Cause(path, "FieldValueNotSupported",
                      f"Unsupported value: {_fmt(value)}: supported values: {supported}"))
        if type_ == "integer" and isinstance(value, int) and not -2**63 <= value < 2**63:
            own(invalid(path, value, f"{path} in body must be of type int64"))
            return
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if "minimum" in schema:
                lo = schema["minimum"]
                if value < lo or schema.get("exclusiveMinimum") and value == lo:
                    op = "greater than" if schema.get("exclusiveMinimum") else "greater than or equal to"
                    own(invalid(path, value, f"{path} in body should be {op} {lo}"))
            if "maximum" in schema:
                hi = schema["maximum"]
                if value > hi or schema.get("exclusiveMaximum") and value == hi:
                    op = "less than" if schema.get("exclusiveMaximum") else "less than or equal to"
                    own(invalid(path, value, f"{path} in body should be {op} {hi}"))
        if isinstance(value, str):
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                own(Cause(path, "FieldValueTooLong", f"Too long: may not be more than {schema['maxLength']} bytes"))
            if "minLength" in schema and len(value) < schema["minLength"]:
                own(invalid(path, value, f"{path} in body should be at least {schema['minLength']} chars long"))
            if "pattern" in schema and not re.search(schema["pattern"], value):
                own(invalid(path, value, f"{path} in body should match '{schema['pattern']}'"))
        if isinstance(value, list):
            if "maxItems" in schema and len(value) > schema["maxItems"]:
                own(Cause(path, "FieldValueTooMany",
                          f"Too many: {len(value)}: must have at most {schema['maxItems']} items"))
            if "minItems" in schema and len(value) < schema["minItems"]:
                own(invalid(path, len(value), f"{path} in body should have at least {schema['minItems']} items"))

    def _errors_of(self, value: Any, schema: dict[str, Any], path: str) -> list[Cause]:
        out: list[Cause] = []
        self.validate(value, schema, path, _MISSING, out)
        return out

    def _program(self, expr: str) -> Any:
        if expr not in self._cel:
            import celpy
            env = celpy.Environment()
            self._cel[expr] = env.program(env.compile(expr))
        return self._cel[expr]

    def compile_rules(self) -> None:
        """Compile every CEL rule and messageExpression of the schema now, as the API server does when a CRD is
        written (so the first object's admission does not pay for it). A rule that does not compile is left to
        fail where it is evaluated, as before (kmockx does not refuse such a CRD)."""
        def walk(node: Any) -> None:
            if isinstance(node, dict):
                for rule in node.get("x-kubernetes-validations") or []:
                    for expr in (rule.get("rule"), rule.get("messageExpression")):
                        if isinstance(expr, str):
                            with contextlib.suppress(Exception):  # reported when evaluated (see _cel_rule)
                                self._program(expr)
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        walk(self.schema)

    @staticmethod
    def _to_cel(value: Any, key: str, as_cel: dict[str, Any]) -> Any:
        """``value`` as a CEL value, converted once per node (``as_cel``: this node's conversions, or the
        ``ValueError`` the conversion raised). CEL evaluation never changes its activation."""
        import celpy
        if key not in as_cel:
            try:
                as_cel[key] = celpy.json_to_cel(value)
            except ValueError as e:
                as_cel[key] = e
        if isinstance(as_cel[key], ValueError):
            raise as_cel[key]
        return as_cel[key]

    def _cel_rule(self, rule: dict[str, Any], value: Any, old: Any, path: str, out: list[Cause],
                  as_cel: dict[str, Any] | None = None) -> None:
        import celpy
        expr = rule["rule"]
        if "oldSelf" in expr and (old is _MISSING or old is None):
            return  # a transition rule runs on updates only, where an old value correlates
        field = path + (rule.get("fieldPath") or "")
        field = field.lstrip(".")
        as_cel = {} if as_cel is None else as_cel
        try:
            act = {"self": self._to_cel(value, "self", as_cel)}
            if "oldSelf" in expr:
                act["oldSelf"] = self._to_cel(old, "oldSelf", as_cel)
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
        """Default and prune ``obj`` in place; return (causes, pruned field paths). On updates, errors raised at a
        node that did not change are dropped (CRD validation ratcheting: see ``validate``), so a status write to an
        object stored before its schema tightened still goes through, while an edit anywhere under a CEL rule's
        ``self`` has the rule checked again."""
        if old is not None:  # the stored object as read back: defaulted and pruned by the current schema too
            old = copy.deepcopy(old)
            self._default_and_prune(old)
        pruned = self._default_and_prune(obj)
        return self._validate(obj, old), pruned

    def _default_and_prune(self, obj: dict[str, Any]) -> list[str]:
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
        return pruned

    def _validate(self, obj: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
        out: list[Cause] = []
        for k, sub in (self.schema.get("properties") or {}).items():
            if k in ("metadata", "apiVersion", "kind") or k not in obj:
                continue
            prev = old.get(k, _MISSING) if old is not None else _MISSING
            self.validate(obj[k], sub, k, prev, out, old_self=prev)
        if old is None or not _same(obj, old):
            for r in self.schema.get("required", []):
                if r not in obj:
                    out.append(required(r))
        return out
