"""Admission review of a LlamaPretrain: what the validating webhook answers, as pure functions.

``review(obj, old, operation, policy, ...)`` decides one AdmissionReview request with the same code as
``kubetitan validate --policy`` (``validation.parse``, ``policy.check``, ``warning_rules.warnings_for``): the same
errors at the same field paths with the same messages, and the same warnings. On UPDATE it also refuses what the
operator would block on a started run (``observation.spec.REJECTED_FIELDS``: model, tokenizer, checkpoint storage), with
the operator's own message, and a change of the world size or data-parallel degree the trainer cannot resume at
(``plan.world_size_edit``: hub-streamed data; the same message as the operator's ``WorldSizeChangeRefused``),
while such a change of a run that can is allowed with a warning that it applies at the next attempt.
``access_checks`` lists the SubjectAccessReviews the requester checks need
(:class:`Requester` modes); ``review`` takes their answers, so the whole decision is table-tested without kopf or
a cluster. kubetitan.webhook is the thin kopf wrapper that asks the API server and calls these.

Pure: no kopf, no client, no I/O.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kubetitan_core.validation import parse
from kubetitan_core.warning_rules import warnings_for

from kubetitan import conditions as C
from kubetitan import plan
from kubetitan import policy as policy_mod
from kubetitan.observation.spec import spec_changes


class Requester(str, Enum):
    """How much the requesting user must be allowed herself for the objects a spec makes the operator use.

    The operator creates pods with its own permission, so without a check anyone allowed to create a LlamaPretrain
    gets pods that mount any Secret, claim or service account of the namespace (docs/install.md, "Trust model").
    """

    OFF = "off"
    """No requester check: the admin policy alone bounds what a run may reference."""
    POD_CREATE = "podCreate"
    """A spec referencing a Secret, ConfigMap, claim, service account or priority class needs a user allowed to
    ``create pods`` in the namespace: Kubernetes' own stance (who can create a pod can use all of these in it)."""
    REFERENCES = "references"
    """Each reference needs the access that would let the user use it directly (:data:`VERBS`)."""


VERBS: dict[str, tuple[str, str, str]] = {
    "Secret": ("get", "", "secrets"),
    "ConfigMap": ("get", "", "configmaps"),
    "PersistentVolumeClaim": ("get", "", "persistentvolumeclaims"),
    "ServiceAccount": ("create", "", "serviceaccounts/token"),
    "PriorityClass": ("use", "scheduling.k8s.io", "priorityclasses"),
}
"""``references`` mode: kind -> (verb, API group, resource) the user needs on the named object. Reading a Secret's
or ConfigMap's data is what a pod that mounts it gets; ``get`` on a claim is the least that shows the user may
work with it; a pod running as a service account holds its credentials (its token, its IRSA / Pod Identity
role), which ``create serviceaccounts/token`` grants directly; a priority class has no RBAC of its own in pod
creation, so the check is the verb ``use`` on it (granted explicitly, like PodSecurityPolicy's ``use``)."""


DEFAULT_SERVICE_ACCOUNT = "default"
"""The service account a pod runs as when it names none: naming it gives the same pod as leaving it out, so it is
no reference to check (every pod a user may have created in the namespace runs as it)."""

MAX_ACCESS_CHECKS = 64
"""The most SubjectAccessReviews one request may need (distinct objects a spec references, in ``references``
mode): a spec needing more is refused before any is asked, so no request, from the API server or from anyone
else who reaches the webhook, makes the operator send more than this many."""


@dataclass(frozen=True)
class Reference:
    """One object a spec makes the pods use: its kind, name, the field that names it, and what the pods do with it."""

    kind: str
    name: str
    path: str
    use: str = ""
    """The purpose, independent of list positions: ``env WANDB_API_KEY from key k``, ``image pull secret``,
    ``checkpoint S3 credentials for https://minio:9000``... A reference is new to an update when its
    ``(kind, name, use)`` is: the same Secret moved from ``imagePullSecrets`` (only the kubelet reads it) into an
    environment variable (the trainer's code reads it) is a new use, and is checked."""

    @property
    def key(self) -> tuple[str, str, str]:
        return self.kind, self.name, self.use


