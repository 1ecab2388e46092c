"""The operator's own ValidatingWebhookConfiguration as the chart renders it, and the drift from it (pure).

With ``--webhook-certificates operator`` the operator may update the one configuration the chart ships (RBAC:
get/update on that name only). Kubernetes has no field-level RBAC, so that grant lets whoever holds the operator's
credentials rewrite the whole object: add a ``secrets`` rule (every Secret create in the cluster then goes to, and
may be blocked by, this webhook), widen its scope, flip ``failurePolicy`` to ``Ignore`` or point ``clientConfig``
elsewhere. The operator keeps only ``caBundle`` as its own; every other field is the chart's, which the chart
hands to the operator as ``--webhook-configuration-webhooks`` (the same template renders both). Each certificate
round (``kubetitan.certsync``) compares the live webhooks with them and puts back any difference, with a Warning
Event naming what it restored.

The API server fills defaults into a stored webhook (``scope: "*"``, ``matchPolicy: Equivalent``, empty selectors,
``timeoutSeconds: 10``, service port 443); :func:`normalise` applies the same defaults to both sides, so a default
is never taken for drift.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

API_DEFAULTS: dict[str, Any] = {
    "failurePolicy": "Fail",
    "matchPolicy": "Equivalent",
    "namespaceSelector": {},
    "objectSelector": {},
    "timeoutSeconds": 10,
    "matchConditions": [],
}
"""admissionregistration.k8s.io/v1 defaults of a ValidatingWebhook (``SetDefaults_ValidatingWebhook``), plus an
absent ``matchConditions`` read as none."""

FIELDS: tuple[str, ...] = ("admissionReviewVersions", "sideEffects", "failurePolicy", "timeoutSeconds", "matchPolicy",
                           "namespaceSelector", "objectSelector", "matchConditions", "rules", "clientConfig")
"""The webhook fields compared (``name`` identifies the webhook; ``clientConfig.caBundle`` is the operator's own)."""


def normalise(webhook: Mapping[str, Any]) -> dict[str, Any]:
    """``webhook`` as the API server stores it, less ``caBundle``: its defaults filled in, unknown keys kept."""
    w = copy.deepcopy(dict(webhook))
    for k, v in API_DEFAULTS.items():
        if w.get(k) is None:
            w[k] = copy.deepcopy(v)
    for rule in w.get("rules") or []:
        rule.setdefault("scope", "*")
    cc = w.setdefault("clientConfig", {})
    cc.pop("caBundle", None)
    if isinstance(cc.get("service"), dict):
        cc["service"].setdefault("port", 443)
    return w


def parse(text: str) -> tuple[dict[str, Any], ...]:
    """The webhooks of ``--webhook-configuration-webhooks`` (a JSON list of ValidatingWebhooks, each with a name);
    ValueError saying what is wrong."""
    try:
        out = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(out, list) or not out or not all(isinstance(w, dict) and w.get("name") for w in out):
        raise ValueError("must be a non-empty JSON list of ValidatingWebhooks, each with a name")
    names = [w["name"] for w in out]
    if len(set(names)) != len(names):
        raise ValueError(f"webhook names must be unique, got {names}")
    return tuple(out)


def drift(live: Sequence[Mapping[str, Any]], want: Sequence[Mapping[str, Any]]) -> list[str]:
    """What differs between the live webhooks and the chart's, one phrase each (empty: nothing but caBundle)."""
    have = {w.get("name"): normalise(w) for w in live}
    wanted = {w["name"]: normalise(w) for w in want}
    out = [f"webhook {n} added" for n in have if n not in wanted]
    out += [f"webhook {n} removed" for n in wanted if n not in have]
    for name, w in wanted.items():
        h = have.get(name)
        if h is None:
            continue
        changed = [f for f in FIELDS if h.get(f) != w.get(f)]
        if changed:
            out.append(f"webhook {name}: {', '.join(changed)}")
    return out


def restored(live: Sequence[Mapping[str, Any]], want: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chart's webhooks, each keeping the live ``caBundle`` of the webhook of its name (or of the first live
    webhook: the operator writes one bundle into every webhook)."""
    bundles = {w.get("name"): (w.get("clientConfig") or {}).get("caBundle") for w in live}
    first = next((b for b in bundles.values() if b), None)
    out = []
    for w in want:
        w = copy.deepcopy(dict(w))
        bundle = bundles.get(w["name"]) or first
        cc = w.setdefault("clientConfig", {})
        cc.pop("caBundle", None)
        if bundle:
            cc["caBundle"] = bundle
        out.append(w)
    return out


__all__ = ["API_DEFAULTS", "FIELDS", "drift", "normalise", "parse", "restored"]
