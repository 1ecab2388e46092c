"""What a real kube-apiserver answers for a LlamaPretrain it is asked to create (dry run): the committed CRD, its CEL
rules by the Python validator's ids, and the invalid-spec corpus both are checked against (tests/cluster)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


from kubetitan_core import crd as crdmod
from kubetitan_core.validation import CEL_RULES
from support.cluster import LPT, ControlPlane, resource_path, wait_for
from support.paths import REPO
from support import yamlio

CORPUS = yamlio.load((REPO / "tests" / "api" / "invalid_specs.yaml").read_text())
CRD = yamlio.load((REPO / "crds" / crdmod.CRD_FILE).read_text())
CEL_MESSAGE_TO_ID = {r["message"]: {c.rule: c.id for c in CEL_RULES}[r["rule"]]
                     for r in CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
                         "x-kubernetes-validations"]}
CEL_IDS = set(CEL_MESSAGE_TO_ID.values())
CRD_NAME = "llamapretrains.kubetitan.io"


@contextlib.contextmanager
def crd_only_server(workdir: Path, namespace: str, apiserver_bin: Path | None = None) -> Iterator[ControlPlane]:
    """etcd and a kube-apiserver alone (the pinned one, or ``apiserver_bin``) with the committed CRD Established and
    ``namespace`` made: what the CRD's own schema and CEL rules answer, without the operator's webhook."""
    cp = ControlPlane(workdir=workdir, apiserver_only=True, apiserver_bin=apiserver_bin, feature_gates={},
                      runtime_config=(), audit=False)
    with cp:
        cp.admin.create("apiextensions.k8s.io/v1/customresourcedefinitions", None, CRD)

        def established() -> bool:
            got = cp.admin.get("apiextensions.k8s.io/v1/customresourcedefinitions", None, CRD_NAME) or {}
            conds = {c["type"]: c["status"] for c in (got.get("status") or {}).get("conditions") or []}
            return conds.get("Established") == "True" and conds.get("NamesAccepted") == "True"

        wait_for(established, 30, "the CRD Established")
        wait_for(lambda: discovered(cp.admin), 30, "the CRD's resource in the API server's discovery and OpenAPI v3")
        cp.admin.ensure_namespace(namespace)
        yield cp


AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"


def discovered(api: Any) -> bool:
    """Whether the server's aggregated discovery lists the CRD's resource and its OpenAPI v3 document holds the
    CRD's schema: what ``kubectl explain`` reads. Established comes first; the discovery and OpenAPI controllers
    publish the CRD a moment later, and an explain in between answers "couldn't find resource" (seen when the
    explain test ran first on a fresh server)."""
    group, plural = CRD["spec"]["group"], CRD["spec"]["names"]["plural"]
    version = CRD["spec"]["versions"][0]["name"]
    r = api.s.get(api.server + "/apis", headers={"Accept": AGGREGATED}, timeout=10)
    groups = {g["metadata"]["name"]: g for g in (r.json().get("items") or [])} if r.ok else {}
    versions = (groups.get(group) or {}).get("versions") or []
    if not any(res.get("resource") == plural for v in versions for res in v.get("resources") or []):
        return False
    index = api.s.get(api.server + "/openapi/v3", timeout=10)
    entry = ((index.json().get("paths") or {}) if index.ok else {}).get(f"apis/{group}/{version}")
    if not entry:
        return False
    doc = api.s.get(api.server + entry["serverRelativeURL"], timeout=10)
    kind = CRD["spec"]["names"]["kind"]
    return doc.ok and any(name.endswith(f".{kind}") for name in (doc.json().get("components") or {}).get("schemas", {}))


def post_dry_run(api: Any, doc: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    """``POST`` with ``dryRun=All`` (nothing stored) and strict field validation, as kubectl sends it: the status,
    the body and the Warning headers. (Without ``fieldValidation=Strict`` the server drops an unknown field with a
    warning instead of refusing it.)"""
    r = api.s.post(api.server + resource_path(LPT, doc["metadata"]["namespace"]),
                   params={"dryRun": "All", "fieldValidation": "Strict"},  # kubectl's default since 1.27
                   data=json.dumps(doc), headers={"Content-Type": "application/json"}, timeout=30)
    return r.status_code, r.json(), r.headers.get("Warning", "")


def cel_ids(body: dict[str, Any]) -> set[str]:
    """The validator ids of the CEL rules a 422 answer names."""
    causes = (body.get("details") or {}).get("causes") or []
    return {rid for c in causes for msg, rid in CEL_MESSAGE_TO_ID.items() if msg in c.get("message", "")}