@dataclass(frozen=True)
class Access:
    """One SubjectAccessReview: may the requesting user ``verb`` ``resource`` (``name``) in ``namespace``."""

    verb: str
    group: str
    resource: str
    namespace: str | None
    name: str | None = None

    def describe(self) -> str:
        res = self.resource.split("/", 1)
        what = res[0] + (f".{self.group}" if self.group else "") + (f"/{res[1]}" if len(res) > 1 else "")
        where = f" in namespace {self.namespace}" if self.namespace else ""
        return f"{self.verb} {what}{' ' + repr(self.name) if self.name else ''}{where}"

    def sar(self, user: Mapping[str, Any]) -> dict[str, Any]:
        """The SubjectAccessReview (authorization.k8s.io/v1) asking this for the admission request's user."""
        group, _, sub = self.resource.partition("/")
        attrs: dict[str, Any] = {"verb": self.verb, "group": self.group, "resource": group}
        if sub:
            attrs["subresource"] = sub
        if self.namespace:
            attrs["namespace"] = self.namespace
        if self.name:
            attrs["name"] = self.name
        spec: dict[str, Any] = {"resourceAttributes": attrs, "user": user.get("username", "")}
        if user.get("groups"):
            spec["groups"] = list(user["groups"])
        if user.get("uid"):
            spec["uid"] = user["uid"]
        if user.get("extra"):
            spec["extra"] = {k: list(v) for k, v in user["extra"].items()}
        return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}


@dataclass(frozen=True)
class Verdict:
    """The answer to one admission request."""

    allowed: bool
    message: str = ""
    warnings: tuple[str, ...] = ()
    code: int = 200
    """HTTP code of a refusal (the API server answers the client with it): 422 invalid, 403 forbidden."""
    errors: tuple[str, ...] = field(default=(), compare=False)
    """Each refusal reason as ``path: message`` (the lines of ``message``)."""


def references(spec: Mapping[str, Any], base: str = "spec") -> Iterator[Reference]:
    """Every Secret, ConfigMap, claim, service account and priority class a (valid, wire-form) spec names."""
    res = spec.get("resources") or {}
    for i, e in enumerate(res.get("env") or []):
        vf = (e or {}).get("valueFrom") or {}
        var = (e or {}).get("name")
        if (s := vf.get("secretKeyRef")) and s.get("name"):
            yield Reference("Secret", s["name"], f"{base}.resources.env[{i}].valueFrom.secretKeyRef.name",
                            f"env {var} from key {s.get('key')}")
        if (c := vf.get("configMapKeyRef")) and c.get("name"):
            yield Reference("ConfigMap", c["name"], f"{base}.resources.env[{i}].valueFrom.configMapKeyRef.name",
                            f"env {var} from key {c.get('key')}")
    for i, name in enumerate(res.get("imagePullSecrets") or []):
        yield Reference("Secret", name, f"{base}.resources.imagePullSecrets[{i}]", "image pull secret")
    tok = (spec.get("tokenizer") or {}).get("tokenSecretRef") or {}
    if tok.get("name"):
        yield Reference("Secret", tok["name"], f"{base}.tokenizer.tokenSecretRef.name",
                        f"tokenizer token from key {tok.get('key')}")
    for where, s3 in (("checkpoint.storage.s3", ((spec.get("checkpoint") or {}).get("storage") or {}).get("s3")),
                      ("data.s3", (spec.get("data") or {}).get("s3"))):
        ref = (s3 or {}).get("credentialsSecretRef") or {}
        if ref.get("name"):
            yield Reference("Secret", ref["name"], f"{base}.{where}.credentialsSecretRef.name",
                            f"{where} credentials from keys {ref.get('accessKeyIdKey')}, "
                            f"{ref.get('secretAccessKeyKey')} for {(s3 or {}).get('endpoint') or 'AWS'}")
    ckpt_spec = spec.get("checkpoint") or {}
    ckpt = (ckpt_spec.get("storage") or {}).get("persistentVolumeClaim") or {}
    if ckpt.get("claimName"):
        yield Reference("PersistentVolumeClaim", ckpt["claimName"],
                        f"{base}.checkpoint.storage.persistentVolumeClaim.claimName",
                        f"checkpoint volume at {ckpt_spec.get('mountPath')}")
    data = spec.get("data") or {}
    vol = data.get("volume") or {}
    if vol.get("claimName"):
        yield Reference("PersistentVolumeClaim", vol["claimName"], f"{base}.data.volume.claimName",
                        f"data volume at {data.get('mountPath')}" + (" read-only" if vol.get("readOnly") else ""))
    if res.get("serviceAccountName") and res["serviceAccountName"] != DEFAULT_SERVICE_ACCOUNT:
        yield Reference("ServiceAccount", res["serviceAccountName"], f"{base}.resources.serviceAccountName",
                        "pod service account")
    if res.get("priorityClassName"):
        yield Reference("PriorityClass", res["priorityClassName"], f"{base}.resources.priorityClassName",
                        "pod priority class")


