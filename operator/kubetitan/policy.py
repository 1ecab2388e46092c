"""The cluster admin's policy: what a LlamaPretrain may ask the operator to put into its pods.

The operator creates pods with its own (cluster-wide) permission, so without a policy anyone allowed to create a
LlamaPretrain could get a pod with any hostPath, image, service account (and through IRSA / Pod Identity its
AWS credentials), priority class, toleration, node placement or scheduler. The admin sets the policy in the
chart's ``policy`` values; the chart passes it to the operator as ``--policy-*`` flags (:func:`from_flags`), and
``kubetitan validate --policy FILE`` reads the same keys from a YAML file (:func:`load`). A started run whose
spec the policy refuses later (an operator restarted with a stricter policy) keeps its running attempt observed
and gets no new attempt (``observation.snapshot.Snapshot.refused_live``). A spec outside the policy is refused at
reconcile: ``Ready=False``/``SpecAccepted=False`` with reason ``PolicyViolation`` and a Warning Event, and no child is made.

Pure: no kopf, no client, no I/O except :func:`load` reading the file it is given.

Most knobs are a list of what is allowed: the one entry ``"*"`` allows anything, an empty list allows nothing.
``keylessTolerations`` is a yes/no switch, and ``nodeLabels`` maps namespaces to the node label keys and values
their runs may select (:func:`node_labels`). docs/install.md ("Trust model") says what each knob bounds.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kubetitan_core import contract
from kubetitan_core.api import LlamaPretrain
from kubetitan.conditions import POLICY_VIOLATION
from kubetitan_core.catalog import INSTANCE_TYPE_LABEL

ANY = "*"
REASON = POLICY_VIOLATION
"""Condition reason and Event reason of a spec the policy refuses."""

NodeLabels = tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...]
"""``nodeLabels`` in a hashable, ordered form: ((namespace, ((label key, (allowed values...)), ...)), ...)."""

WELL_KNOWN_NODE_LABELS: tuple[str, ...] = (
    "kubernetes.io/arch",
    "kubernetes.io/os",
    INSTANCE_TYPE_LABEL,
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
    "nvidia.com/gpu.product",
    "karpenter.sh/capacity-type",
    "eks.amazonaws.com/capacityType",
)
"""Node labels that say what a node *is* (architecture, instance type, zone, GPU model, capacity type), not whose it
is: any run may select any value of these by default. Labels that carve nodes up between teams (``dedicated``,
``team``, ``eks.amazonaws.com/nodegroup``, ``kubernetes.io/hostname``) are not among them: an admin allows them per
namespace."""


def node_labels(data: Mapping[str, Mapping[str, Iterable[str]]]) -> NodeLabels:
    """The canonical (hashable, sorted) form of a ``nodeLabels`` mapping ``{namespace: {label key: [values]}}``."""
    return tuple(sorted((ns, tuple(sorted((k, tuple(v)) for k, v in keys.items()))) for ns, keys in data.items()))


def node_labels_dict(value: NodeLabels) -> dict[str, dict[str, list[str]]]:
    """The ``{namespace: {label key: [values]}}`` mapping of a canonical ``nodeLabels`` (for flags and docs)."""
    return {ns: {k: list(v) for k, v in keys} for ns, keys in value}


DEFAULT_NODE_LABELS: NodeLabels = node_labels({ANY: {k: [ANY] for k in WELL_KNOWN_NODE_LABELS}})


@dataclass(frozen=True)
class Knob:
    """One admin setting: its key (Helm value under ``policy``, policy-file key), flag, default and meaning."""

    attr: str
    key: str
    default: Any
    help: str
    kind: str = "list"
    """``list`` (comma-separated on the flag), ``bool`` (``true``/``false``) or ``labels`` (JSON on the flag)."""

    @property
    def flag(self) -> str:
        return "--policy-" + "".join("-" + ch.lower() if ch.isupper() else ch for ch in self.key)

    def wire(self, value: Any) -> Any:
        """The value as the chart's values.yaml and a policy file spell it."""
        if self.kind == "labels":
            return node_labels_dict(value)
        return value if self.kind == "bool" else list(value)


