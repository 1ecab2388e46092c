"""kmockx: kmock 0.8's KubernetesEmulator with the API-server behaviour the operator relies on.

kmock (pinned 0.8) stores objects and streams watch events, but it is not an API server. This
subclass fills exactly the gaps kubetitan's tests hit; each one is marked ``GAP:`` below.

- GAP server-set metadata: ``uid``, ``resourceVersion`` (one global counter), ``generation`` (bumped on
  spec changes only), ``creationTimestamp``; names from ``generateName``.
- GAP label selectors: ``?labelSelector=`` on list and watch (``k=v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``).
- GAP status subresource: for resources declared with ``subresources={'status'}``, writes to the main
  resource ignore ``.status`` and writes to ``/status`` change only ``.status``.
- GAP garbage collection: deleting an object deletes (background, cascading) every object whose
  ownerReferences all point to deleted uids, as the kube-controller-manager's GC does.
- GAP PUT: full replacement (create-or-fail-404), with the status-subresource rules above.
- GAP paths: a named DELETE honours ``gracePeriodSeconds``-less deletes the same way; requests on a
  ``/status`` subresource address the parent object; a 409 on create and a 404 on a missing object use
  the Kubernetes ``Status`` reasons ``AlreadyExists``/``NotFound`` that clients branch on.
- GAP JSON: a body with ``NaN``/``Infinity`` (or a number beyond float64), which Python's ``json`` reads but Go's
  decoder refuses, answers 400 ``BadRequest`` as the API server does, instead of being stored.
- GAP tables: ``Accept: ...;as=Table`` (kubectl get) renders ``additionalPrinterColumns`` like the API
  server does, so printer columns can be asserted with the real kubectl.
- GAP request size: a body up to the API server's 3 MiB (``MAX_REQUEST_BODY_BYTES``) is read (aiohttp's own default
  is 1 MiB); a larger one answers 413 ``RequestEntityTooLarge`` as the API server does.

Opt-in (``graceful_pod_deletion=True``, used by tests/e2e's process-running kubelet): deleting a Pod that is
bound to a node and not finished only sets ``deletionTimestamp``/``deletionGracePeriodSeconds`` (from the
DeleteOptions, else ``spec.terminationGracePeriodSeconds``, else 30), as the API server does; the kubelet then
kills the containers and removes the object with a grace-0 delete. Grace 0 (a force delete) removes it at once.
Off by default, so tests that play the kubelet by hand keep the immediate deletes they expect.

Mutations also call ``self.hooks`` (async callables taking the parsed request) before they apply, so a
test can hold a request (e.g. "operator killed mid-reconcile").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import datetime as dt
import functools
import itertools
import json
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import dicts as kdicts
from kmock._internal import parsing, rendering

from kmockx import validation, webhooks
from kmockx.validation import StructuralSchema

Hook = Callable[[Any], Awaitable[None]]

# GAP paths: kmock 0.8's parse_path reads /api/v1/namespaces[/NAME[/status]] as "namespace NAME" and
# crashes on the bare list (kopf lists namespaces). The request parser runs before any handler, so the
# fix has to wrap this one module-level function; everything else goes through the subclass.
_parse_path = parsing.parse_path


def _fixed_parse_path(path: str) -> parsing.ParsedPath:
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 5:
        name = parts[3] if len(parts) > 3 else None
        sub = parts[4] if len(parts) > 4 else None
        if sub is None or sub in ("status", "finalize"):
            return parsing.ParsedPath("", "v1", "namespaces", None, name, sub)
    return _parse_path(path)


parsing.parse_path = _fixed_parse_path


@functools.lru_cache(maxsize=256)
def _resource(name: str) -> Any:
    """``kmock.resource(name)``, parsed once per name (the parse costs ~0.1 ms; the result is immutable)."""
    return kmock.resource(name)


_NAMESPACES = _resource("v1/namespaces")
_ATOMS = (str, int, float, bool, type(None))


def jcopy(x: Any) -> Any:
    """A deep copy of JSON data (dicts, lists, scalars), ~4x faster than ``copy.deepcopy``; anything else is
    copied by ``copy.deepcopy``. The store hands out and stores copies, so no caller shares its dicts."""
    t = type(x)
    if t is dict:
        return {k: jcopy(v) for k, v in x.items()}
    if t is list:
        return [jcopy(v) for v in x]
    if t in _ATOMS:
        return x
    return copy.deepcopy(x)


def _now() -> str:
    return dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> aiohttp.web.Response:
    body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": code,
            "reason": reason, "message": message}
    if details:
        body["details"] = details
    return aiohttp.web.json_response(body, status=code)


_SEL = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(=|==|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def match_selector(labels: dict[str, str], selector: str | None) -> bool:
    """Kubernetes label-selector syntax (the subset kopf, kubectl and the operator use)."""
    if not selector:
        return True
    parts = re.split(r",(?![^(]*\))", selector)
    for part in parts:
        m = _SEL.match(part)
        if not m:
            raise ValueError(f"unsupported label selector {part!r}")
        neg, key, op, val, setop, vals = m.groups()
        if op is None and setop is None:
            ok = (key in labels) != bool(neg)
        elif op in ("=", "=="):
            ok = labels.get(key) == val
        elif op == "!=":
            ok = labels.get(key) != val
        else:
            options = {v.strip() for v in vals.split(",")}
            ok = (labels.get(key) in options) if setop == "in" else (labels.get(key) not in options)
        if not ok:
            return False
    return True


def _jsonpath(obj: Any, path: str) -> Any:
    for part in path.strip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _age(ts: str | None) -> str:
    if not ts:
        return "<unknown>"
    secs = int((dt.datetime.now(tz=dt.UTC) - dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))).total_seconds())
    return f"{secs}s" if secs < 120 else f"{secs // 60}m"


@attrs.define
class TypeInfo:
    """One served resource: discovery data and how its objects are checked."""
    res: Any
    kind: str
    namespaced: bool = True
    singular: str = ""
    shortnames: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status: bool = False
    printer_columns: list[dict[str, Any]] | None = None
    schema: StructuralSchema | None = None  # custom resources: the CRD's structural schema
    builtin: bool = False  # built-ins: the Kubernetes OpenAPI schema (kubernetes-validate)

    @property
    def group(self) -> str:
        return self.res.group or ""

    @property
    def kind_group(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind


VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


class ApiError(Exception):
    """An in-process call (``put``/``patch_obj``/``remove``) the API refused: ``.code`` and the ``.status`` body."""

    def __init__(self, code: int, status: dict[str, Any]) -> None:
        super().__init__(f"{code}: {status.get('message')}")
        self.code, self.status = code, status


@attrs.define(kw_only=True)
class Fault:
    """An injected answer: matching requests get ``code`` (after ``delay`` seconds), by ``count`` or ``rate``.

    ``verbs``/``resource``/``namespace``/``name``/``user`` select requests (None: any), ``agent`` those whose
    User-Agent contains it (one replica of several sharing a service account); ``resource`` is a plural,
    optionally with its subresource (``llamapretrains/status``). ``code`` 0 adds only the latency (a slow server);
    ``hang=True`` never answers (the client's timeout fires). ``count`` None means unlimited; ``rate`` is the
    fraction answered (seeded RNG: reproducible). ``hits`` counts the requests it answered.
    """
    code: int = 500
    verbs: frozenset[str] | None = None
    resource: str | None = None
    namespace: str | None = None
    name: str | None = None
    user: str | None = None
    agent: str | None = None
    count: int | None = None
    rate: float = 1.0
    retry_after: int | None = None
    delay: float = 0.0
    hang: bool = False
    message: str | None = None
    hits: int = 0

    def matches(self, verb: str, resource: str, ns: str | None, name: str | None, user: str, agent: str = "") -> bool:
        return ((self.verbs is None or verb in self.verbs) and (self.resource is None or self.resource == resource)
                and (self.namespace is None or self.namespace == ns) and (self.name is None or self.name == name)
                and (self.user is None or self.user == user) and (self.agent is None or self.agent in agent)
                and (self.count is None or self.hits < self.count))


_FAULT_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict",
                  410: "Expired", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
                  503: "ServiceUnavailable", 504: "Timeout"}


def make_fault(**kw: Any) -> Fault:
    """A :class:`Fault` from its fields as keywords, ``verbs`` any iterable or one verb (the double's and the fault
    proxy's ``inject``)."""
    if kw.get("verbs") is not None:
        kw["verbs"] = frozenset([kw["verbs"]] if isinstance(kw["verbs"], str) else kw["verbs"])
    return Fault(**kw)


def pick_fault(faults: list[Fault], rng: random.Random, verb: str, resource: str, ns: str | None, name: str | None,
               user: str, agent: str = "") -> Fault | None:
    """The first of ``faults`` that matches the request and is drawn (``rate``, from ``rng``), its ``hits`` counted;
    None: the request is answered as usual. The double and the fault proxy in front of the real API server
    (support.faultproxy) pick with this."""
    for f in faults:
        if f.matches(verb, resource, ns, name, user, agent) and (f.rate >= 1.0 or rng.random() < f.rate):
            f.hits += 1
            return f
    return None


def fault_answer(fault: Fault, verb: str, resource: str) -> aiohttp.web.Response:
    """The ``Status`` answer of an injected ``fault`` (its code, the Kubernetes reason of that code, its message or a
    default, ``Retry-After`` when it has one)."""
    resp = _status(fault.code, _FAULT_REASONS.get(fault.code, "InternalError"),
                   fault.message or f"injected fault: {fault.code} for {verb} {resource}")
    if fault.retry_after is not None:
        resp.headers["Retry-After"] = str(fault.retry_after)
    return resp


@attrs.define
class LogEntry:
    """One line of the readable request log: who asked what, and what they got."""
    id: int
    user: str
    verb: str
    path: str
    code: int
    fault: bool = False
    agent: str = ""
    """The request's User-Agent (tells apart replicas that share one identity)."""
    time: float = 0.0
    """``time.monotonic()`` when the answer was sent."""
    name: str = ""
    """The object's name: the path's, or for a create the body's ``metadata.name`` (a refused create's too)."""

    def __str__(self) -> str:
        return f"#{self.id} {self.user} {self.verb} {self.path} -> {self.code}{' (injected)' if self.fault else ''}"


ADMIN = "system:admin"
ADMIN_TOKEN = "kmock"


def _field_value(obj: dict[str, Any], path: str) -> str:
    v = _jsonpath(obj, path)
    return "" if v is None else str(v)


def match_fields(obj: dict[str, Any], selector: str | None) -> bool:
    """Field selectors (``a=b``, ``a==b``, ``a!=b``, comma-separated) on any dotted field path."""
    for part in (selector or "").split(","):
        if not part.strip():
            continue
        if "!=" in part:
            k, v = part.split("!=", 1)
            if _field_value(obj, k.strip()) == v.strip():
                return False
        else:
            k, v = part.replace("==", "=").split("=", 1)
            if _field_value(obj, k.strip()) != v.strip():
                return False
    return True


def strategic_merge(old: Any, patch: Any) -> Any:
    """A strategic merge patch as kubectl sends for built-ins: maps merge, lists of named items merge by
    ``name`` (containers, env, volumes, ports by name), other lists replace; ``$``-directives are honoured for
    ``$patch: delete/replace`` and otherwise dropped."""
    if not isinstance(patch, dict) or not isinstance(old, dict):
        return jcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: v for k, v in patch.items() if not k.startswith("$")}
    out = jcopy(old)
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        if v is None:
            out.pop(k, None)
        elif isinstance(v, list) and isinstance(out.get(k), list) and v and all(
                isinstance(i, dict) and "name" in i for i in v) and all(
                isinstance(i, dict) and "name" in i for i in out[k]):
            merged = {i["name"]: i for i in out[k]}
            for item in v:
                if item.get("$patch") == "delete":
                    merged.pop(item["name"], None)
                else:
                    merged[item["name"]] = strategic_merge(merged.get(item["name"], {}), item)
            out[k] = list(merged.values())
        elif isinstance(v, dict):
            out[k] = strategic_merge(out.get(k) or {}, v)
        else:
            out[k] = jcopy(v)
    return out


def merge_patch(old: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return jcopy(patch)
    out = jcopy(old) if isinstance(old, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


_POD_MUTABLE = "`spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`," \
               "`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` " \
               "(allow it to be set to 1 if it was previously negative)"


def _pod_spec_comparable(spec: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    spec = jcopy(spec or {})
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            c.pop("image", None)
    spec.pop("activeDeadlineSeconds", None)
    spec.pop("tolerations", None)
    spec.pop("terminationGracePeriodSeconds", None)
    if not (old or {}).get("nodeName"):
        spec.pop("nodeName", None)  # binding (the scheduler's pods/binding) sets it once
    return spec


MAX_REQUEST_BODY_BYTES = 3 * 1024 * 1024
"""kube-apiserver's ``MaxRequestBodyBytes``."""


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    hooks: list[Hook] = attrs.field(factory=list)
    graceful_pod_deletion: bool = False
    faults: list[Fault] = attrs.field(factory=list)
    seed: int = 0
    log: list[LogEntry] = attrs.field(factory=list)
    identities: dict[str, Any] = attrs.field(  # token or "port:N" -> webhooks.Identity, or a (user, groups) pair
        factory=lambda: {ADMIN_TOKEN: (ADMIN, ("system:masters", "system:authenticated"))})
    authorizer: Any = None  # kmockx.rbac.Authorizer; None: every authenticated user may do everything
    webhook_state: dict[str, Any] = attrs.field(factory=dict)  # kmockx.webhooks.state
    types: dict[Any, TypeInfo] = attrs.field(factory=dict)
    k8s_version: str = validation.K8S_VERSION  # the OpenAPI schemas built-in objects are checked against
    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_rv: int = attrs.field(default=0, init=False)
    _history: Any = attrs.field(factory=lambda: collections.deque(maxlen=20000), init=False)
    _compacted_rv: int = attrs.field(default=0, init=False)
    _watchers: dict[Any, set[Any]] = attrs.field(factory=lambda: collections.defaultdict(set), init=False)
    _rng: Any = attrs.field(default=None, init=False)
    _loop: Any = attrs.field(default=None, init=False)
    _by_res: dict[Any, dict[tuple[str | None, str], Any]] = attrs.field(factory=dict, init=False)
    """The store (kmock's ``_objects``, keyed by (resource, namespace, name)) by resource: reads and webhook
    matching look at one resource's objects instead of scanning every object. Objects are never removed from the
    store (a delete marks them deleted, a create again revives them), so an entry is added once, at the first
    create of its key (``_create``), in the store's own order."""

    # ------------------------------------------------------------------ declaring resources
    def declare(self, resource: str, kind: str, namespaced: bool = True, status: bool = False,
                shortnames: tuple[str, ...] = (), singular: str | None = None,
                printer_columns: list[dict[str, Any]] | None = None, builtin: bool = False,
                schema: StructuralSchema | None = None, categories: tuple[str, ...] = ()) -> Any:
        res = kmock.resource(resource)
        self.resources[res] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, singular=singular or kind.lower(), shortnames=set(shortnames),
            verbs=set(VERBS), subresources={"status"} if status else set())
        self.types[res] = TypeInfo(res, kind, namespaced, singular or kind.lower(), tuple(shortnames),
                                   tuple(categories), status, printer_columns, schema, builtin)
        return res

    def declare_builtins(self) -> None:
        """The core kinds kubetitan and kubectl use, checked against the Kubernetes OpenAPI schema."""
        self.declare("v1/namespaces", "Namespace", namespaced=False, status=True, shortnames=("ns",), builtin=True)
        self.declare("v1/pods", "Pod", status=True, shortnames=("po",), builtin=True, categories=("all",))
        self.declare("v1/nodes", "Node", namespaced=False, status=True, shortnames=("no",), builtin=True)
        self.declare("v1/configmaps", "ConfigMap", shortnames=("cm",), builtin=True)
        self.declare("v1/secrets", "Secret", builtin=True)  # the webhook's certificates (kubetitan.certsync)
        self.declare("v1/services", "Service", status=True, shortnames=("svc",), builtin=True, categories=("all",))
        self.declare("v1/events", "Event", shortnames=("ev",), builtin=True)
        self.declare("v1/resourcequotas", "ResourceQuota", status=True, shortnames=("quota",), builtin=True)
        self.declare("events.k8s.io/v1/events", "Event", shortnames=("ev",), builtin=True)
        self.declare("coordination.k8s.io/v1/leases", "Lease", builtin=True)
        self.declare("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition",
                     namespaced=False, status=True, shortnames=("crd", "crds"), builtin=True)
        webhooks.declare(self)  # ValidatingWebhookConfiguration, SubjectAccessReview (kmockx.webhooks)

    def serve_pod_groups(self) -> None:
        """Play a Kubernetes 1.37 server with the ``GenericWorkload`` gate on and ``scheduling.k8s.io/v1beta1``
        served: PodGroups (checked against 1.37's schema, as every built-in from then on, so a pod may carry
        ``spec.schedulingGroup``). No scheduler reads them here; tests/cluster's real scheduler does."""
        self.k8s_version = "1.37.0"
        self.declare("scheduling.k8s.io/v1beta1/podgroups", "PodGroup", status=True, builtin=True)

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for v in spec["versions"]:
            if not v.get("served", True):
                continue
            schema = (v.get("schema") or {}).get("openAPIV3Schema") or {"type": "object",
                                                                         "x-kubernetes-preserve-unknown-fields": True}
            structural = StructuralSchema(schema)
            structural.compile_rules()  # as the API server compiles a CRD's CEL rules when the CRD is written
            self.declare(f"{spec['group']}/{v['name']}/{names['plural']}", names["kind"],
                         namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                         status="status" in (v.get("subresources") or {}), shortnames=tuple(names.get("shortNames", [])),
                         singular=names.get("singular"), printer_columns=v.get("additionalPrinterColumns"),
                         schema=structural, categories=tuple(names.get("categories", [])))

    def _unregister_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        for v in spec["versions"]:
            res = kmock.resource(f"{spec['group']}/{v['name']}/{spec['names']['plural']}")
            self.types.pop(res, None)
            if res in self.resources:
                del self.resources[res]

    # ------------------------------------------------------------------ faults and the request log
    def inject(self, **kw: Any) -> Fault:
        """Add a :class:`Fault` (keyword arguments as its fields; ``verbs`` any iterable) and return it."""
        fault = make_fault(**kw)
        self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        self.faults.clear()

    def expire_watches(self, resource: str | None = None) -> None:
        """Every open watch (of ``resource``, a plural, or all) gets a 410 Gone ERROR event and ends; watches
        resuming from an older resourceVersion get 410 too (as after an etcd compaction)."""
        self._compacted_rv = self._last_rv + 1  # everything up to now is gone; the next list gets a newer version
        for res, queues in list(self._watchers.items()):
            if resource is None or res.plural == resource:
                for q in list(queues):
                    self._notify(q, ("expire", None))

    def drop_watches(self, resource: str | None = None) -> None:
        """Every open watch (of ``resource`` or all) ends without an event, as when a connection drops."""
        for res, queues in list(self._watchers.items()):
            if resource is None or res.plural == resource:
                for q in list(queues):
                    self._notify(q, ("drop", None))

    def _notify(self, q: asyncio.Queue[Any], item: Any) -> None:
        """Wake a watch from the server's loop or from a test's thread."""
        if self._loop is None:
            q.put_nowait(item)
        else:
            self._loop.call_soon_threadsafe(q.put_nowait, item)

    def log_text(self) -> str:
        return "\n".join(str(e) for e in self.log)

    def _pick_fault(self, verb: str, resource: str, ns: str | None, name: str | None, user: str,
                    agent: str = "") -> Fault | None:
        if self._rng is None:
            self._rng = random.Random(self.seed)
        return pick_fault(self.faults, self._rng, verb, resource, ns, name, user, agent)

    # ------------------------------------------------------------------ helpers for tests (in-process, admin)
    def get(self, resource: Any, ns: str | None, name: str) -> dict[str, Any] | None:  # type: ignore[override]
        obj = self._current(_resource(resource) if isinstance(resource, str) else resource, ns, name)
        return None if obj is None else jcopy(obj.raw)

    def list(self, resource: Any, ns: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        res = _resource(resource) if isinstance(resource, str) else resource
        return [jcopy(o.raw) for (n, _), o in list(self._by_res.get(res, {}).items())
                if not o.deleted and (ns is None or n == ns)
                and match_selector((o.raw.get("metadata") or {}).get("labels") or {}, selector)]

    async def put(self, resource: Any, obj: dict[str, Any], admit: bool = True) -> dict[str, Any]:
        """Create an object as a client would (admission, server-set metadata, watch event); ``admit=False``
        stores it without the schema checks (an object written before its CRD tightened)."""
        res = _resource(resource) if isinstance(resource, str) else resource
        async with self._lock:
            code, out = await self._create(res, obj["metadata"].get("namespace"), obj, admit=admit)
        if code != 201:
            raise ApiError(code, out)
        return out

    async def patch_obj(self, resource: Any, ns: str | None, name: str, patch: dict[str, Any],
                        subresource: str | None = None) -> dict[str, Any]:
        """Merge-patch an object (as the kubelet patches pod status: ``subresource='status'``)."""
        res = _resource(resource) if isinstance(resource, str) else resource
        async with self._lock:
            code, out = await self._patch(res, ns, name, patch, subresource, "application/merge-patch+json")
        if code != 200:
            raise ApiError(code, out)
        return out

    async def remove(self, resource: Any, ns: str | None, name: str) -> None:
        res = _resource(resource) if isinstance(resource, str) else resource
        async with self._lock:
            await self._delete(res, ns, name, None)

    # ------------------------------------------------------------------ request dispatch
    def _authn(self, request: rendering.Request) -> webhooks.Identity | None:
        """Who asks: by bearer token, else by the port the request came in on (client-go sends no token over
        plain HTTP, so each identity also gets a server port of its own: ``identities['port:N']``)."""
        headers = {k.lower(): v for k, v in (request.headers or {}).items()}
        auth = headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if token and token in self.identities:
            return webhooks.identity(self.identities[token])
        port = request.url.port or headers.get("host", "").rpartition(":")[2]
        found = self.identities.get(f"port:{port}", self.identities.get(ADMIN_TOKEN) if not token else None)
        return None if found is None else webhooks.identity(found)

    @staticmethod
    def _verb(request: rendering.Request) -> str:
        method = request.method.value if request.method else "GET"
        watch = (request.params or {}).get("watch") in ("true", "1")
        if method == "GET":
            return "watch" if watch else ("get" if request.name else "list")
        return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(
            method, "delete" if request.name else "deletecollection")

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # GAP request size: the API server's limit, not aiohttp's 1 MiB default
        if (raw_request.content_length or 0) > MAX_REQUEST_BODY_BYTES:
            return _status(413, "RequestEntityTooLarge",
                           f"Request entity too large: limit is {MAX_REQUEST_BODY_BYTES}")
        return await super().__call__(raw_request.clone(client_max_size=MAX_REQUEST_BODY_BYTES + 1))

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path
        ident = self._authn(request)
        user = ident[0] if ident else "system:anonymous"
        res = request.resource
        verb = self._verb(request) if res is not None and res.plural is not None else "get"
        if ident is None:
            return self._answer(request, user, verb, _status(401, "Unauthorized", "Unauthorized"))
        asking = webhooks.Request(user, ident.groups, uid=ident.uid, extra=ident.extra)
        webhooks.requesting.set(asking)  # who asks, for admission webhooks' userInfo (kmockx.webhooks)
        if res is None or res.plural is None or path.startswith("/openapi") or path in ("/version", "/api", "/apis"):
            return self._answer(request, user, verb, await self._discovery(request))
        ns, name, sub = request.namespace, request.name, request.subresource
        resource = res.plural + (f"/{sub}" if sub else "")
        fault = self._pick_fault(verb, resource, ns, name, user, _agent(request))
        if fault is not None:
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.hang:
                await asyncio.sleep(3600)
            if fault.code:
                return self._answer(request, user, verb, fault_answer(fault, verb, resource), fault=True)
        t = self.types.get(res)
        if t is None:
            return self._answer(request, user, verb, _status(404, "NotFound",
                                                            "the server could not find the requested resource"))
        if self.authorizer is not None:
            denied = self.authorizer.check(user, ident[1], verb, t.group, res.plural, sub, ns if t.namespaced else None,
                                           name)
            if denied:
                return self._answer(request, user, verb, _status(403, "Forbidden", denied,
                                                                {"name": name or "", "group": t.group,
                                                                 "kind": res.plural}))
        if res.plural == "subjectaccessreviews" and verb == "create":
            return self._answer(request, user, verb, aiohttp.web.json_response(
                webhooks.subject_access_review(self, request.data or {}), status=201))
        if verb == "watch":
            return await self._watch(request, t, user)
        if verb in ("get", "list"):
            return self._answer(request, user, verb, await self._read(request, t))
        refused = self._undecodable(request, verb, t)
        if refused is not None:
            return self._answer(request, user, verb, refused)
        for hook in list(self.hooks):
            try:
                await hook(request)
            except aiohttp.web.HTTPException as e:  # a hook may answer instead (a test's injected 403/429/503)
                return self._answer(request, user, verb, aiohttp.web.Response(status=e.status, body=e.body,
                                                                              headers=e.headers), fault=True)
        strict = (request.params or {}).get("fieldValidation") == "Strict"
        ctype = {k.lower(): v for k, v in (request.headers or {}).items()}.get("content-type", "")
        async with self._lock:
            if verb == "create":
                code, out = await self._create(res, ns, request.data or {}, strict=strict)
            elif verb == "patch":
                code, out = await self._patch(res, ns, name, request.data or {}, sub, ctype, strict=strict)
            elif verb == "update":
                code, out = await self._replace(res, ns, name, request.data or {}, sub, strict=strict)
            elif verb == "delete":
                code, out = await self._delete(res, ns, name, request.data or {}, request.params or {})
            else:
                code, out = 405, {"reason": "MethodNotAllowed", "message": f"{verb} {path} is not supported"}
        if code >= 400:
            resp = (aiohttp.web.json_response(out, status=code) if out.get("kind") == "Status"
                    else _status(code, out["reason"], out["message"], out.get("details")))
        else:
            resp = aiohttp.web.json_response(out, status=code)
        for w in asking.warnings:  # admission webhooks' warnings, as the API server passes them on
            resp.headers.add("Warning", webhooks.warning_header(w))
        return self._answer(request, user, verb, resp)

    @staticmethod
    def _undecodable(request: rendering.Request, verb: str, t: TypeInfo) -> aiohttp.web.StreamResponse | None:
        """400 for a JSON body Go's decoder refuses (NaN, +-Infinity, a number beyond float64), worded as the API
        server words it; Python's ``json`` (kmock's parser) would have stored it. Create/update: the decode error
        of ``handlers.transformDecodeError``; merge patch: json-patch's "Invalid JSON Patch" ("error decoding
        patch: ..." with fieldValidation=Strict); JSON and strategic-merge patches: the decoder's own message."""
        if verb not in ("create", "update", "patch") or not request.text:
            return None
        ctype = {k.lower(): v for k, v in (request.headers or {}).items()}.get("content-type", "").split(";")[0]
        if ctype not in ("", "application/json", "application/merge-patch+json", "application/json-patch+json",
                         "application/strategic-merge-patch+json"):
            return None
        err = validation.go_json_error(request.text)
        if err is None:
            return None
        if verb != "patch":
            msg = (f"the object provided is unrecognized (must be of type {t.kind}): couldn't get version/kind; "
                   f"json parse error: {err} ({validation.summarize_body(request.text)})")
        elif ctype == "application/merge-patch+json":
            strict = (request.params or {}).get("fieldValidation") in ("Strict", "Warn")
            msg = f"error decoding patch: {err}" if strict else "Invalid JSON Patch"
        else:
            msg = err
        return _status(400, "BadRequest", msg)

    def _answer(self, request: rendering.Request, user: str, verb: str, resp: aiohttp.web.StreamResponse,
                fault: bool = False) -> aiohttp.web.StreamResponse:
        name = request.name or ""
        if not name and verb == "create" and isinstance(request.data, dict):
            name = str((request.data.get("metadata") or {}).get("name") or "")
        self.log.append(LogEntry(request.id, user, verb, str(request.url.path_qs), resp.status, fault, _agent(request),
                                 time.monotonic(), name))
        return resp

    # ------------------------------------------------------------------ discovery and OpenAPI
    def _group_versions(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for res in self.types:
            if res.group:
                out.setdefault(res.group, [])
                if res.version not in out[res.group]:
                    out[res.group].append(res.version)
        return out

    def _resource_list(self, group: str, version: str) -> dict[str, Any] | None:
        types = [t for r, t in self.types.items() if (r.group or "") == group and r.version == version]
        if not types:
            return None
        resources = []
        for t in sorted(types, key=lambda t: t.res.plural):
            resources.append({"name": t.res.plural, "singularName": t.singular, "namespaced": t.namespaced,
                              "kind": t.kind, "verbs": VERBS, "shortNames": list(t.shortnames),
                              **({"categories": list(t.categories)} if t.categories else {})})
            if t.status:
                resources.append({"name": f"{t.res.plural}/status", "singularName": "", "namespaced": t.namespaced,
                                  "kind": t.kind, "verbs": ["get", "patch", "update"]})
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version, "resources": resources}

    def _openapi_doc(self, group: str, version: str) -> dict[str, Any]:
        """Enough OpenAPI v3 for kubectl: one PATCH operation per kind that takes ``fieldValidation`` (so kubectl
        sends ``fieldValidation=Strict`` and leaves validation to this server, as with a real one)."""
        paths: dict[str, Any] = {}
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        param = {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
        for r, t in self.types.items():
            if (r.group or "") != group or r.version != version:
                continue
            gvk = {"group": group, "version": version, "kind": t.kind}
            where = f"{prefix}/namespaces/{{namespace}}/{r.plural}/{{name}}" if t.namespaced else \
                f"{prefix}/{r.plural}/{{name}}"
            paths[where] = {"patch": {"operationId": f"patch{t.kind}", "parameters": [param],
                                      "x-kubernetes-action": "patch", "x-kubernetes-group-version-kind": gvk,
                                      "responses": {"200": {"description": "OK"}}}}
        return {"openapi": "3.0.0", "info": {"title": "Kubernetes (kmockx)", "version": "v1.32.0"},
                "paths": paths, "components": {"schemas": {}}}

    async def _discovery(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        parts = request.url.path.strip("/").split("/")
        gvs = self._group_versions()
        if parts == ["version"]:
            return aiohttp.web.json_response({"major": "1", "minor": "32", "gitVersion": "v1.32.0-kmockx",
                                              "platform": "linux/amd64"})
        if parts == ["api"]:
            return aiohttp.web.json_response({"kind": "APIVersions", "versions": ["v1"],
                                              "serverAddressByClientCIDRs": []})
        if parts == ["apis"]:
            return aiohttp.web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                self._group(g, vs) for g, vs in sorted(gvs.items())]})
        if parts[0] == "apis" and len(parts) == 2 and parts[1] in gvs:
            return aiohttp.web.json_response({"kind": "APIGroup", "apiVersion": "v1",
                                              **self._group(parts[1], gvs[parts[1]])})
        if parts[0] == "api" and len(parts) == 2 or parts[0] == "apis" and len(parts) == 3:
            group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
            body = self._resource_list(group, version)
            if body is not None:
                return aiohttp.web.json_response(body)
        if parts[:2] == ["openapi", "v3"]:
            if len(parts) == 2:
                index = {("api/v1" if not g else f"apis/{g}/{v}"): {"serverRelativeURL": "/openapi/v3/" + (
                    "api/v1" if not g else f"apis/{g}/{v}") + f"?hash={self._last_rv}"}
                    for g, vs in [("", ["v1"]), *gvs.items()] for v in vs}
                return aiohttp.web.json_response({"paths": index})
            sub = parts[2:]
            if sub[:1] == ["api"] and len(sub) == 2:
                return aiohttp.web.json_response(self._openapi_doc("", sub[1]))
            if sub[:1] == ["apis"] and len(sub) == 3 and sub[1] in gvs:
                return aiohttp.web.json_response(self._openapi_doc(sub[1], sub[2]))
        return _status(404, "NotFound", "the server could not find the requested resource")

    @staticmethod
    def _group(g: str, versions: list[str]) -> dict[str, Any]:
        return {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in versions],
                "preferredVersion": {"groupVersion": f"{g}/{versions[0]}", "version": versions[0]}}

    # ------------------------------------------------------------------ admission (under self._lock)
    def _has_status(self, res: Any) -> bool:
        t = self.types.get(res)
        return t is not None and t.status

    def _admit(self, t: TypeInfo, obj: dict[str, Any], old: dict[str, Any] | None, sub: str | None,
               strict: bool) -> tuple[int, dict[str, Any]] | None:
        """None when ``obj`` may be stored (defaults applied and unknown fields pruned in place), else the refusal."""
        meta = obj.get("metadata") or {}
        name = meta.get("name") or ""
        causes = [] if old is not None else validation.meta_errors(t.res.plural, meta)
        if old is not None:
            causes += [c for c in validation.meta_errors(t.res.plural, meta) if c.field != "metadata.name"]
        unknown: list[str] = []
        if t.schema is not None:
            more, unknown = t.schema.apply(obj, old)
            causes += more
            if not strict:
                unknown = []  # pruned silently, as the API server does without fieldValidation=Strict
        elif t.builtin:
            obj.setdefault("apiVersion", f"{t.group}/{t.res.version}" if t.group else t.res.version)
            obj.setdefault("kind", t.kind)
            more, unknown = validation.builtin_errors(obj, self.k8s_version)
            causes += [c for c in more if not (c.reason == "FieldValueRequired" and c.field.startswith("status"))]
        if unknown:
            what = ", ".join(f'unknown field "{u}"' for u in unknown)
            gv = f"{t.group}/{t.res.version}" if t.group else t.res.version
            return 400, {"reason": "BadRequest",
                         "message": f'{t.kind} in version "{gv}" cannot be handled as a {t.kind}: '
                                    f"strict decoding error: {what}"}
        if old is not None:
            causes += self._immutable(t, obj, old)
        if causes:
            return 422, validation.invalid_status(t.kind_group, name, causes, t.group, t.kind)
        return None

    def _immutable(self, t: TypeInfo, new: dict[str, Any], old: dict[str, Any]) -> list[validation.Cause]:
        if t.res.plural == "pods" and _pod_spec_comparable(new.get("spec"), old.get("spec")) != \
                _pod_spec_comparable(old.get("spec"), old.get("spec")):
            return [validation.Cause("spec", "FieldValueForbidden",
                                     f"Forbidden: pod updates may not change fields other than {_POD_MUTABLE}")]
        if t.res.plural == "configmaps" and old.get("immutable"):
            out = []
            for k in ("data", "binaryData"):
                if new.get(k) != old.get(k):
                    out.append(validation.Cause(k, "FieldValueForbidden",
                                                "Forbidden: field is immutable when `immutable` is set"))
            if not new.get("immutable"):
                out.append(validation.Cause("immutable", "FieldValueForbidden",
                                            "Forbidden: field is immutable when `immutable` is set"))
            return out
        if t.res.plural == "services" and (old.get("spec") or {}).get("clusterIP") and \
                (new.get("spec") or {}).get("clusterIP") not in (None, "", old["spec"]["clusterIP"]):
            return [validation.Cause("spec.clusterIP", "FieldValueInvalid",
                                     f"Invalid value: {json.dumps(new['spec']['clusterIP'])}: field is immutable")]
        return []

    # ------------------------------------------------------------------ mutations (under self._lock)
    def _stamp(self, raw: dict[str, Any]) -> None:
        self._last_rv = next(self._rv)
        raw.setdefault("metadata", {})["resourceVersion"] = str(self._last_rv)

    async def _emit(self, res: Any, type_: str, raw: dict[str, Any]) -> None:
        event = {"type": type_, "object": jcopy(raw)}
        rv = int((raw.get("metadata") or {}).get("resourceVersion") or self._last_rv)
        self._history.append((rv, res, event))
        for q in list(self._watchers.get(res, ())):
            q.put_nowait(("event", event))
        await self._buses[res].put(event)  # kmock's own stream (kept for kmock-level consumers)

    async def _create(self, res: Any, ns: str | None, obj: dict[str, Any], strict: bool = False,
                      admit: bool = True) -> tuple[int, dict[str, Any]]:
        t = self.types.get(res)
        if t is None:
            return 404, {"reason": "NotFound", "message": "the server could not find the requested resource"}
        obj = jcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if t.namespaced:
            if ns is not None and meta.get("namespace") not in (None, ns):
                return 400, {"reason": "BadRequest", "message": "the namespace of the provided object does not "
                             "match the namespace sent on the request"}
            meta["namespace"] = ns or meta.get("namespace") or "default"
            if res.plural != "namespaces" and self._current(_NAMESPACES, None, meta["namespace"]) is None \
                    and any(r.plural == "namespaces" for r in self.types):
                return 404, {"reason": "NotFound", "message": f'namespaces "{meta["namespace"]}" not found',
                             "details": {"name": meta["namespace"], "kind": "namespaces"}}
        else:
            meta.pop("namespace", None)
        if self._has_status(res) and res.plural not in ("pods", "nodes", "namespaces", "services"):
            obj.pop("status", None)  # custom resources: status is written through /status only
        if admit:
            refused = self._admit(t, obj, None, None, strict) or await webhooks.admit(self, t, obj, None, None)
            if refused:
                return refused
        key = (res, meta.get("namespace"), meta.get("name"))
        if key in self._objects and not self._objects[key].deleted:
            return 409, {"reason": "AlreadyExists", "message": f'{res.plural}{"." + t.group if t.group else ""} '
                         f'"{meta["name"]}" already exists',
                         "details": {"name": meta["name"], "group": t.group, "kind": res.plural}}
        for k in ("resourceVersion", "uid", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(k, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        self._stamp(obj)
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
            self._by_res.setdefault(res, {})[key[1:]] = self._objects[key]
        if res.plural == "customresourcedefinitions":
            self._register_crd(obj)
        await self._emit(res, "ADDED", obj)
        return 201, obj

    def _current(self, res: Any, ns: str | None, name: str) -> Any:
        key = (res, ns, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return self._objects[key]

    def _not_found(self, res: Any, name: str) -> tuple[int, dict[str, Any]]:
        t = self.types.get(res)
        g = "." + t.group if t is not None and t.group else ""
        return 404, {"reason": "NotFound", "message": f'{res.plural}{g} "{name}" not found',
                     "details": {"name": name, "group": t.group if t else "", "kind": res.plural}}

    def _conflict(self, res: Any, name: str) -> tuple[int, dict[str, Any]]:
        t = self.types.get(res)
        g = "." + t.group if t is not None and t.group else ""
        return 409, {"reason": "Conflict", "message": f'Operation cannot be fulfilled on {res.plural}{g} "{name}": '
                     "the object has been modified; please apply your changes to the latest version and try again",
                     "details": {"name": name, "group": t.group if t else "", "kind": res.plural}}

    async def _write(self, res: Any, ns: str | None, name: str, old: dict[str, Any], new: dict[str, Any],
                     sub: str | None, strict: bool = False) -> tuple[int, dict[str, Any]]:
        if self._has_status(res):
            if sub == "status":  # only .status may change
                new = {**jcopy(old), "status": new.get("status")}
                if new["status"] is None:
                    del new["status"]
            else:  # the main resource never changes .status
                new = {k: v for k, v in new.items() if k != "status"}
                if "status" in old:
                    new["status"] = jcopy(old["status"])
        meta = new.setdefault("metadata", {})
        for k in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp", "deletionGracePeriodSeconds"):
            if k in old.get("metadata", {}):
                meta[k] = old["metadata"][k]
            else:
                meta.pop(k, None)
        t = self.types[res]
        candidate = jcopy(new)
        refused = self._admit(t, candidate, old, sub, strict) or await webhooks.admit(self, t, candidate, old, sub)
        if refused:
            return refused
        if sub == "status" and self._has_status(res):  # a status write changes .status only (even when the
            if "status" in candidate:                   # stored spec predates the schema: no pruning there)
                new["status"] = candidate["status"]
        else:
            new = candidate
            meta = new["metadata"]
        meta["generation"] = old["metadata"].get("generation", 1) + (new.get("spec") != old.get("spec"))
        if new == {**old, "metadata": {**old["metadata"], "generation": meta["generation"]}}:
            return 200, jcopy(old)  # a no-op write changes nothing (no new resourceVersion, no event)
        self._stamp(new)
        obj = self._objects[(res, ns, name)]
        obj.patch(kdicts_replace(obj.raw, new))
        if res.plural == "customresourcedefinitions":
            self._register_crd(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._really_delete(res, ns, name)
            return 200, new
        await self._emit(res, "MODIFIED", new)
        return 200, new

    async def _patch(self, res: Any, ns: str | None, name: str, patch: Any, sub: str | None, ctype: str = "",
                     strict: bool = False) -> tuple[int, dict[str, Any]]:
        obj = self._current(res, ns, name)
        if obj is None:
            return self._not_found(res, name)
        old = jcopy(obj.raw)
        if isinstance(patch, list):  # JSON patch (RFC 6902), which kopf uses for finalizers
            try:
                new = json_patch(jcopy(old), patch)
            except _PatchTestFailed as e:
                return 422, {"reason": "Invalid", "message": f"the JSON patch test failed: {e}"}
            except (KeyError, IndexError, ValueError) as e:
                return 422, {"reason": "Invalid", "message": f"cannot apply the JSON patch: {e!r}"}
        else:
            rv = ((patch or {}).get("metadata") or {}).get("resourceVersion")
            if rv and rv != old["metadata"].get("resourceVersion"):
                return self._conflict(res, name)
            if "strategic-merge-patch" in ctype:
                t = self.types.get(res)
                if t is not None and t.schema is not None:
                    return 415, {"reason": "UnsupportedMediaType", "message": "the body of the request was in an "
                                 "unknown format - accepted media types include: application/json-patch+json, "
                                 "application/merge-patch+json, application/apply-patch+yaml"}
                new = strategic_merge(old, patch)
            else:
                new = merge_patch(old, patch)
        return await self._write(res, ns, name, old, new, sub, strict)

    async def _replace(self, res: Any, ns: str | None, name: str, body: dict[str, Any], sub: str | None,
                       strict: bool = False) -> tuple[int, dict[str, Any]]:
        obj = self._current(res, ns, name)
        if obj is None:
            return self._not_found(res, name)
        rv = (body.get("metadata") or {}).get("resourceVersion")
        old = jcopy(obj.raw)
        if not rv and res.plural not in ("events",):
            return 422, validation.invalid_status(self.types[res].kind_group, name, [validation.invalid(
                "metadata.resourceVersion", "", "must be specified for an update")], self.types[res].group,
                self.types[res].kind)
        if rv and rv != old["metadata"].get("resourceVersion"):
            return self._conflict(res, name)
        return await self._write(res, ns, name, old, jcopy(body), sub, strict)

    async def _delete(self, res: Any, ns: str | None, name: str, options: dict[str, Any] | None,
                      params: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        obj = self._current(res, ns, name)
        if obj is None:
            return self._not_found(res, name)
        options = {**{k: v for k, v in (params or {}).items() if k in ("propagationPolicy", "gracePeriodSeconds")},
                   **(options or {})}
        raw = jcopy(obj.raw)
        pre = (options.get("preconditions") or {})
        if pre.get("resourceVersion") and pre["resourceVersion"] != raw["metadata"].get("resourceVersion") or \
                pre.get("uid") and pre["uid"] != raw["metadata"].get("uid"):
            return self._conflict(res, name)
        grace = self._pod_grace(res, raw, options)
        policy = options.get("propagationPolicy") or "Background"
        if policy == "Foreground" and self._dependents(raw["metadata"].get("uid")):
            fins = raw["metadata"].setdefault("finalizers", [])
            if "foregroundDeletion" not in fins:
                fins.append("foregroundDeletion")
        elif policy == "Orphan":
            await self._orphan(raw["metadata"].get("uid"))
        if grace is not None and not raw["metadata"].get("finalizers"):
            if raw["metadata"].get("deletionGracePeriodSeconds") == grace:
                return 200, raw  # already terminating with this grace
            raw["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=grace)
            self._stamp(raw)
            obj.patch(kdicts_replace(obj.raw, raw))
            await self._emit(res, "MODIFIED", raw)
            return 200, raw
        if raw["metadata"].get("finalizers"):
            if not raw["metadata"].get("deletionTimestamp") or raw != obj.raw:
                raw["metadata"].setdefault("deletionTimestamp", _now())
                self._stamp(raw)
                obj.patch(kdicts_replace(obj.raw, raw))
                await self._emit(res, "MODIFIED", raw)
            await self._collect_garbage()
            return 200, raw
        await self._really_delete(res, ns, name)
        return 200, raw

    def _dependents(self, uid: str | None) -> list[tuple[Any, Any, Any]]:
        return [k for k, o in list(self._objects.items()) if not o.deleted and any(
            ref.get("uid") == uid for ref in (o.raw.get("metadata") or {}).get("ownerReferences") or [])]

    async def _orphan(self, uid: str | None) -> None:
        for key in self._dependents(uid):
            obj = self._objects[key]
            raw = jcopy(obj.raw)
            raw["metadata"]["ownerReferences"] = [r for r in raw["metadata"]["ownerReferences"] if r.get("uid") != uid]
            if not raw["metadata"]["ownerReferences"]:
                del raw["metadata"]["ownerReferences"]
            self._stamp(raw)
            obj.patch(kdicts_replace(obj.raw, raw))
            await self._emit(key[0], "MODIFIED", raw)

    def _pod_grace(self, res: Any, raw: dict[str, Any], options: dict[str, Any] | None) -> int | None:
        """Grace seconds when this delete of a Pod is graceful (opt-in), None when it removes the object now."""
        if not self.graceful_pod_deletion or res.plural != "pods":
            return None
        spec, meta = raw.get("spec") or {}, raw["metadata"]
        grace = (options or {}).get("gracePeriodSeconds")
        grace = int(spec.get("terminationGracePeriodSeconds", 30) if grace is None else grace)
        if not spec.get("nodeName") or (raw.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return None  # unscheduled or finished pods go at once, as on the API server
        if meta.get("deletionTimestamp") is not None:  # already terminating: only a shorter grace changes it
            grace = min(grace, int(meta.get("deletionGracePeriodSeconds") or 0))
        return grace if grace > 0 else None

    async def _really_delete(self, res: Any, ns: str | None, name: str) -> None:
        obj = self._objects[(res, ns, name)]
        raw = jcopy(obj.raw)
        obj.delete()
        if res.plural == "customresourcedefinitions":
            self._unregister_crd(raw)
        await self._emit(res, "DELETED", raw)
        await self._collect_garbage()

    async def _collect_garbage(self) -> None:
        """The garbage collector: background deletion of dependents whose owners are all gone; foreground
        deletion of the dependents of owners marked ``foregroundDeletion``, then of the owner itself."""
        while True:
            live = {(o.raw.get("metadata") or {}).get("uid") for o in self._objects.values() if not o.deleted}
            fg = {(o.raw.get("metadata") or {}).get("uid") for o in self._objects.values() if not o.deleted
                  and "foregroundDeletion" in ((o.raw.get("metadata") or {}).get("finalizers") or [])}
            orphans = [(r, n, nm) for (r, n, nm), o in list(self._objects.items()) if not o.deleted
                       and (refs := (o.raw.get("metadata") or {}).get("ownerReferences"))
                       and (all(ref.get("uid") not in live for ref in refs)
                            or any(ref.get("uid") in fg for ref in refs))]
            removed = False
            for r, n, nm in orphans:  # orphans that only got a deletionTimestamp stay; stop once nothing went
                obj = self._objects[(r, n, nm)]
                if (grace := self._pod_grace(r, obj.raw, None)) is not None:
                    if obj.raw["metadata"].get("deletionTimestamp"):
                        continue  # terminating (graceful deletion): its kubelet removes it
                    raw = jcopy(obj.raw)
                    raw["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=grace)
                    self._stamp(raw)
                    obj.patch(kdicts_replace(obj.raw, raw))
                    await self._emit(r, "MODIFIED", raw)
                    continue
                if obj.raw["metadata"].get("finalizers"):
                    if not obj.raw["metadata"].get("deletionTimestamp"):
                        raw = jcopy(obj.raw)
                        raw["metadata"]["deletionTimestamp"] = _now()
                        self._stamp(raw)
                        obj.patch(kdicts_replace(obj.raw, raw))
                        await self._emit(r, "MODIFIED", raw)
                    continue
                raw = jcopy(obj.raw)
                obj.delete()
                await self._emit(r, "DELETED", raw)
                removed = True
            for key, o in list(self._objects.items()):  # foreground owners whose dependents are all gone
                if o.deleted:
                    continue
                meta = o.raw.get("metadata") or {}
                if "foregroundDeletion" in (meta.get("finalizers") or []) \
                        and meta.get("deletionTimestamp") and not self._dependents(meta.get("uid")):
                    raw = jcopy(o.raw)
                    raw["metadata"]["finalizers"] = [f for f in meta["finalizers"] if f != "foregroundDeletion"]
                    if raw["metadata"]["finalizers"]:
                        self._stamp(raw)
                        o.patch(kdicts_replace(o.raw, raw))
                        await self._emit(key[0], "MODIFIED", raw)
                    else:
                        o.delete()
                        await self._emit(key[0], "DELETED", raw)
                        removed = True
            if not removed:
                return

    # ------------------------------------------------------------------ reads
    def _select(self, request: rendering.Request, strict: bool) -> list[dict[str, Any]]:
        selector = (request.params or {}).get("labelSelector")
        fields = (request.params or {}).get("fieldSelector")
        out = []
        stored = self._by_res.get(request.resource, {})
        if strict and request.name is not None:  # a GET by name: one lookup
            found = stored.get((request.namespace, request.name))
            stored = {} if found is None else {(request.namespace, request.name): found}
        for (n, nm), o in list(stored.items()):
            if o.deleted:
                continue
            if strict and n != request.namespace or not strict and request.namespace not in (None, n):
                continue
            if request.name is not None and nm != request.name:
                continue
            if match_selector((o.raw.get("metadata") or {}).get("labels") or {}, selector) \
                    and match_fields(o.raw, fields):
                out.append(o.raw)
        return out

    def _as_table(self, request: rendering.Request) -> bool:
        headers = {k.lower(): v for k, v in (request.headers or {}).items()}
        return "as=Table" in headers.get("accept", "")

    def _table(self, res: Any, items: list[dict[str, Any]], list_rv: str, headers: bool = True) -> dict[str, Any]:
        cols = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                 "description": "Name of the object."}]
        t = self.types.get(res)
        extra = (t.printer_columns if t is not None and t.printer_columns else None) or \
            _BUILTIN_COLUMNS.get(res.plural) or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        cols += [{"name": c["name"], "type": c["type"], "format": c.get("format", ""),
                  "priority": c.get("priority", 0), "description": c.get("description", "")} for c in extra]
        rows = []
        for o in items:
            cells: list[Any] = [o["metadata"]["name"]]
            for c in extra:
                v = c["fn"](o) if "fn" in c else _jsonpath(o, c["jsonPath"])
                cells.append(_age(v) if c["type"] == "date" else ("<none>" if v is None else v))
            rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata",
                                                    "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}})
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": list_rv},
                "columnDefinitions": cols if headers else [], "rows": rows}

    async def _read(self, request: rendering.Request, t: TypeInfo) -> aiohttp.web.StreamResponse:
        if request.name is None:
            async with self._lock:
                items = [jcopy(o) for o in self._select(request, strict=False)]
                if self._last_rv < self._compacted_rv:
                    self._last_rv = next(self._rv)
                rv = str(self._last_rv)
            if self._as_table(request):
                return aiohttp.web.json_response(self._table(request.resource, items, rv))
            gv = f"{t.group}/{t.res.version}" if t.group else t.res.version
            return aiohttp.web.json_response({"apiVersion": gv, "kind": f"{t.kind}List",
                                              "metadata": {"resourceVersion": rv}, "items": items})
        async with self._lock:
            items = [jcopy(o) for o in self._select(request, strict=True)]
        if not items:
            code, body = self._not_found(request.resource, request.name)
            return _status(code, body["reason"], body["message"], body["details"])
        if self._as_table(request):
            return aiohttp.web.json_response(self._table(request.resource, items,
                                                         items[0]["metadata"].get("resourceVersion", "")))
        return aiohttp.web.json_response(items[0])

    def _watch_match(self, request: rendering.Request, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        return (request.namespace in (None, meta.get("namespace")) and request.name in (None, meta.get("name"))
                and match_selector(meta.get("labels") or {}, (request.params or {}).get("labelSelector"))
                and match_fields(obj, (request.params or {}).get("fieldSelector")))

    async def _watch(self, request: rendering.Request, t: TypeInfo, user: str) -> aiohttp.web.StreamResponse:
        params = request.params or {}
        rv = params.get("resourceVersion") or ""
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        async with self._lock:
            if rv not in ("", "0"):
                start = int(rv) if rv.isdigit() else 0
                oldest = self._history[0][0] if self._history else self._last_rv + 1
                if start < self._compacted_rv or start < oldest - 1 and start < self._last_rv:
                    initial = None
                else:
                    initial = [e for (erv, r, e) in self._history if r == t.res and erv > start
                               and self._watch_match(request, e["object"])]
            else:
                initial = [{"type": "ADDED", "object": jcopy(o)} for o in self._select(request, strict=False)]
            self._watchers[t.res].add(queue)
        resp = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        self._answer(request, user, "watch", resp)
        try:
            await resp.prepare(request._raw_request)
            table = self._as_table(request)

            async def send(event: dict[str, Any]) -> None:
                if table and event["type"] != "ERROR":
                    event = {"type": event["type"], "object": self._table(t.res, [event["object"]],
                             event["object"]["metadata"].get("resourceVersion", ""))}
                await resp.write(json.dumps(event).encode() + b"\n")

            for e in initial if initial is not None else [_gone(rv)]:
                await send(e)
            timeout = 0.0 if initial is None else float(params["timeoutSeconds"]) if params.get("timeoutSeconds") \
                else None
            deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
            while True:
                left = None if deadline is None else deadline - asyncio.get_running_loop().time()
                if left is not None and left <= 0:
                    break
                try:
                    kind, event = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    break
                if kind == "drop":
                    break
                if kind == "expire":
                    await send(_gone(rv))
                    break
                if self._watch_match(request, event["object"]):
                    await send(event)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers[t.res].discard(queue)
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await resp.write_eof()
        return resp


def _agent(request: rendering.Request) -> str:
    return next((v for k, v in (request.headers or {}).items() if k.lower() == "user-agent"), "")


def _gone(rv: str) -> dict[str, Any]:
    return {"type": "ERROR", "object": {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                        "code": 410, "reason": "Expired",
                                        "message": f"too old resource version: {rv}"}}


def _pod_ready(o: dict[str, Any]) -> str:
    cs = (o.get("status") or {}).get("containerStatuses") or []
    n = len((o.get("spec") or {}).get("containers") or [])
    return f"{sum(1 for c in cs if c.get('ready'))}/{n}"


def _pod_status(o: dict[str, Any]) -> str:
    if (o.get("metadata") or {}).get("deletionTimestamp"):
        return "Terminating"
    for c in (o.get("status") or {}).get("containerStatuses") or []:
        st = c.get("state") or {}
        if "waiting" in st and st["waiting"].get("reason"):
            return st["waiting"]["reason"]
        if "terminated" in st and st["terminated"].get("reason"):
            return st["terminated"]["reason"]
    return (o.get("status") or {}).get("phase") or "Pending"


_BUILTIN_COLUMNS: dict[str, list[dict[str, Any]]] = {
    "pods": [{"name": "Ready", "type": "string", "fn": _pod_ready},
             {"name": "Status", "type": "string", "fn": _pod_status},
             {"name": "Restarts", "type": "integer", "fn": lambda o: sum(
                 c.get("restartCount", 0) for c in (o.get("status") or {}).get("containerStatuses") or [])},
             {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
             {"name": "IP", "type": "string", "priority": 1, "jsonPath": ".status.podIP"},
             {"name": "Node", "type": "string", "priority": 1, "jsonPath": ".spec.nodeName"}],
    "events": [{"name": "Type", "type": "string", "jsonPath": ".type"},
               {"name": "Reason", "type": "string", "jsonPath": ".reason"},
               {"name": "Object", "type": "string", "fn": lambda o: "{}/{}".format(
                   ((o.get("involvedObject") or {}).get("kind") or "").lower(), (o.get("involvedObject") or {}).get("name"))},
               {"name": "Message", "type": "string", "jsonPath": ".message"}],
}


class _PatchTestFailed(Exception):
    pass


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 with the ops kopf sends: test, add, replace, remove."""
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1] if parts else None
        if op["op"] == "test":
            cur = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if cur != op.get("value"):
                raise _PatchTestFailed(f"{op['path']} is {cur!r}, not {op.get('value')!r}")
        elif op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif op["op"] == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise ValueError(f"unsupported op {op['op']}")
    return doc


def kdicts_replace(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A kmock patch (None deletes a key) that turns ``old`` into exactly ``new``."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out: dict[str, Any] = {k: None for k in old.keys() - new.keys()}
    for k, v in new.items():
        out[k] = kdicts_replace(old[k], v) if k in old and isinstance(old[k], dict) and isinstance(v, dict) else v
    return out


def kubeconfig(url: str, token: str = ADMIN_TOKEN, user: str = "kmock") -> str:
    """A kubeconfig (YAML text) pointing at a kmockx server, authenticating with a bearer ``token``."""
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": user, "namespace": "default"}}],
    })