CODE_FIELDS: tuple[tuple[str, ...], ...] = (
    ("resources", "image"), ("resources", "env"), ("checkpoint", "mountPath"), ("checkpoint", "storage"),
    ("data", "mountPath"), ("data", "volume"),
)
"""The spec fields that decide what code the pods run and what it can see: the image, the environment (every
variable: one can load code, point a token at another server or change what the launcher does) and the mounts
(claims, host paths, mount paths, read-only). An UPDATE that changes one of them is checked as if the requesting
user created the run as it now stands: every reference, not only the new uses, because her code (or her change
of it) would get all of them."""


def code_changes(new: Mapping[str, Any], was: Mapping[str, Any]) -> list[str]:
    """The :data:`CODE_FIELDS` (``spec.`` paths) that differ between two wire-form specs."""
    def at(spec: Mapping[str, Any], path: tuple[str, ...]) -> Any:
        for part in path:
            spec = spec.get(part) if isinstance(spec, Mapping) else None
        return spec

    return ["spec." + ".".join(p) for p in CODE_FIELDS if at(new, p) != at(was, p)]


@functools.lru_cache(maxsize=64)
def _parsed(text: str) -> tuple[Any, list[Any], dict[str, Any] | None]:
    """``parse`` of an object given as JSON, and its spec in wire form with defaults (what the operator
    compares; None unless it parses without errors). One request parses its object once, however many of
    ``review``'s steps read it."""
    lpt, errors = parse(json.loads(text))
    wire = lpt.spec.model_dump(by_alias=True, exclude_none=True, mode="json") if lpt is not None and not errors \
        else None
    return lpt, errors, wire


def _parse(obj: Mapping[str, Any]) -> tuple[Any, list[Any], dict[str, Any] | None]:
    try:
        text = json.dumps(obj, allow_nan=False)  # key order kept: errors come in document order
    except (TypeError, ValueError):  # not what an API server sends; parse it as it is
        lpt, errors = parse(copy.deepcopy(dict(obj)))
        return lpt, errors, None
    lpt, errors, wire = _parsed(text)
    return lpt, list(errors), wire  # shared with the cache: every reader here only reads it (no deep copy)


def _wire_spec(obj: Any) -> dict[str, Any] | None:
    """The spec of an object that parses, in wire form with defaults, else None."""
    return _parse(obj)[2] if isinstance(obj, Mapping) else None


def _new_references(obj: Mapping[str, Any], old: Mapping[str, Any] | None) -> list[Reference]:
    """The references the requester checks cover: all of them on CREATE, on an UPDATE of an old object that does
    not parse, and on an UPDATE that changes a :data:`CODE_FIELDS` field; else those whose use is new."""
    new = _wire_spec(obj)
    if new is None:
        return []
    was = _wire_spec(old) if old is not None else None
    if was is None or code_changes(new, was):
        return list(references(new))
    before = {r.key for r in references(was)}
    return [r for r in references(new) if r.key not in before]


def _rechecked_for(obj: Mapping[str, Any], old: Mapping[str, Any] | None, operation: str) -> list[str]:
    """The code fields an UPDATE changes (why every reference is checked), else []."""
    if operation != "UPDATE" or old is None:
        return []
    new, was = _wire_spec(obj), _wire_spec(old)
    return code_changes(new, was) if new is not None and was is not None else []