KNOBS: tuple[Knob, ...] = (
    Knob("host_path_prefixes", "hostPathPrefixes", (),
         "Directories under which `spec.checkpoint.storage.hostPath` may lie (whole path components: `/data` "
         "allows `/data/run1`, not `/data2`). Default: none, so no run gets a hostPath volume."),
    Knob("service_accounts", "serviceAccounts", ("default",),
         "Service accounts the pods may run as (`spec.resources.serviceAccountName`, unset meaning `default`): "
         "`NAME` in any namespace or `NAMESPACE/NAME`. Default: only `default`, so no run borrows a service "
         "account (and its IRSA / Pod Identity AWS role) it was not given."),
    Knob("priority_classes", "priorityClasses", (),
         "PriorityClasses the pods may name (`spec.resources.priorityClassName`); an unset one always passes and "
         "gets the cluster's default (the `globalDefault` PriorityClass, or 0). Default: none, so no run outranks "
         "(and preempts) other workloads, and nobody gets `system-node-critical`; list yours, e.g. "
         "`[training-high, training-low]`."),
    Knob("image_prefixes", "imagePrefixes", (ANY,),
         "Prefixes the trainer image (`spec.resources.image`) must start with, e.g. `<your-registry>/ml/` (end a "
         "registry or repository prefix with `/`). Default: any image. The pods run as a non-root user under Pod "
         "Security `restricted` with no API token whatever the image, and the reference recipe needs a custom "
         "image; pin your registry here when only vetted images may run."),
    Knob("toleration_keys", "tolerationKeys", (ANY,),
         "Taint keys the pods may tolerate (the `key` of each `spec.resources.tolerations` entry; `*`: any key). "
         "A toleration without a key is governed by `keylessTolerations`. The operator's own `nvidia.com/gpu` "
         "toleration is always added. Default: any key; list them where taints keep teams apart."),
    Knob("keyless_tolerations", "keylessTolerations", False,
         "Whether a toleration without a key (`operator: Exists` and no `key`) is allowed: it tolerates every "
         "taint, so the pods could land on any tainted node (another team's, control-plane, a node being "
         "drained). Default: false.", kind="bool"),
    Knob("node_labels", "nodeLabels", DEFAULT_NODE_LABELS,
         "Node label keys and values the pods may select through `spec.resources.nodeSelector`, the node "
         "affinity of `spec.resources.affinity` (required and preferred terms; `matchFields` under the key "
         "`metadata.name`) and `spec.resources.instanceType` (as `node.kubernetes.io/instance-type`): a mapping "
         "of namespace (`*`: every namespace) to label key (`*`: any key) to allowed values (`*`: any value). A "
         "namespace's own entry adds to `*`'s. `Exists`, `DoesNotExist`, `Gt` and `Lt` match every value of a "
         "key, so they need `*` among its values. Default: any value of the well-known labels that describe "
         "hardware and topology (" + ", ".join(f"`{k}`" for k in WELL_KNOWN_NODE_LABELS) + "), nothing else.",
         kind="labels"),
    Knob("scheduler_names", "schedulerNames", ("default-scheduler",),
         "Schedulers the pods may name (`spec.scheduling.schedulerName`; unset means `default-scheduler` and "
         "always passes). Default: only `default-scheduler` (Kueue needs no other); add `volcano` or "
         "`scheduler-plugins-scheduler` when that gang scheduler is installed."),
    Knob("s3_endpoint_prefixes", "s3EndpointPrefixes", ("https://",),
         "Prefixes `spec.checkpoint.storage.s3.endpoint` and `spec.data.s3.endpoint` (an S3-compatible store) must start with, e.g. "
         "`https://minio.storage.svc:9000`; AWS's own endpoints (the field unset) are always allowed. Default: any "
         "https endpoint; add an `http://` one only for a store inside the cluster network (checkpoints and signed "
         "requests travel in clear)."),
    Knob("code_loading_env", "codeLoadingEnv", (),
         "Environment variables in `spec.resources.env` that make the trainer load or run code from outside the "
         "image and that a run may set anyway: names, or `*` for all. Refused otherwise: "
         + ", ".join(f"`{e.pattern}`" for e in contract.CODE_LOADING_ENV)
         + " (what each loads: \"Code-loading environment\" below), except "
         + ", ".join(f"`{n}`" for n in sorted(contract.TUNING_ENV)) + ". Pointed at a writable claim they run "
         "whatever a spec author put there, so `imagePrefixes` would no longer bound the code that runs. Default: "
         "none."),
)
_BY_KEY = {k.key: k for k in KNOBS}


