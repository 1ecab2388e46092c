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
- GAP tables: ``Accept: ...;as=Table`` (kubectl get) renders ``additionalPrinterColumns`` like the API
  server does, so printer columns can be asserted with the real kubectl.

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
import copy
import datetime as dt
import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import dicts as kdicts
from kmock._internal import parsing, rendering

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


def _now() -> str:
    return dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                      "code": code, "reason": reason, "message": message}, status=code)


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


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    printer_columns: dict[Any, list[dict[str, Any]]] = attrs.field(factory=dict)
    hooks: list[Hook] = attrs.field(factory=list)
    graceful_pod_deletion: bool = False
    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)

    # ------------------------------------------------------------------ helpers for tests
    def declare(self, resource: str, kind: str, namespaced: bool = True, status: bool = False,
                shortnames: tuple[str, ...] = (), singular: str | None = None,
                printer_columns: list[dict[str, Any]] | None = None) -> Any:
        res = kmock.resource(resource)
        self.resources[res] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, singular=singular or kind.lower(), shortnames=set(shortnames),
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            subresources={"status"} if status else set())
        if printer_columns:
            self.printer_columns[res] = printer_columns
        return res

    def get(self, resource: Any, ns: str | None, name: str) -> dict[str, Any] | None:  # type: ignore[override]
        key = (kmock.resource(resource) if isinstance(resource, str) else resource, ns, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def list(self, resource: Any, ns: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        res = kmock.resource(resource) if isinstance(resource, str) else resource
        return [copy.deepcopy(o.raw) for (r, n, _), o in list(self._objects.items())
                if r == res and not o.deleted and (ns is None or n == ns)
                and match_selector((o.raw.get("metadata") or {}).get("labels") or {}, selector)]

    async def put(self, resource: Any, obj: dict[str, Any]) -> dict[str, Any]:
        """Create an object as a client would (server-set metadata, watch event)."""
        res = kmock.resource(resource) if isinstance(resource, str) else resource
        async with self._lock:
            code, out = await self._create(res, obj["metadata"].get("namespace"), obj)
        assert code == 201, out
        return out

    async def patch_obj(self, resource: Any, ns: str | None, name: str, patch: dict[str, Any],
                        subresource: str | None = None) -> dict[str, Any]:
        """Merge-patch an object (as the kubelet patches pod status: ``subresource='status'``)."""
        res = kmock.resource(resource) if isinstance(resource, str) else resource
        async with self._lock:
            code, out = await self._patch(res, ns, name, patch, subresource)
        assert code == 200, out
        return out

    async def remove(self, resource: Any, ns: str | None, name: str) -> None:
        res = kmock.resource(resource) if isinstance(resource, str) else resource
        async with self._lock:
            await self._delete(res, ns, name, None)

    # ------------------------------------------------------------------ request dispatch
    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.resource.plural is None:
            return await super(kmock.KubernetesEmulator, self)._handle(request)  # discovery & others
        method = request.method.value if request.method else "GET"
        if method == "GET":
            # Reads go through kmock's routing (so user reactions still apply) to the overrides below.
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        for hook in list(self.hooks):
            try:
                await hook(request)
            except aiohttp.web.HTTPException as e:  # a hook may answer instead (a test's injected 403/429/503)
                return aiohttp.web.Response(status=e.status, body=e.body, headers=e.headers)
        res, ns, name, sub = request.resource, request.namespace, request.name, request.subresource
        async with self._lock:
            if method == "POST" and name is None:
                code, out = await self._create(res, ns, request.data or {})
            elif method == "PATCH" and name:
                code, out = await self._patch(res, ns, name, request.data or {}, sub)
            elif method == "PUT" and name:
                code, out = await self._replace(res, ns, name, request.data or {}, sub)
            elif method == "DELETE" and name:
                code, out = await self._delete(res, ns, name, request.data or {})
            else:
                code, out = 405, {"reason": "MethodNotAllowed", "message": f"{method} {request.url.path}"}
        if code >= 400:
            return _status(code, out["reason"], out["message"])
        return aiohttp.web.json_response(out, status=code)

    # ------------------------------------------------------------------ mutations (under self._lock)
    def _has_status(self, res: Any) -> bool:
        info = self.resources[res] if res in self.resources else None
        return info is not None and "status" in info.subresources

    def _stamp(self, raw: dict[str, Any]) -> None:
        raw.setdefault("metadata", {})["resourceVersion"] = str(next(self._rv))

    async def _emit(self, res: Any, type_: str, raw: dict[str, Any]) -> None:
        await self._buses[res].put({"type": type_, "object": copy.deepcopy(raw)})

    async def _create(self, res: Any, ns: str | None, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if ns is not None:
            meta["namespace"] = ns
        key = (res, meta.get("namespace"), meta.get("name"))
        if key in self._objects and not self._objects[key].deleted:
            return 409, {"reason": "AlreadyExists", "message": f'{res.plural} "{meta["name"]}" already exists'}
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        self._stamp(obj)
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
        await self._emit(res, "ADDED", obj)
        return 201, obj

    def _current(self, res: Any, ns: str | None, name: str) -> Any:
        key = (res, ns, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return self._objects[key]

    async def _write(self, res: Any, ns: str | None, name: str, old: dict[str, Any], new: dict[str, Any],
                     sub: str | None) -> tuple[int, dict[str, Any]]:
        if self._has_status(res):
            if sub == "status":  # only .status may change
                new = {**copy.deepcopy(old), "status": new.get("status")}
                if new["status"] is None:
                    del new["status"]
            else:  # the main resource never changes .status
                new = {k: v for k, v in new.items() if k != "status"}
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
        meta = new.setdefault("metadata", {})
        for k in ("uid", "creationTimestamp", "namespace", "name"):
            if k in old.get("metadata", {}):
                meta[k] = old["metadata"][k]
        meta["generation"] = old["metadata"].get("generation", 1) + (new.get("spec") != old.get("spec"))
        self._stamp(new)
        obj = self._objects[(res, ns, name)]
        obj.patch(kdicts_replace(obj.raw, new))
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._really_delete(res, ns, name)
            return 200, new
        await self._emit(res, "MODIFIED", new)
        return 200, new

    async def _patch(self, res: Any, ns: str | None, name: str, patch: Any, sub: str | None
                     ) -> tuple[int, dict[str, Any]]:
        obj = self._current(res, ns, name)
        if obj is None:
            return 404, {"reason": "NotFound", "message": f'{res.plural} "{name}" not found'}
        old = copy.deepcopy(obj.raw)
        if isinstance(patch, list):  # GAP: JSON patch (RFC 6902), which kopf uses for finalizers
            try:
                new = json_patch(copy.deepcopy(old), patch)
            except _PatchTestFailed as e:
                return 422, {"reason": "Invalid", "message": f"the JSON patch test failed: {e}"}
            except (KeyError, IndexError, ValueError) as e:
                return 422, {"reason": "Invalid", "message": f"cannot apply the JSON patch: {e!r}"}
        else:
            new = kdicts.patch_dict(copy.deepcopy(old), patch)
        return await self._write(res, ns, name, old, new, sub)

    async def _replace(self, res: Any, ns: str | None, name: str, body: dict[str, Any], sub: str | None
                       ) -> tuple[int, dict[str, Any]]:
        obj = self._current(res, ns, name)
        if obj is None:
            return 404, {"reason": "NotFound", "message": f'{res.plural} "{name}" not found'}
        rv = (body.get("metadata") or {}).get("resourceVersion")
        old = copy.deepcopy(obj.raw)
        if rv and rv != old["metadata"].get("resourceVersion"):
            return 409, {"reason": "Conflict", "message": "the object has been modified; please apply your "
                         "changes to the latest version and try again"}
        return await self._write(res, ns, name, old, copy.deepcopy(body), sub)

    async def _delete(self, res: Any, ns: str | None, name: str, options: dict[str, Any] | None
                      ) -> tuple[int, dict[str, Any]]:
        obj = self._current(res, ns, name)
        if obj is None:
            return 404, {"reason": "NotFound", "message": f'{res.plural} "{name}" not found'}
        raw = copy.deepcopy(obj.raw)
        grace = self._pod_grace(res, raw, options)
        if grace is not None and not raw["metadata"].get("finalizers"):
            if raw["metadata"].get("deletionGracePeriodSeconds") == grace:
                return 200, raw  # already terminating with this grace
            raw["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=grace)
            self._stamp(raw)
            obj.patch(kdicts_replace(obj.raw, raw))
            await self._emit(res, "MODIFIED", raw)
            return 200, raw
        if raw["metadata"].get("finalizers"):
            if not raw["metadata"].get("deletionTimestamp"):
                raw["metadata"]["deletionTimestamp"] = _now()
                self._stamp(raw)
                obj.patch(kdicts_replace(obj.raw, raw))
                await self._emit(res, "MODIFIED", raw)
            return 200, raw
        await self._really_delete(res, ns, name)
        return 200, raw

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
        raw = copy.deepcopy(obj.raw)
        obj.delete()
        await self._emit(res, "DELETED", raw)
        await self._collect_garbage()

    async def _collect_garbage(self) -> None:
        """Background cascading deletion of dependents whose owners are all gone."""
        while True:
            live = {(o.raw.get("metadata") or {}).get("uid") for o in self._objects.values() if not o.deleted}
            orphans = [(r, n, nm) for (r, n, nm), o in list(self._objects.items()) if not o.deleted
                       and (refs := (o.raw.get("metadata") or {}).get("ownerReferences"))
                       and all(ref.get("uid") not in live for ref in refs)]
            if not orphans:
                return
            removed = False  # orphans that only got a deletionTimestamp stay; stop once nothing went
            for r, n, nm in orphans:
                obj = self._objects[(r, n, nm)]
                if (grace := self._pod_grace(r, obj.raw, None)) is not None:
                    if obj.raw["metadata"].get("deletionTimestamp"):
                        continue  # terminating (graceful deletion): its kubelet removes it
                    raw = copy.deepcopy(obj.raw)
                    raw["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=grace)
                    self._stamp(raw)
                    obj.patch(kdicts_replace(obj.raw, raw))
                    await self._emit(r, "MODIFIED", raw)
                    continue
                if obj.raw["metadata"].get("finalizers"):
                    if not obj.raw["metadata"].get("deletionTimestamp"):
                        raw = copy.deepcopy(obj.raw)
                        raw["metadata"]["deletionTimestamp"] = _now()
                        obj.patch(kdicts_replace(obj.raw, raw))
                        await self._emit(r, "MODIFIED", raw)
                    continue
                raw = copy.deepcopy(obj.raw)
                obj.delete()
                await self._emit(r, "DELETED", raw)
                removed = True
            if not removed:
                return

    # ------------------------------------------------------------------ reads
    def _select(self, request: rendering.Request, strict: bool) -> list[dict[str, Any]]:
        selector = (request.params or {}).get("labelSelector")
        out = []
        for (r, n, nm), o in list(self._objects.items()):
            if r != request.resource or o.deleted:
                continue
            if strict and n != request.namespace or not strict and request.namespace not in (None, n):
                continue
            if request.name is not None and nm != request.name:
                continue
            if match_selector((o.raw.get("metadata") or {}).get("labels") or {}, selector):
                out.append(o.raw)
        return out

    def _as_table(self, request: rendering.Request) -> bool:
        headers = {k.lower(): v for k, v in (request.headers or {}).items()}
        return "as=Table" in headers.get("accept", "")

    def _table(self, res: Any, items: list[dict[str, Any]], list_rv: str) -> dict[str, Any]:
        cols = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                 "description": "Name of the object."}]
        extra = self.printer_columns.get(res, [{"name": "Age", "type": "date",
                                                 "jsonPath": ".metadata.creationTimestamp"}])
        cols += [{"name": c["name"], "type": c["type"], "format": c.get("format", ""),
                  "priority": c.get("priority", 0), "description": c.get("description", "")} for c in extra]
        rows = []
        for o in items:
            cells: list[Any] = [o["metadata"]["name"]]
            for c in extra:
                v = _jsonpath(o, c["jsonPath"])
                cells.append(_age(v) if c["type"] == "date" else ("<none>" if v is None else v))
            rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata",
                                                    "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}})
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": list_rv},
                "columnDefinitions": cols, "rows": rows}

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = [copy.deepcopy(o) for o in self._select(request, strict=False)]
            rv = str(next(self._rv))
        if self._as_table(request):
            return self._table(request.resource, items, rv)
        # As the API server answers: "<Kind>List" of the resource's group/version (typed clients such as kubectl
        # describe's event search decode nothing from a bare "List").
        res, info = request.resource, self.resources.get(request.resource)
        kind = f"{info.kind}List" if info is not None and info.kind else "List"
        api_version = f"{res.group}/{res.version}" if res.group else (res.version or "v1")
        return {"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": rv}, "items": items}

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            items = [copy.deepcopy(o) for o in self._select(request, strict=True)]
        if not items:
            raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
        if self._as_table(request):
            return self._table(request.resource, items, items[0]["metadata"].get("resourceVersion", ""))
        return items[0]

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""
        selector = (request.params or {}).get("labelSelector")
        async with self._lock:
            events = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in self._select(request, strict=False)]
        for e in events:
            yield e
        async for event in self._buses[request.resource]:
            meta = event.get("object", {}).get("metadata", {})
            if request.namespace not in (None, meta.get("namespace")):
                continue
            if request.name is not None and meta.get("name") != request.name:
                continue
            if not match_selector(meta.get("labels") or {}, selector):
                continue
            yield event


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


def kubeconfig(url: str) -> str:
    """A kubeconfig (YAML text) pointing at a kmock server without auth."""
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "kmock"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
    })