def access_checks(obj: Mapping[str, Any], old: Mapping[str, Any] | None, operation: str,
                  mode: Requester) -> list[Access]:
    """The SubjectAccessReviews ``review`` needs answered for this request (none when it needs none): every
    reference of a CREATE, or of an UPDATE that changes the image, the environment or the mounts
    (:data:`CODE_FIELDS`); of any other UPDATE, the references whose use is new (a tenant editing
    ``training.steps`` of an admin's run needs no access to the admin's Secret; moving it from
    ``imagePullSecrets`` into ``tokenizer.tokenSecretRef`` does)."""
    if mode == Requester.OFF or operation not in ("CREATE", "UPDATE") or _spec_unchanged(obj, old, operation):
        return []
    refs = _new_references(obj, old)
    ns = _namespace(obj, old)
    if not refs:
        return []
    if mode == Requester.POD_CREATE:
        return [Access("create", "", "pods", ns)]
    out: dict[Access, None] = {}  # distinct, in reference order
    for r in refs:
        verb, group, resource = VERBS[r.kind]
        out.setdefault(Access(verb, group, resource, None if r.kind == "PriorityClass" else ns, r.name))
    return list(out)


def _namespace(obj: Mapping[str, Any], old: Mapping[str, Any] | None) -> str:
    meta = obj.get("metadata") or (old or {}).get("metadata") or {}
    return str(meta.get("namespace") or "default")


def _spec_unchanged(obj: Mapping[str, Any], old: Mapping[str, Any] | None, operation: str) -> bool:
    return operation == "UPDATE" and old is not None and obj.get("spec") == old.get("spec")


def _started(old: Mapping[str, Any]) -> bool:
    """Whether the run has an attempt, whose spec the old object's spec is: not when the operator refused the old
    spec's own edit (it slipped past admission: webhook down with failurePolicy Ignore, or an edit from before the
    webhook). The running attempt then has another spec, which admission cannot see, and an edit must stay
    possible, above all the revert the refusal asks for; the operator judges it against the attempt's spec."""
    status = old.get("status") or {}
    refused = any(c.get("type") == C.SPEC_ACCEPTED and c.get("reason") in (C.IMMUTABLE_FIELD_CHANGED,
                                                                           C.WORLD_SIZE_CHANGE_REFUSED)
                  for c in status.get("conditions") or [] if isinstance(c, Mapping))
    return status.get("attempt") is not None and not refused


def _immutable_errors(obj: Mapping[str, Any], old: Mapping[str, Any]) -> list[str]:
    """The operator's refusal of a started run's checkpoint-breaking change (reconcile.cycle), at admission."""
    before, after = _wire_spec(old), _wire_spec(obj)
    if before is None or after is None or not _started(old):
        return []
    _live, _later, rejected = spec_changes(before, after)
    if not rejected:
        return []
    return [f"spec.{rejected[0]}: changing {', '.join(rejected)} would make the run's checkpoints unusable; "
            "revert it, or create a new LlamaPretrain"]


def _world_size_edit(obj: Mapping[str, Any], old: Mapping[str, Any]) -> plan.WorldSizeEdit | None:
    """A started run's world-size or data-parallel change (the operator's spec gate, ``status.spec_gate``), at
    admission: refused for hub-streamed data, a warning that it applies at the next attempt otherwise."""
    if not _started(old):
        return None
    (then, then_errors, _), (now, now_errors, _) = _parse(old), _parse(obj)
    if then is None or now is None or then_errors or now_errors:
        return None
    return plan.world_size_edit(then.spec, now.spec)