@dataclass(frozen=True)
class Policy:
    """What the admin allows; the defaults are the chart's defaults (``charts/kubetitan/values.yaml``)."""

    host_path_prefixes: tuple[str, ...] = ()
    service_accounts: tuple[str, ...] = ("default",)
    priority_classes: tuple[str, ...] = ()
    image_prefixes: tuple[str, ...] = (ANY,)
    toleration_keys: tuple[str, ...] = (ANY,)
    keyless_tolerations: bool = False
    node_labels: NodeLabels = DEFAULT_NODE_LABELS
    scheduler_names: tuple[str, ...] = ("default-scheduler",)
    s3_endpoint_prefixes: tuple[str, ...] = ("https://",)
    code_loading_env: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the operator's start-up log."""
        return "; ".join(f"{k.key}={_flag_value(k, getattr(self, k.attr)) or '(none)'}" for k in KNOBS)

    def labels_for(self, namespace: str) -> dict[str, frozenset[str]]:
        """The node label keys (``*``: any) and their allowed values (``*``: any) for runs in ``namespace``."""
        out: dict[str, set[str]] = {}
        for ns, keys in self.node_labels:
            if ns in (ANY, namespace):
                for key, values in keys:
                    out.setdefault(key, set()).update(values)
        return {k: frozenset(v) for k, v in out.items()}


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


def _allowed(values: Iterable[str]) -> str:
    values = list(values)
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
                      f"({_allowed(p.priority_classes)}); use an allowed one or leave it unset (the cluster's "
                      f"default priority), or {_fix(_BY_KEY['priorityClasses'])}", "policy.priorityClasses")]


