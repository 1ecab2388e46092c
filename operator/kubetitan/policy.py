"""The cluster admin's policy: what a LlamaPretrain may ask the operator to put into its pods.

The operator creates pods with its own (cluster-wide) permission, so without a policy anyone allowed to create a
LlamaPretrain could get a pod with any hostPath, image, service account (and through IRSA / Pod Identity its
AWS credentials), priority class or toleration. The admin sets the policy in the chart's ``policy`` values; the
chart passes it to the operator as ``--policy-*`` flags (:func:`from_flags`), and ``kubetitan validate --policy
FILE`` reads the same keys from a YAML file (:func:`load`). A started run whose spec the policy refuses later
(an operator restarted with a stricter policy) keeps its running attempt observed and gets no new attempt
(handlers.cycle's ``refused_live``). A spec outside the policy is refused at reconcile:
``Ready=False``/``SpecAccepted=False`` with reason ``PolicyViolation`` and a Warning Event, and no child is made.

Pure: no kopf, no client, no I/O except :func:`load` reading the file it is given.

Every knob is a list of what is allowed; the one entry ``"*"`` allows anything, an empty list allows nothing.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubetitan_core.api import LlamaPretrain

ANY = "*"
REASON = "PolicyViolation"
"""Condition reason and Event reason of a spec the policy refuses."""


@dataclass(frozen=True)
class Knob:
    """One admin setting: its key (Helm value under ``policy``, policy-file key), flag, default and meaning."""

    attr: str
    key: str
    default: tuple[str, ...]
    help: str

    @property
    def flag(self) -> str:
        return "--policy-" + "".join("-" + ch.lower() if ch.isupper() else ch for ch in self.key)


KNOBS: tuple[Knob, ...] = (
    Knob("host_path_prefixes", "hostPathPrefixes", (),
         "Directories under which `spec.checkpoint.storage.hostPath` may lie (whole path components: `/data` "
         "allows `/data/run1`, not `/data2`). Default: none, so no run gets a hostPath volume."),
    Knob("service_accounts", "serviceAccounts", ("default",),
         "Service accounts the pods may run as (`spec.resources.serviceAccountName`, unset meaning `default`): "
         "`NAME` in any namespace or `NAMESPACE/NAME`. Default: only `default`, so no run borrows a service "
         "account (and its IRSA / Pod Identity AWS role) it was not given."),
    Knob("priority_classes", "priorityClasses", (ANY,),
         "PriorityClasses the pods may use (`spec.resources.priorityClassName`). Default: any; list yours to "
         "keep `system-node-critical` and `system-cluster-critical` out."),
    Knob("image_prefixes", "imagePrefixes", (ANY,),
         "Prefixes the trainer image (`spec.resources.image`) must start with, e.g. `<your-registry>/ml/` (end a "
         "registry or repository prefix with `/`). Default: any image."),
    Knob("toleration_keys", "tolerationKeys", (ANY,),
         "Taint keys the pods may tolerate (the `key` of each `spec.resources.tolerations` entry; a toleration without a key "
         "tolerates every taint and is allowed only by `*`). The operator's own `nvidia.com/gpu` toleration is "
         "always added. Default: any."),
    Knob("s3_endpoint_prefixes", "s3EndpointPrefixes", ("https://",),
         "Prefixes `spec.checkpoint.storage.s3.endpoint` (an S3-compatible store) must start with, e.g. "
         "`https://minio.storage.svc:9000`; AWS's own endpoints (the field unset) are always allowed. Default: any "
         "https endpoint; add an `http://` one only for a store inside the cluster network (checkpoints and signed "
         "requests travel in clear)."),
)
_BY_KEY = {k.key: k for k in KNOBS}


@dataclass(frozen=True)
class Policy:
    """What the admin allows; the defaults are the chart's defaults (``charts/kubetitan/values.yaml``)."""

    host_path_prefixes: tuple[str, ...] = ()
    service_accounts: tuple[str, ...] = ("default",)
    priority_classes: tuple[str, ...] = (ANY,)
    image_prefixes: tuple[str, ...] = (ANY,)
    toleration_keys: tuple[str, ...] = (ANY,)
    s3_endpoint_prefixes: tuple[str, ...] = ("https://",)

    def describe(self) -> str:
        """One line for the operator's start-up log."""
        return "; ".join(f"{k.key}={','.join(getattr(self, k.attr)) or '(none)'}" for k in KNOBS)