def review(obj: Mapping[str, Any] | None, old: Mapping[str, Any] | None, operation: str,
           pol: policy_mod.Policy | None = None, mode: Requester = Requester.OFF,
           answers: Mapping[Access, bool | str] | None = None) -> Verdict:
    """Decide one admission request for a LlamaPretrain.

    ``obj``/``old``: the request's object and oldObject; ``operation``: CREATE, UPDATE (others pass); ``pol``: the
    admin policy (None: none); ``mode`` and ``answers``: the requester checks and the SubjectAccessReview answer of
    each :func:`access_checks` entry (True, or the reason it was denied; a missing answer refuses). A request that
needs more than :data:`MAX_ACCESS_CHECKS` of them is refused (422) whatever the answers.

    An UPDATE that leaves ``spec`` as it was passes at once: kopf's finalizer and annotation patches, and label
    edits, must never be refused because a stored spec predates a rule (the operator reports those itself).
    """
    if operation not in ("CREATE", "UPDATE") or obj is None or _spec_unchanged(obj, old, operation):
        return Verdict(True)
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    name = str(meta.get("name") or meta.get("generateName") or "")
    lpt, errors, _ = _parse(obj)
    lines = [str(e) for e in errors]
    warnings: tuple[str, ...] = ()
    if lpt is not None and not errors:
        warnings = tuple(f"[{w.rule}] {w}" for w in warnings_for(lpt))
    if lines:
        return Verdict(False, f"LlamaPretrain {name} is invalid ({len(lines)} error(s)):\n  - " + "\n  - ".join(lines),
                       warnings, 422, tuple(lines))
    assert lpt is not None
    refused = [str(v) for v in policy_mod.check(lpt, pol)] if pol is not None else []
    if refused:
        return Verdict(False, f"LlamaPretrain {name} is valid but the cluster's kubetitan policy refuses it "
                       f"({len(refused)} error(s)):\n  - " + "\n  - ".join(refused), warnings, 403, tuple(refused))
    if operation == "UPDATE" and old is not None and (immutable := _immutable_errors(obj, old)):
        return Verdict(False, f"LlamaPretrain {name} has started, and this change would make its checkpoints "
                       f"unusable ({len(immutable)} error(s)):\n  - " + "\n  - ".join(immutable), warnings, 422,
                       tuple(immutable))
    if operation == "UPDATE" and old is not None and (edit := _world_size_edit(obj, old)) is not None:
        if not edit.allowed:
            line = f"{edit.path}: {edit.refusal}"
            return Verdict(False, f"LlamaPretrain {name} has started, and this change of its world size is refused "
                           f"(1 error(s)):\n  - {line}", warnings, 422, (line,))
        warnings = (*warnings, f"[{C.DEFERRED_TO_NEXT_ATTEMPT}] {edit.path}: {edit.deferral}")
    if (too_many := _too_many_checks(obj, old, operation, mode)) is not None:
        return Verdict(False, f"LlamaPretrain {name} needs more access checks than one request may ask "
                       f"(1 error(s)):\n  - {too_many}", warnings, 422, (too_many,))
    denied = _requester_denials(obj, old, operation, mode, answers or {})
    if denied:
        changed = _rechecked_for(obj, old, operation)
        why = (f"; this update changes {', '.join(changed)}, so every reference is checked as if she created the "
               "run as it now stands" if changed else "")
        return Verdict(False, f"LlamaPretrain {name} references what the requesting user may not use herself{why} "
                       f"({len(denied)} error(s)):\n  - " + "\n  - ".join(denied), warnings, 403, tuple(denied))
    return Verdict(True, "", warnings)


def _too_many_checks(obj: Mapping[str, Any], old: Mapping[str, Any] | None, operation: str,
                     mode: Requester) -> str | None:
    checks = access_checks(obj, old, operation, mode)
    if len(checks) <= MAX_ACCESS_CHECKS:
        return None
    return (f"spec: the requester checks need {len(checks)} SubjectAccessReviews for the distinct Secrets, ConfigMaps, "
            f"claims, service account and priority class this spec references, more than the {MAX_ACCESS_CHECKS} "
            "one request may ask; reference fewer objects (one Secret or ConfigMap can hold many keys)")


def _requester_denials(obj: Mapping[str, Any], old: Mapping[str, Any] | None, operation: str, mode: Requester,
                       answers: Mapping[Access, bool | str]) -> list[str]:
    checks = access_checks(obj, old, operation, mode)
    if not checks:
        return []
    ns = _namespace(obj, old)
    fix = ("ask for that access, reference something you may use, or ask the cluster admin to set the kubetitan "
           "chart's webhook.requesterChecks")
    out = []
    if mode == Requester.POD_CREATE:
        a = checks[0]
        ans = answers.get(a, "not checked")
        if ans is not True:
            refs = _new_references(obj, old)
            out.append(f"{refs[0].path}: this spec makes the operator create pods that use "
                       + ", ".join(f"{r.kind} {r.name}" for r in refs)
                       + f", and the requesting user may not create pods in namespace {ns} ({_why(ans)}); {fix}")
        return out
    by_ref = {}
    for r in _new_references(obj, old):
        verb, group, resource = VERBS[r.kind]
        by_ref.setdefault(Access(verb, group, resource, None if r.kind == "PriorityClass" else ns, r.name), r)
    for a in checks:
        ans = answers.get(a, "not checked")
        if ans is not True:
            r = by_ref[a]
            out.append(f"{r.path}: {r.kind} {r.name} is used by the pods the operator creates, and the requesting "
                       f"user may not {a.describe()} ({_why(ans)}); {fix}")
    return out


def _why(answer: bool | str) -> str:
    if answer is False:
        return "denied"
    return str(answer) or "denied"