def _image(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    image = lpt.spec.resources.image
    if ANY in p.image_prefixes or any(image.startswith(pre) for pre in p.image_prefixes):
        return []
    return [Violation("spec.resources.image",
                      f"image {image} does not start with a prefix this cluster's kubetitan policy allows "
                      f"({_allowed(p.image_prefixes)}); push the trainer image there, or "
                      f"{_fix(_BY_KEY['imagePrefixes'])}", "policy.imagePrefixes")]


def _tolerations(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    out = []
    for i, t in enumerate(lpt.spec.resources.tolerations):
        key = t.get("key") or ""
        where = f"spec.resources.tolerations[{i}]"
        if not key:
            if not p.keyless_tolerations:
                out.append(Violation(where, "a toleration without a key tolerates every taint (any team's nodes, "
                                     "control-plane nodes, nodes being drained), which this cluster's kubetitan "
                                     "policy does not allow; name the taint's key (e.g. key: dedicated, operator: "
                                     "Equal, value: <your team>), or ask the cluster admin to set the kubetitan "
                                     "chart's policy.keylessTolerations: true", "policy.keylessTolerations"))
            continue
        if ANY in p.toleration_keys or key in p.toleration_keys:
            continue
        out.append(Violation(where, f"toleration of taint key {key} is not allowed by this cluster's kubetitan "
                             f"policy (allowed keys: {_allowed(p.toleration_keys)}); remove it, or "
                             f"{_fix(_BY_KEY['tolerationKeys'])}", "policy.tolerationKeys"))
    return out


_MATCH_ALL = frozenset({"Exists", "DoesNotExist", "Gt", "Lt"})
"""Node selector operators that match (or exclude) every value of a key: allowed only where any value is."""


def _selections(lpt: LlamaPretrain) -> Iterator[tuple[str, str, str, list[str]]]:
    """(path, label key, operator, values) of every node label the spec selects on."""
    r = lpt.spec.resources
    for key, value in r.node_selector.items():
        yield f"spec.resources.nodeSelector[{key}]", key, "In", [value]
    if r.instance_type:
        yield "spec.resources.instanceType", INSTANCE_TYPE_LABEL, "In", [r.instance_type]
    node_aff = (r.affinity or {}).get("nodeAffinity") or {}
    base = "spec.resources.affinity.nodeAffinity"
    terms = [(f"{base}.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{i}]", term)
             for i, term in enumerate(((node_aff.get("requiredDuringSchedulingIgnoredDuringExecution") or {})
                                       .get("nodeSelectorTerms")) or [])]
    terms += [(f"{base}.preferredDuringSchedulingIgnoredDuringExecution[{i}].preference", pref.get("preference") or {})
              for i, pref in enumerate(node_aff.get("preferredDuringSchedulingIgnoredDuringExecution") or [])]
    for where, term in terms:
        for part in ("matchExpressions", "matchFields"):
            for j, e in enumerate(term.get(part) or []):
                yield f"{where}.{part}[{j}]", e.get("key", ""), e.get("operator", ""), list(e.get("values") or [])


def _node_labels(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    ns = lpt.metadata.namespace or "default"
    allowed = p.labels_for(ns)
    out = []
    for path, key, op, values in _selections(lpt):
        ok_values = allowed.get(key, frozenset()) | allowed.get(ANY, frozenset())
        if ANY in ok_values:
            continue
        if not ok_values:
            what = f"node label key {key}"
        elif op in _MATCH_ALL:
            what = f"{op} on node label {key} (it matches every value, and only {_allowed(sorted(ok_values))} are allowed)"
        else:
            bad = [v for v in values if v not in ok_values]
            if not bad:
                continue
            what = f"node label {key}={bad[0]}"
        out.append(Violation(path, f"{what} is not one this cluster's kubetitan policy allows runs in namespace "
                             f"{ns} to select (allowed: {_describe_labels(allowed)}); remove it, or "
                             f"{_fix(_BY_KEY['nodeLabels'])}", "policy.nodeLabels"))
    return out


def _describe_labels(allowed: Mapping[str, frozenset[str]]) -> str:
    if not allowed:
        return "none"
    return "; ".join(f"{k}: {'any value' if ANY in v else ', '.join(sorted(v)) or 'no value'}"
                     for k, v in sorted(allowed.items()))


def _scheduler(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    name = lpt.spec.scheduling.scheduler_name
    if name is None or ANY in p.scheduler_names or name in p.scheduler_names:
        return []
    return [Violation("spec.scheduling.schedulerName",
                      f"scheduler {name} is not one this cluster's kubetitan policy allows "
                      f"({_allowed(p.scheduler_names)}); leave it unset (the default scheduler), or "
                      f"{_fix(_BY_KEY['schedulerNames'])}", "policy.schedulerNames")]


def _s3_endpoint(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    out = []
    for path, s3 in (("spec.checkpoint.storage.s3.endpoint", lpt.spec.checkpoint.storage.s3),
                     ("spec.data.s3.endpoint", lpt.spec.data.s3)):
        endpoint = s3.endpoint if s3 is not None else None
        if endpoint is None or ANY in p.s3_endpoint_prefixes or any(endpoint.startswith(x) for x in p.s3_endpoint_prefixes):
            continue
        out.append(Violation(path, f"S3 endpoint {endpoint} does not start with a prefix this cluster's kubetitan "
                             f"policy allows ({_allowed(p.s3_endpoint_prefixes)}); use an https:// endpoint, or "
                             f"{_fix(_BY_KEY['s3EndpointPrefixes'])}", "policy.s3EndpointPrefixes"))
    return out


def _code_loading_env(lpt: LlamaPretrain, p: Policy) -> list[Violation]:
    if ANY in p.code_loading_env:
        return []
    out = []
    for i, e in enumerate(lpt.spec.resources.env):
        name = e.get("name") if isinstance(e, dict) else None
        if not isinstance(name, str) or name in p.code_loading_env or (rule := contract.code_loading_env(name)) is None:
            continue
        out.append(Violation(f"spec.resources.env[{i}].name",
                             f"{name} makes the trainer load code from outside its image ({rule.pattern}: "
                             f"{rule.loads}), which this cluster's kubetitan policy does not allow (allowed: "
                             f"{_allowed(p.code_loading_env)}); put the code into the image, or "
                             f"{_fix(_BY_KEY['codeLoadingEnv'])}", "policy.codeLoadingEnv"))
    return out


CHECKS: tuple[tuple[str, Callable[[LlamaPretrain, Policy], list[Violation]]], ...] = (
    ("hostPathPrefixes", _host_path),
    ("serviceAccounts", _service_account),
    ("priorityClasses", _priority_class),
    ("imagePrefixes", _image),
    ("tolerationKeys", _tolerations),  # also keylessTolerations
    ("nodeLabels", _node_labels),
    ("schedulerNames", _scheduler),
    ("s3EndpointPrefixes", _s3_endpoint),
    ("codeLoadingEnv", _code_loading_env),
)


def check(lpt: LlamaPretrain, policy: Policy) -> list[Violation]:
    """Every part of a (valid) LlamaPretrain the policy refuses, in the order of :data:`CHECKS`."""
    return [v for _, fn in CHECKS for v in fn(lpt, policy)]


# ------------------------------------------------------------------ building a policy
_LABEL_KEY = re.compile(r"^(\*|([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_NAMESPACE = re.compile(r"^(\*|[a-z0-9]([-a-z0-9]*[a-z0-9])?)$")


def _list(key: str, raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
        raise PolicyError(f"policy.{key}: expected a list of non-empty strings (or [\"*\"] for any), got {raw!r}")
    if key == "hostPathPrefixes":
        bad = [x for x in raw if x != ANY and (not x.startswith("/") or ".." in x.split("/"))]
        if bad:
            raise PolicyError(f"policy.hostPathPrefixes: {bad[0]!r} is not an absolute path without '..'; "
                              "write directories like /var/lib/kubetitan")
    return tuple(raw)


def _bool(key: str, raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise PolicyError(f"policy.{key}: expected true or false, got {raw!r}")
    return raw


def _labels(key: str, raw: Any) -> NodeLabels:
    example = '{"*": {"topology.kubernetes.io/zone": ["*"]}, "team-a": {"dedicated": ["team-a"]}}'
    if not isinstance(raw, Mapping):
        raise PolicyError(f"policy.{key}: expected a mapping of namespace to {{label key: [values]}}, e.g. "
                          f"{example}; got {raw!r}")
    for ns, keys in raw.items():
        if not isinstance(ns, str) or not _NAMESPACE.match(ns):
            raise PolicyError(f"policy.{key}: {ns!r} is not a namespace name or *")
        if not isinstance(keys, Mapping):
            raise PolicyError(f"policy.{key}.{ns}: expected a mapping of label key to a list of values, e.g. "
                              f"{example}; got {keys!r}")
        for label, values in keys.items():
            if not isinstance(label, str) or not _LABEL_KEY.match(label):
                raise PolicyError(f"policy.{key}.{ns}: {label!r} is not a label key (prefix/name) or *")
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise PolicyError(f"policy.{key}.{ns}.{label}: expected a list of values ([\"*\"] for any), "
                                  f"got {values!r}")
    return node_labels(raw)


_PARSE: dict[str, Callable[[str, Any], Any]] = {"list": _list, "bool": _bool, "labels": _labels}


def from_mapping(data: Mapping[str, Any]) -> Policy:
    """A policy from the chart's ``policy`` block (the same keys); a missing or null key keeps its default."""
    unknown = sorted(set(data) - set(_BY_KEY))
    if unknown:
        raise PolicyError(f"policy: unknown key {unknown[0]!r}; the keys are {', '.join(_BY_KEY)}")
    return Policy(**{k.attr: k.default if data.get(k.key) is None else _PARSE[k.kind](k.key, data[k.key])
                     for k in KNOBS})


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


def _flag_value(k: Knob, value: Any) -> str:
    if k.kind == "bool":
        return "true" if value else "false"
    if k.kind == "labels":
        return json.dumps(node_labels_dict(value), sort_keys=True, separators=(",", ":"))
    return ",".join(value)


def add_flags(parser: Any) -> None:
    """The operator's ``--policy-*`` flags: comma-separated lists (an empty value allows nothing), ``true`` /
    ``false``, or JSON for ``--policy-node-labels``."""
    for k in KNOBS:
        metavar = {"list": "A,B", "bool": "true|false", "labels": "JSON"}[k.kind]
        default = _flag_value(k, k.default) or "(empty: none)"
        parser.add_argument(k.flag, dest=f"policy_{k.attr}", metavar=metavar, default=None,
                            help=f"{k.help} Default: {default}.".replace("%", "%%"))


def from_flags(args: Any) -> Policy:
    """The policy of ``kubetitan operator``'s parsed ``--policy-*`` flags."""
    data: dict[str, Any] = {}
    for k in KNOBS:
        raw = getattr(args, f"policy_{k.attr}", None)
        if raw is None:
            continue
        if k.kind == "list":
            data[k.key] = [x.strip() for x in raw.split(",") if x.strip()]
        elif k.kind == "bool":
            if raw.strip().lower() not in ("true", "false"):
                raise PolicyError(f"{k.flag}: expected true or false, got {raw!r}")
            data[k.key] = raw.strip().lower() == "true"
        else:
            try:
                data[k.key] = json.loads(raw)
            except ValueError as e:
                raise PolicyError(f"{k.flag}: not JSON ({e}); e.g. "
                                  f"{k.flag}='{{\"*\":{{\"topology.kubernetes.io/zone\":[\"*\"]}}}}'") from None
    return from_mapping(data)


def flag_args(policy: Policy) -> list[str]:
    """The flags that give ``policy`` to the operator (what the chart's deployment renders), for tests."""
    return [f"{k.flag}={_flag_value(k, getattr(policy, k.attr))}" for k in KNOBS]


def default_values() -> dict[str, Any]:
    """The chart's ``policy`` block with every default (what charts/kubetitan/values.yaml holds)."""
    return {k.key: k.wire(k.default) for k in KNOBS}


def knob_table() -> Iterable[tuple[str, str, str, str]]:
    """(Helm value, operator flag, default, meaning) per knob, for docs/api.md and docs/install.md."""
    for k in KNOBS:
        if k.kind == "list":
            default = "[" + ", ".join(f'"{d}"' for d in k.default) + "]"
        elif k.kind == "bool":
            default = "false" if not k.default else "true"
        else:
            default = "well-known labels, any value (see Meaning)"
        yield (f"policy.{k.key}", k.flag, default, k.help)
