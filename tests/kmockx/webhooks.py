"""kmockx calls validating admission webhooks as a real API server does.

- ``declare(k)``: the ``ValidatingWebhookConfiguration`` (admissionregistration.k8s.io/v1) and
  ``SubjectAccessReview`` (authorization.k8s.io/v1) resources. A SubjectAccessReview is answered from the
  emulator's RBAC (``kmockx.rbac.Authorizer``; every user may do everything without one: RBAC reads user and
  groups only, as the real one) and never stored; its spec (uid and extra too) is kept in ``state(k)["sars"]``.
- ``admit(k, t, obj, old, sub)``: after the schema and CEL (``KubeEmulator._admit``) and before storing, each
  configuration's webhooks whose rules match (operations, apiGroups, apiVersions, resources with subresources,
  scope, namespaceSelector, objectSelector) and whose ``matchConditions`` (CEL, cel-python) all hold get an ``AdmissionReview`` v1 over HTTPS: the server certificate is
  verified against the webhook's ``caBundle`` for the host the API server would dial (``url``'s host, or
  ``<service>.<namespace>.svc`` for a ``service`` reference: the emulator maps services to local addresses in
  ``endpoints``), ``?timeout=Ns`` on the URL and ``timeoutSeconds`` (default 10) bounding the call, the requesting
  identity as ``userInfo`` (username, groups, and uid and extra where the identity has them: ``Identity``). A refusal answers the client with the webhook's code and the API server's message
  ``admission webhook "NAME" denied the request: ...``; a call that fails (refused connection, timeout, bad
  certificate, malformed answer) answers 500 ``Internal error occurred: failed calling webhook "NAME": ...`` under
  ``failurePolicy: Fail`` (the default) and is skipped under ``Ignore``. Warnings come back to the client as
  ``Warning: 299 - "..."`` headers (kubectl prints ``Warning: ...``). With ``state(k)["client_cert"] = (certfile,
keyfile)`` every call presents that client certificate, as an API server whose AdmissionConfiguration gives it
one for the webhook's host (``kubeConfigFile``) does.

Who asks is per request (``requesting``: set by ``KubeEmulator._handle`` from the bearer token / port identity);
in-process writes (``Cluster.apply``) ask as the cluster admin.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import json
import os
import ssl
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp

VWC = "admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
SAR = "authorization.k8s.io/v1/subjectaccessreviews"


class Identity(NamedTuple):
    """Who a request authenticates as, as the API server's authenticators fill ``user.Info``: name, groups, uid
    and extra (a bound service-account token carries the account's uid and ``authentication.kubernetes.io/*``
    extras; an OIDC or impersonated user may carry any). A plain ``(user, groups)`` pair is an identity without
    uid and extra (``identity``)."""

    user: str
    groups: tuple[str, ...]
    uid: str = ""
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Sorted (key, values) pairs: hashable, and the JSON ``{key: [values]}`` of ``userInfo.extra``."""

    def user_info(self) -> dict[str, Any]:
        """``userInfo`` of an AdmissionReview request (authentication.k8s.io/v1 UserInfo): empty fields left out,
        as the API server's JSON does."""
        out: dict[str, Any] = {"username": self.user, "groups": list(self.groups)}
        if self.uid:
            out["uid"] = self.uid
        if self.extra:
            out["extra"] = {k: list(v) for k, v in self.extra}
        return out


def identity(value: Any) -> Identity:
    """An ``Identity`` from one, or from a ``(user, groups)`` pair."""
    if isinstance(value, Identity):
        return value
    user, groups, *rest = value
    return Identity(user, tuple(groups), *rest)


@dataclass
class Request:
    """The identity of the request being served, and the warnings to send back with its answer."""

    user: str
    groups: tuple[str, ...]
    warnings: list[str] = field(default_factory=list)
    uid: str = ""
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def user_info(self) -> dict[str, Any]:
        return Identity(self.user, self.groups, self.uid, self.extra).user_info()


requesting: contextvars.ContextVar[Request | None] = contextvars.ContextVar("kmockx_requesting", default=None)


@dataclass
class CallRecord:
    """One webhook call (for tests and the benchmark): which webhook, how long, and how it ended."""

    webhook: str
    seconds: float
    outcome: str  # allowed | denied | failed
    detail: str = ""