@dataclass(frozen=True)
class Violation:
    """One part of a spec the policy refuses: where, what, and what to do (formatted like a validation error)."""

    path: str
    message: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class PolicyError(ValueError):
    """The policy itself (file or flags) is malformed; the message says which key and why."""


def _allowed(values: tuple[str, ...]) -> str:
    return ", ".join(values) if values else "none"


def _fix(knob: Knob) -> str:
    return f"ask the cluster admin to add it to the kubetitan chart's policy.{knob.key}"


def _host_path(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    path = lpt.spec.checkpoint.storage.host_path
    if path is None or ANY in p.host_path_prefixes:
        return []
    norm = posixpath.normpath(path)
    for prefix in p.host_path_prefixes:
        pre = posixpath.normpath(prefix)
        if norm == pre or norm.startswith(pre.rstrip("/") + "/"):
            return []
    return [Violation("spec.checkpoint.storage.hostPath",
                      f"hostPath {path} is outside the directories this cluster's kubetitan policy allows "
                      f"({_allowed(p.host_path_prefixes)}); use spec.checkpoint.storage.persistentVolumeClaim, "
                      f"or {_fix(_BY_KEY['hostPathPrefixes'])}", "policy.hostPathPrefixes")]


def _service_account(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    name = lpt.spec.resources.service_account_name or "default"
    ns = lpt.metadata.namespace or "default"
    if ANY in p.service_accounts or name in p.service_accounts or f"{ns}/{name}" in p.service_accounts:
        return []
    return [Violation("spec.resources.serviceAccountName",
                      f"service account {ns}/{name} is not one this cluster's kubetitan policy allows "
                      f"({_allowed(p.service_accounts)}); use an allowed one, or {_fix(_BY_KEY['serviceAccounts'])}",
                      "policy.serviceAccounts")]


def _priority_class(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    name = lpt.spec.resources.priority_class_name
    if name is None or ANY in p.priority_classes or name in p.priority_classes:
        return []
    return [Violation("spec.resources.priorityClassName",
                      f"priority class {name} is not one this cluster's kubetitan policy allows "
                      f"({_allowed(p.priority_classes)}); use an allowed one or leave it unset, or "
                      f"{_fix(_BY_KEY['priorityClasses'])}", "policy.priorityClasses")]


def _image(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    image = lpt.spec.resources.image
    if ANY in p.image_prefixes or any(image.startswith(pre) for pre in p.image_prefixes):
        return []
    return [Violation("spec.resources.image",
                      f"image {image} does not start with a prefix this cluster's kubetitan policy allows "
                      f"({_allowed(p.image_prefixes)}); push the trainer image there, or "
                      f"{_fix(_BY_KEY['imagePrefixes'])}", "policy.imagePrefixes")]


def _tolerations(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    if ANY in p.toleration_keys:
        return []
    out = []
    for i, t in enumerate(lpt.spec.resources.tolerations):
        key = t.get("key") or ""
        if key and key in p.toleration_keys:
            continue
        what = f"toleration of taint key {key}" if key else "a toleration without a key (it tolerates every taint)"
        out.append(Violation(f"spec.resources.tolerations[{i}]",
                             f"{what} is not allowed by this cluster's kubetitan policy (allowed keys: "
                             f"{_allowed(p.toleration_keys)}); remove it, or {_fix(_BY_KEY['tolerationKeys'])}",
                             "policy.tolerationKeys"))
    return out


def _s3_endpoint(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    s3 = lpt.spec.checkpoint.storage.s3
    endpoint = s3.endpoint if s3 is not None else None
    if endpoint is None or ANY in p.s3_endpoint_prefixes or any(endpoint.startswith(x) for x in p.s3_endpoint_prefixes):
        return []
    return [Violation("spec.checkpoint.storage.s3.endpoint",
                      f"S3 endpoint {endpoint} does not start with a prefix this cluster's kubetitan policy allows "
                      f"({_allowed(p.s3_endpoint_prefixes)}); use an https:// endpoint, or "
                      f"{_fix(_BY_KEY['s3EndpointPrefixes'])}", "policy.s3EndpointPrefixes")]


CHECKS: tuple[tuple[str, Callable[[LlamaPretrain, Policy], list[Violation]]], ...] = (
    ("hostPathPrefixes", _host_path),
    ("serviceAccounts", _service_account),
    ("priorityClasses", _priority_class),
    ("imagePrefixes", _image),
    ("tolerationKeys", _tolerations),
    ("s3EndpointPrefixes", _s3_endpoint),
)


def check(lpt: LlamaPretrain, policy: Policy) -> list[Violation]:
    """Every part of a (valid) LlamaPretrain the policy refuses, in the order of :data:`KNOBS`."""
    return [v for _, fn in CHECKS for v in fn(lpt, policy)]


# ------------------------------------------------------------------ building a policy
def _values(key: str, raw: Any) -> tuple[str, ...]:
    if raw is None:
        return _BY_KEY[key].default
    if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
        raise PolicyError(f"policy.{key}: expected a list of non-empty strings (or [\"*\"] for any), got {raw!r}")
    if key == "hostPathPrefixes":
        bad = [x for x in raw if x != ANY and (not x.startswith("/") or ".." in x.split("/"))]
        if bad:
            raise PolicyError(f"policy.hostPathPrefixes: {bad[0]!r} is not an absolute path without '..'; "
                              "write directories like /var/lib/kubetitan")
    return tuple(raw)


def from_mapping(data: Mapping[str, Any]) -> Policy:
    """A policy from the chart's ``policy`` block (the same keys); a missing key keeps its default."""
    unknown = sorted(set(data) - set(_BY_KEY))
    if unknown:
        raise PolicyError(f"policy: unknown key {unknown[0]!r}; the keys are {', '.join(_BY_KEY)}")
    return Policy(**{k.attr: _values(k.key, data.get(k.key)) for k in KNOBS})


def load(data: Any) -> Policy:
    """A policy from a parsed YAML document: the ``policy`` block itself, or a Helm values file holding one."""
    if data is None:
        return Policy()
    if not isinstance(data, Mapping):
        raise PolicyError(f"policy: expected a mapping of {', '.join(_BY_KEY)}, got {type(data).__name__}")
    if "policy" in data and not (set(data) & set(_BY_KEY)):
        inner = data["policy"]
        if inner is None:
            return Policy()
        if not isinstance(inner, Mapping):
            raise PolicyError(f"policy: expected a mapping of {', '.join(_BY_KEY)}, got {type(inner).__name__}")
        return from_mapping(inner)
    return from_mapping(data)


def add_flags(parser: Any) -> None:
    """The operator's ``--policy-*`` flags: comma-separated lists (an empty value allows nothing)."""
    for k in KNOBS:
        default = ",".join(k.default) if k.default else "(empty: none)"
        parser.add_argument(k.flag, dest=f"policy_{k.attr}", metavar="A,B", default=None,
                            help=f"{k.help} Default: {default}.")


def from_flags(args: Any) -> Policy:
    """The policy of ``kubetitan operator``'s parsed ``--policy-*`` flags."""
    data: dict[str, Any] = {}
    for k in KNOBS:
        raw = getattr(args, f"policy_{k.attr}", None)
        if raw is not None:
            data[k.key] = [x.strip() for x in raw.split(",") if x.strip()]
    return from_mapping(data)


def flag_args(policy: Policy) -> list[str]:
    """The flags that give ``policy`` to the operator (what the chart's deployment renders), for tests."""
    return [f"{k.flag}={','.join(getattr(policy, k.attr))}" for k in KNOBS]


def knob_table() -> Iterable[tuple[str, str, str, str]]:
    """(Helm value, operator flag, default, meaning) per knob, for docs/api.md and docs/install.md."""
    for k in KNOBS:
        yield (f"policy.{k.key}", k.flag, "[" + ", ".join(f'"{d}"' for d in k.default) + "]", k.help)

