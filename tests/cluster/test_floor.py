"""The CRD on the oldest Kubernetes minor it is checked on: kube-apiserver built from ``tests/cluster/floor/go.mod``
(``make cluster``) over etcd, nothing else. The CRD installs and is Established; its OpenAPI schema and CEL rules
answer every case of the invalid-spec corpus as on the pinned version (the same CEL rules, by the Python validator's
ids, or strict decoding's unknown field); every example passes them; ``kubectl explain`` reads the descriptions.
docs/install.md names this version as the floor."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubetitan_core.validation import parse
from support.cluster import FLOOR_BIN, FLOOR_GO_MOD, ControlPlane, kubernetes_version
from support.crd_answers import CEL_IDS, CORPUS, CRD, cel_ids, crd_only_server, post_dry_run
from support.paths import EXAMPLES, load_example
from support.release import kubectl
from support.specs import make_lpt

pytestmark = pytest.mark.xdist_group("real-floor")
NAMESPACE = "floor"


@pytest.fixture(scope="module")
def floor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with crd_only_server(tmp_path_factory.mktemp("floor"), NAMESPACE, FLOOR_BIN / "kube-apiserver") as cp:
        yield cp


def test_the_floor_server_is_the_pinned_oldest_kubernetes(floor: ControlPlane) -> None:
    assert floor.version()["gitVersion"] == kubernetes_version(FLOOR_GO_MOD)
    def minor(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.lstrip("v").split("."))

    assert minor(kubernetes_version(FLOOR_GO_MOD)) < minor(kubernetes_version()), "the floor is the older version"


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_every_corpus_spec_gets_the_pinned_versions_answer_from_the_floors_schema_and_cel_rules(
        case: dict[str, Any], floor: ControlPlane) -> None:
    """No webhook here: a spec the schema and CEL rules pass is created (dry run); one they refuse is answered as
    the pinned version answers it (tests/cluster/test_real_api.py), with the CEL rules the validator reports."""
    doc = make_lpt(case["spec"], name="c", namespace=NAMESPACE)
    _, errors = parse(make_lpt(case["spec"]))
    py = {e.rule for e in errors}
    code, body, _ = post_dry_run(floor.admin, doc)
    if code == 201:
        assert not py & CEL_IDS and "schema" not in py, f"the CRD let through {sorted(py & CEL_IDS)}"
    elif code == 400:  # strict decoding: an unknown field, before any validation
        assert body.get("reason") == "BadRequest" and "unknown field" in body.get("message", "") and "schema" in py, body
    else:
        assert code == 422 and body.get("reason") == "Invalid", body
        assert cel_ids(body) == py & CEL_IDS, (body.get("message"), sorted(py))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_passes_the_floors_schema_and_cel_rules(path: Path, floor: ControlPlane) -> None:
    doc = load_example(path)
    doc["metadata"]["namespace"] = NAMESPACE
    code, body, _ = post_dry_run(floor.admin, doc)
    assert code == 201, body


def test_kubectl_explain_reads_the_descriptions_on_the_floor(floor: ControlPlane) -> None:
    out = kubectl("explain", "llamapretrain.spec.training", kubeconfig=floor.admin_kubeconfig)
    assert out.returncode == 0 and "seqLen" in out.stdout, out.stderr
    description = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "training"]["properties"]["seqLen"]["description"]
    assert " ".join(description.split())[:60] in " ".join(out.stdout.split()), out.stdout