def state(k: Any) -> dict[str, Any]:
    """Per-emulator webhook state: ``endpoints`` {(namespace, service): (host, port)}, ``calls`` [CallRecord],
    ``sars`` [the spec of every SubjectAccessReview asked, as sent]."""
    st = k.webhook_state
    if not st:
        st.update(endpoints={}, calls=[], contexts={}, sars=[])
    return st


def declare(k: Any) -> None:
    k.declare(VWC, "ValidatingWebhookConfiguration", namespaced=False)
    k.declare(SAR, "SubjectAccessReview", namespaced=False)


def subject_access_review(k: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The API server's answer to a SubjectAccessReview create: its status filled in, nothing stored."""
    spec = (body or {}).get("spec") or {}
    state(k)["sars"].append(spec)
    attrs = spec.get("resourceAttributes") or {}
    user, groups = spec.get("user", ""), tuple(spec.get("groups") or ())
    if k.authorizer is None:
        allowed = True
    else:
        allowed = k.authorizer.allowed(user, groups, attrs.get("verb", ""), attrs.get("group", ""),
                                       attrs.get("resource", ""), attrs.get("subresource") or None,
                                       attrs.get("namespace") or None, attrs.get("name") or None)
    out = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "metadata": {},
           "spec": spec, "status": {"allowed": allowed}}
    if allowed:
        out["status"]["reason"] = "RBAC: allowed"
    return out


def _status(code: int, reason: str, message: str, causes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": message, "reason": reason, "code": code}
    if causes:
        out["details"] = {"causes": causes}
    return out


def _selector_matches(sel: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    if not sel:
        return True
    if any(labels.get(key) != v for key, v in (sel.get("matchLabels") or {}).items()):
        return False
    for e in sel.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        if op == "In" and labels.get(key) not in values or op == "NotIn" and labels.get(key) in values \
                or op == "Exists" and key not in labels or op == "DoesNotExist" and key in labels:
            return False
    return True


def _rule_matches(rule: dict[str, Any], op: str, t: Any, sub: str | None) -> bool:
    def has(values: list[str] | None, v: str) -> bool:
        return "*" in (values or []) or v in (values or [])

    resource = t.res.plural + (f"/{sub}" if sub else "")
    resources = rule.get("resources") or []
    res_ok = resource in resources or (not sub and "*" in resources) or \
        (sub is not None and (f"*/{sub}" in resources or f"{t.res.plural}/*" in resources)) or "*/*" in resources
    scope = rule.get("scope", "*")
    return (has(rule.get("operations"), op) and has(rule.get("apiGroups"), t.group)
            and has(rule.get("apiVersions"), t.res.version) and res_ok
            and (scope == "*" or (scope == "Namespaced") == t.namespaced))


def _matching(k: Any, t: Any, op: str, obj: dict[str, Any], old: dict[str, Any] | None,
              sub: str | None) -> list[dict[str, Any]]:
    if t.res.plural in ("validatingwebhookconfigurations", "subjectaccessreviews"):
        return []  # the API server never calls webhooks about webhook configurations
    out = []
    configs = sorted(k.list(VWC), key=lambda c: c["metadata"]["name"])
    meta = obj.get("metadata") or {}
    ns_labels: dict[str, str] = {}
    if t.namespaced and meta.get("namespace"):
        ns_obj = k.get("v1/namespaces", None, meta["namespace"]) or {}
        ns_labels = {"kubernetes.io/metadata.name": meta["namespace"],
                     **((ns_obj.get("metadata") or {}).get("labels") or {})}
    labels = {**(((old or {}).get("metadata") or {}).get("labels") or {}), **(meta.get("labels") or {})}
    for c in configs:
        for w in c.get("webhooks") or []:
            if not any(_rule_matches(r, op, t, sub) for r in w.get("rules") or []):
                continue
            if t.namespaced and not _selector_matches(w.get("namespaceSelector"), ns_labels):
                continue
            if not _selector_matches(w.get("objectSelector"), labels):
                continue
            out.append(w)
    return out


def _target(k: Any, w: dict[str, Any]) -> tuple[str, str, str]:
    """(URL the API server dials as shown in its errors, URL actually dialled, TLS server name)."""
    cc = w.get("clientConfig") or {}
    timeout = int(w.get("timeoutSeconds", 10))
    if cc.get("url"):
        url = cc["url"]
        host = aiohttp.client.URL(url).host or ""
        return f"{url}?timeout={timeout}s", f"{url}?timeout={timeout}s", host
    svc = cc.get("service") or {}
    name, ns, port, path = svc.get("name"), svc.get("namespace"), int(svc.get("port", 443)), svc.get("path", "/")
    dns = f"{name}.{ns}.svc"
    shown = f"https://{dns}:{port}{path}?timeout={timeout}s"
    addr = state(k)["endpoints"].get((ns, name))
    if addr is None:
        return shown, "", dns
    return shown, f"https://{addr[0]}:{addr[1]}{path}?timeout={timeout}s", dns


def _context(k: Any, ca_bundle: str) -> ssl.SSLContext:
    cache = state(k)["contexts"]
    client = state(k).get("client_cert")
    if (ca_bundle, client) not in cache:
        pem = base64.b64decode(ca_bundle).decode() if ca_bundle else None
        ctx = ssl.create_default_context(cadata=pem) if pem else ssl.create_default_context()
        if client is not None:
            ctx.load_cert_chain(*client)
        cache[(ca_bundle, client)] = ctx
    return cache[(ca_bundle, client)]


async def _session(k: Any) -> aiohttp.ClientSession:
    st = state(k)
    if st.get("session") is None or st["session"].closed:
        st["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    return st["session"]


async def close(k: Any) -> None:
    """Close the emulator's client session to the webhooks (at the end of a test)."""
    st = state(k)
    if st.get("session") is not None:
        await st["session"].close()


async def _call(k: Any, w: dict[str, Any], review: dict[str, Any]) -> dict[str, Any]:
    """POST the review; the webhook's ``response`` or raises ``RuntimeError`` with the API server's reason."""
    shown, url, server_name = _target(k, w)
    post = f'Post "{shown}"'
    if not url:
        raise RuntimeError(f"failed to call webhook: {post}: service \"{server_name.split('.')[0]}\" not found")
    cc = w.get("clientConfig") or {}
    session = await _session(k)
    try:
        async with session.post(url, json=review, ssl=_context(k, cc.get("caBundle", "")),
                                server_hostname=server_name,
                                timeout=aiohttp.ClientTimeout(total=float(w.get("timeoutSeconds", 10)))) as r:
            body = await r.read()
            status = r.status
    except (asyncio.TimeoutError, TimeoutError):
        raise RuntimeError(f"failed to call webhook: {post}: context deadline exceeded") from None
    except aiohttp.ClientConnectorCertificateError as e:
        raise RuntimeError(f"failed to call webhook: {post}: tls: failed to verify certificate: x509: "
                           f"{e.certificate_error}") from None
    except aiohttp.ClientConnectorError as e:
        errno = getattr(e.os_error, "errno", None)
        why = os.strerror(errno).lower() if errno else str(e)
        raise RuntimeError(f"failed to call webhook: {post}: dial tcp {e.host}:{e.port}: connect: {why}") from None
    except aiohttp.ClientError as e:
        raise RuntimeError(f"failed to call webhook: {post}: {e}") from None
    if status != 200:
        raise RuntimeError(f"failed to call webhook: the server responded with the status code {status} "
                           f"(body: {body[:200]!r})")
    try:
        answer = json.loads(body)
    except ValueError as e:
        raise RuntimeError(f"received invalid webhook response: {e}") from None
    resp = answer.get("response") if isinstance(answer, dict) else None
    if answer.get("apiVersion") != "admission.k8s.io/v1" or answer.get("kind") != "AdmissionReview":
        raise RuntimeError(f'expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got '
                           f'{answer.get("apiVersion")}, Kind={answer.get("kind")}')
    if not isinstance(resp, dict) or resp.get("uid") != review["request"]["uid"]:
        raise RuntimeError(f'expected response.uid="{review["request"]["uid"]}", got '
                           f'"{(resp or {}).get("uid", "")}"')
    return resp


async def admit(k: Any, t: Any, obj: dict[str, Any], old: dict[str, Any] | None, sub: str | None
                ) -> tuple[int, dict[str, Any]] | None:
    """Call the matching validating webhooks; None admits, else (code, Status) refuses."""
    op = "CREATE" if old is None else "UPDATE"
    hooks = _matching(k, t, op, obj, old, sub)
    if not hooks:
        return None
    who = requesting.get()
    if who is None:
        from kmockx import ADMIN

        who = Request(ADMIN, ("system:masters", "system:authenticated"))
    meta = obj.get("metadata") or {}
    gvr = {"group": t.group, "version": t.res.version, "resource": t.res.plural}
    gvk = {"group": t.group, "version": t.res.version, "kind": t.kind}
    for w in hooks:
        if "v1" not in (w.get("admissionReviewVersions") or []):
            continue  # the API server would refuse the configuration itself
        request: dict[str, Any] = {
            "uid": str(uuid.uuid4()), "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
            "name": meta.get("name", ""), "operation": op,
            "userInfo": who.user_info(),
            "object": obj, "oldObject": old, "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions" if old is None else "UpdateOptions"}}
        if t.namespaced:
            request["namespace"] = meta.get("namespace", "")
        if sub:
            request["subResource"] = sub
        started = time.perf_counter()
        name = w.get("name", "")
        matched = _match_conditions(w, request)
        if isinstance(matched, str):  # an expression that cannot be evaluated: the failure policy decides
            if w.get("failurePolicy", "Fail") == "Ignore":
                continue
            msg = f'failed calling webhook "{name}": {matched}'
            return 500, _status(500, "InternalError", f"Internal error occurred: {msg}", [{"message": msg}])
        if not matched:
            continue
        try:
            resp = await _call(k, w, {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                      "request": request})
        except RuntimeError as e:
            state(k)["calls"].append(CallRecord(name, time.perf_counter() - started, "failed", str(e)))
            if w.get("failurePolicy", "Fail") == "Ignore":
                continue  # logged by a real API server; the request goes on
            msg = f'failed calling webhook "{name}": {e}'
            return 500, _status(500, "InternalError", f"Internal error occurred: {msg}", [{"message": msg}])
        state(k)["calls"].append(CallRecord(name, time.perf_counter() - started,
                                            "allowed" if resp.get("allowed") else "denied"))
        who.warnings.extend(str(x) for x in resp.get("warnings") or [])
        if not resp.get("allowed"):
            st = resp.get("status") or {}
            code = int(st.get("code") or 0)
            code = code if code >= 400 else 400
            denied = f'admission webhook "{name}" denied the request'
            if st.get("message"):
                message = f"{denied}: {st['message']}"
            elif st.get("reason"):
                message = f"{denied}: {st['reason']}"
            else:
                message = f"{denied} without explanation"
            out = _status(code, st.get("reason", ""), message)
            if st.get("details"):
                out["details"] = st["details"]
            return code, out
    return None


def _match_conditions(w: dict[str, Any], request: dict[str, Any]) -> bool | str:
    """The webhook's ``matchConditions`` (CEL over ``object``, ``oldObject``, ``request``): True when all hold (or
    there are none), False when one is false, else why one could not be evaluated."""
    conds = w.get("matchConditions") or []
    if not conds:
        return True
    import celpy

    env = celpy.Environment()
    act = {"object": celpy.json_to_cel(request.get("object")), "oldObject": celpy.json_to_cel(request.get("oldObject")),
           "request": celpy.json_to_cel({k: v for k, v in request.items() if k not in ("object", "oldObject")})}
    for c in conds:
        try:
            ok = env.program(env.compile(c["expression"])).evaluate(act)
        except Exception as e:  # noqa: BLE001 - celpy raises its own types for compile and evaluation errors
            return f'matchCondition "{c.get("name")}" could not be evaluated: {e}'
        if isinstance(ok, celpy.CELEvalError):
            return f'matchCondition "{c.get("name")}" could not be evaluated: {ok}'
        if not bool(ok):
            return False
    return True


def warning_header(text: str) -> str:
    """A ``Warning`` header value as the API server writes it (RFC 7234 code 299, the text quoted)."""
    return '299 - "' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
