"""kubetitan.admission, table-tested without kopf or a cluster: the webhook's decision for one request.

Each row: (id, object, oldObject, operation, policy, requester mode, SubjectAccessReview answers) -> (allowed, code,
the error lines, the warning rule ids). The error lines are compared with ``validation.parse``/``policy.check``
(what ``kubetitan validate --policy`` prints); tests/operator/test_webhook.py checks the same end to end.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kubetitan import plan
from kubetitan.admission import Access, Requester, access_checks, references, review
from kubetitan.conditions import WORLD_SIZE_CHANGE_REFUSED
from kubetitan.observation.spec import spec_changes
from kubetitan.policy import Policy, check
from kubetitan.status import spec_gate
from kubetitan_core.contract import (CODE_LOADING_ENV, ENV_NO_USER_SITE, TRAINER_PYTHON, TUNING_ENV,
                                     code_loading_env)
from kubetitan_core.validation import parse
from support.specs import lpt


def obj(name: str = "run", status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    base = {"model": {"flavor": "debug"}, "parallelism": {"dataParallelShardDegree": 2},
            "training": {"steps": 100, "seqLen": 256, "localBatchSize": 8, "warmupSteps": 10},
            "precision": {"compile": False}, "data": {"source": "synthetic"}, "tokenizer": {"source": "builtin"},
            "checkpoint": {"intervalSteps": 10, "storage": {"persistentVolumeClaim": {"claimName": "ckpt"}}},
            "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 2}}
    for key, value in spec.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    out = lpt(name, base, namespace="ml")
    if status is not None:
        out["status"] = status
    return out


STARTED = {"attempt": 0, "phase": "Running"}
HUB = {"source": "huggingface", "huggingface": {"dataset": "builtin", "streaming": False}}
SHARDS = {"source": "shards", "shards": {"path": "/data/c4"}}
TWO_NODES = {"resources": {"nodes": 2}, "parallelism": {"dataParallelShardDegree": 4}}
"""1 node x 2 processes -> 2 nodes: the world size and the data-parallel degree 2 -> 4."""
REFUSED_EDIT = {**STARTED, "conditions": [{"type": "SpecAccepted", "status": "False", "reason": "WorldSizeChangeRefused",
                                           "message": "resources.nodes 1 -> 2 ...", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
"""A started run whose stored spec holds an edit the operator refused (it slipped past admission)."""
SECRET_ENV = [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "k"}}}]
PVC = Access("get", "", "persistentvolumeclaims", "ml", "ckpt")
SECRET = Access("get", "", "secrets", "ml", "wandb")
PODS = Access("create", "", "pods", "ml")
FIX = ("ask for that access, reference something you may use, or ask the cluster admin to set the kubetitan "
       "chart's webhook.requesterChecks")

ROWS: list[tuple[str, dict[str, Any], dict[str, Any] | None, str, Policy | None, Requester, dict[Access, Any],
                 bool, int, list[str] | None, list[str]]] = [
    # id, obj, old, operation, policy, mode, answers -> allowed, code, error lines (None: as parse says), warnings
    ("valid-create", obj(), None, "CREATE", Policy(), Requester.OFF, {}, True, 200, [], []),
    ("invalid-create", obj(parallelism={"dataParallelShardDegree": 3}), None, "CREATE", Policy(), Requester.OFF, {},
     False, 422, None, []),
    ("invalid-update-of-spec", obj(training={"seqLen": 255}), obj(), "UPDATE", Policy(), Requester.OFF, {},
     False, 422, None, []),
    ("policy-refuses", obj(resources={"priorityClassName": "system-node-critical"}), None, "CREATE", Policy(),
     Requester.OFF, {}, False, 403, None, []),
    ("warned", obj(checkpoint={"intervalSteps": 500}), None, "CREATE", Policy(), Requester.OFF, {}, True, 200, [],
     ["checkpoint.interval-beyond-run"]),
    ("warned-and-refused-by-policy", obj(checkpoint={"intervalSteps": 500},
                                         resources={"priorityClassName": "x"}), None, "CREATE", Policy(),
     Requester.OFF, {}, False, 403, None, ["checkpoint.interval-beyond-run"]),
    ("no-policy", obj(resources={"priorityClassName": "x"}), None, "CREATE", None, Requester.OFF, {},
     True, 200, [], []),
    # UPDATE: an unchanged spec always passes (kopf's finalizer/annotation patches, label edits)
    ("metadata-only-update-of-an-invalid-stored-spec", obj(training={"seqLen": 255}),
     obj(training={"seqLen": 255}), "UPDATE", Policy(), Requester.REFERENCES, {}, True, 200, [], []),
    ("checkpoint-breaking-change-of-a-started-run", obj(checkpoint={"mountPath": "/elsewhere"}),
     obj(status=STARTED), "UPDATE", Policy(), Requester.OFF, {}, False, 422,
     ["spec.checkpoint.mountPath: changing checkpoint.mountPath would make the run's checkpoints unusable; revert "
      "it, or create a new LlamaPretrain"], []),
    ("the-same-change-before-the-run-started", obj(checkpoint={"mountPath": "/elsewhere"}), obj(), "UPDATE",
     Policy(), Requester.OFF, {}, True, 200, [], []),
    ("a-live-field-of-a-started-run", obj(training={"steps": 200}), obj(status=STARTED), "UPDATE", Policy(),
     Requester.OFF, {}, True, 200, [], []),
    # a world-size edit of a started run: deferred (a warning) on shards/synthetic data, refused on hub data
    ("world-size-edit-of-a-started-synthetic-run", obj(**TWO_NODES), obj(status=STARTED), "UPDATE", Policy(),
     Requester.OFF, {}, True, 200, [], ["DeferredToNextAttempt"]),
    ("world-size-edit-of-a-started-shards-run", obj(data=SHARDS, **TWO_NODES), obj(data=SHARDS, status=STARTED),
     "UPDATE", Policy(), Requester.OFF, {}, True, 200, [], ["DeferredToNextAttempt"]),
    ("world-size-edit-of-a-started-hub-run", obj(data=HUB, **TWO_NODES), obj(data=HUB, status=STARTED), "UPDATE",
     Policy(), Requester.OFF, {}, False, 422, ["spec.resources.nodes: resources.nodes 1 -> 2, "
     "parallelism.dataParallelShardDegree 2 -> 4 changes the world size 2 -> 4 and the data-parallel degree 2 -> 4: "
     "the edit is refused, and not applied, because the run reads hub-streamed data (data.source huggingface), which "
     "cannot resume at another data-parallel degree: a streamed dataset keeps one read position per "
     "data-parallel rank. The running attempt goes on as it was created. Revert the edit; or prepare the dataset "
     "into shards with `kubetitan prepare-data` (data.source shards resumes at any size) and start a new "
     "LlamaPretrain on them; or start a new LlamaPretrain at the new size with its own checkpoint storage"], []),
    ("world-size-edit-of-a-hub-run-before-it-started", obj(data=HUB, **TWO_NODES), obj(data=HUB), "UPDATE",
     Policy(), Requester.OFF, {}, True, 200, [], []),
    ("hub-run-switched-to-shards-and-two-nodes", obj(data=SHARDS, **TWO_NODES), obj(data=HUB, status=STARTED),
     "UPDATE", Policy(), Requester.OFF, {}, False, 422, None, []),
    ("reverting-a-refused-world-size-edit", obj(data=HUB), obj(data=HUB, status=REFUSED_EDIT, **TWO_NODES),
     "UPDATE", Policy(), Requester.OFF, {}, True, 200, [], []),
    ("delete-passes", obj(training={"seqLen": 255}), None, "DELETE", Policy(), Requester.REFERENCES, {},
     True, 200, [], []),
    # requester checks
    ("references-granted", obj(), None, "CREATE", Policy(), Requester.REFERENCES, {PVC: True}, True, 200, [], []),
    ("references-denied", obj(), None, "CREATE", Policy(), Requester.REFERENCES, {PVC: False}, False, 403,
     ["spec.checkpoint.storage.persistentVolumeClaim.claimName: PersistentVolumeClaim ckpt is used by the pods the "
      "operator creates, and the requesting user may not get persistentvolumeclaims 'ckpt' in namespace ml "
      "(denied); ask for that access, reference something you may use, or ask the cluster admin to set the "
      "kubetitan chart's webhook.requesterChecks"], []),
    ("references-unanswered", obj(), None, "CREATE", Policy(), Requester.REFERENCES, {}, False, 403,
     ["spec.checkpoint.storage.persistentVolumeClaim.claimName: PersistentVolumeClaim ckpt is used by the pods the "
      "operator creates, and the requesting user may not get persistentvolumeclaims 'ckpt' in namespace ml "
      "(not checked); ask for that access, reference something you may use, or ask the cluster admin to set the "
      "kubetitan chart's webhook.requesterChecks"], []),
    ("references-off", obj(), None, "CREATE", Policy(), Requester.OFF, {PVC: False}, True, 200, [], []),
    ("update-adding-an-env-secret-checks-every-reference", obj(resources={"env": SECRET_ENV}), obj(), "UPDATE",
     Policy(), Requester.REFERENCES, {SECRET: "no RBAC rule", PVC: True}, False, 403,
     ["spec.resources.env[0].valueFrom.secretKeyRef.name: Secret wandb is used by the pods the operator creates, "
      "and the requesting user may not get secrets 'wandb' in namespace ml (no RBAC rule); ask for that access, "
      "reference something you may use, or ask the cluster admin to set the kubetitan chart's "
      "webhook.requesterChecks"], []),
    # an edit of someone else's run: a reference is new when its use is; an image, env or mount change checks all
    ("edit-moving-a-pull-secret-into-env-and-swapping-the-image", obj(resources={
        "env": SECRET_ENV, "image": "tenant.example/evil:1"}), obj(resources={"imagePullSecrets": ["wandb"]}),
     "UPDATE", Policy(), Requester.REFERENCES, {}, False, 403,
     [f"spec.resources.env[0].valueFrom.secretKeyRef.name: Secret wandb is used by the pods the operator creates, "
      f"and the requesting user may not get secrets 'wandb' in namespace ml (not checked); {FIX}",
      f"spec.checkpoint.storage.persistentVolumeClaim.claimName: PersistentVolumeClaim ckpt is used by the pods "
      f"the operator creates, and the requesting user may not get persistentvolumeclaims 'ckpt' in namespace ml "
      f"(not checked); {FIX}"], []),
    ("edit-swapping-only-the-image-checks-every-reference", obj(resources={"image": "tenant.example/evil:1"}),
     obj(), "UPDATE", Policy(), Requester.REFERENCES, {PVC: False}, False, 403, [
         f"spec.checkpoint.storage.persistentVolumeClaim.claimName: PersistentVolumeClaim ckpt is used by the pods "
         f"the operator creates, and the requesting user may not get persistentvolumeclaims 'ckpt' in namespace ml "
         f"(denied); {FIX}"], []),
    ("edit-moving-a-pull-secret-into-the-tokenizer-is-a-new-use", obj(
        resources={"imagePullSecrets": ["wandb"]}, tokenizer={"source": "builtin", "tokenSecretRef": {"name": "wandb"}}),
     obj(resources={"imagePullSecrets": ["wandb"]}), "UPDATE", Policy(), Requester.REFERENCES, {PVC: True}, False,
     403, [f"spec.tokenizer.tokenSecretRef.name: Secret wandb is used by the pods the operator creates, and the "
           f"requesting user may not get secrets 'wandb' in namespace ml (not checked); {FIX}"], []),
    ("edit-making-a-read-only-data-claim-writable-checks-every-reference", obj(data={"volume": {"claimName": "d"}}),
     obj(data={"volume": {"claimName": "d", "readOnly": True}}), "UPDATE", Policy(), Requester.REFERENCES,
     {PVC: True}, False, 403, [
         f"spec.data.volume.claimName: PersistentVolumeClaim d is used by the pods the operator creates, and the "
         f"requesting user may not get persistentvolumeclaims 'd' in namespace ml (not checked); {FIX}"], []),
    ("edit-of-a-live-field-checks-nothing", obj(training={"steps": 200}, resources={"env": SECRET_ENV}),
     obj(resources={"env": SECRET_ENV}), "UPDATE", Policy(), Requester.REFERENCES, {}, True, 200, [], []),
    ("edit-reordering-pull-secrets-checks-nothing", obj(resources={"imagePullSecrets": ["b", "a"]}),
     obj(resources={"imagePullSecrets": ["a", "b"]}), "UPDATE", Policy(), Requester.REFERENCES, {}, True, 200, [],
     []),
    ("pod-create-granted", obj(), None, "CREATE", Policy(), Requester.POD_CREATE, {PODS: True}, True, 200, [], []),
    ("pod-create-denied", obj(), None, "CREATE", Policy(), Requester.POD_CREATE, {PODS: False}, False, 403,
     ["spec.checkpoint.storage.persistentVolumeClaim.claimName: this spec makes the operator create pods that use "
      "PersistentVolumeClaim ckpt, and the requesting user may not create pods in namespace ml (denied); ask for "
      "that access, reference something you may use, or ask the cluster admin to set the kubetitan chart's "
      "webhook.requesterChecks"], []),
    ("invalid-spec-is-refused-before-any-access-check", obj(training={"seqLen": 255}), None, "CREATE", Policy(),
     Requester.REFERENCES, {}, False, 422, None, []),
    # policy.codeLoadingEnv
    ("ld-preload-refused", obj(resources={"env": [{"name": "LD_PRELOAD", "value": "/checkpoints/x.so"}]}), None,
     "CREATE", Policy(), Requester.OFF, {}, False, 403,
     ["spec.resources.env[0].name: LD_PRELOAD makes the trainer load code from outside its image (LD_*: the "
      "dynamic loader's preloaded and audit libraries and its search path: every process loads them), which this "
      "cluster's kubetitan policy does not allow (allowed: none); put the code into the image, or ask the cluster "
      "admin to add it to the kubetitan chart's policy.codeLoadingEnv"], []),
    ("pythonpath-listed", obj(resources={"env": [{"name": "PYTHONPATH", "value": "/data/lib"}]}), None, "CREATE",
     Policy(code_loading_env=("PYTHONPATH",)), Requester.OFF, {}, True, 200, [], []),
    ("any-code-loading-env", obj(resources={"env": [{"name": "NCCL_NET_PLUGIN", "value": "ofi"}]}), None, "CREATE",
     Policy(code_loading_env=("*",)), Requester.OFF, {}, True, 200, [], []),
]


@pytest.mark.parametrize("case", ROWS, ids=[r[0] for r in ROWS])
def test_review(case: tuple[Any, ...]) -> None:
    _, new, old, op, pol, mode, answers, allowed, code, lines, warned = case
    v = review(copy.deepcopy(new), copy.deepcopy(old), op, pol, mode, answers)
    assert v.allowed is allowed, v.message
    assert v.code == code
    if lines is None and code == 422 and old is not None and old.get("status"):  # the operator's own refusal
        lines = [_operator_refusal(new, old)]
    elif lines is None:  # exactly what kubetitan validate --policy prints for it
        lpt, errors = parse(copy.deepcopy(new))
        lines = [str(e) for e in errors] or [str(x) for x in check(lpt, pol)]
    assert list(v.errors) == lines
    if lines:
        assert v.message.splitlines()[1:] == [f"  - {ln}" for ln in lines]
    if "every-reference" in case[0] or "swapping-the-image" in case[0]:
        assert "so every reference is checked as if she created the run as it now stands" in v.message
    assert [w.split("]", 1)[0][1:] for w in v.warnings] == warned


def _operator_refusal(new: dict[str, Any], old: dict[str, Any]) -> str:
    """What the operator's spec gate says of the same edit (``SpecAccepted=False``), at the edit's first field."""
    then, now = parse(copy.deepcopy(old))[0], parse(copy.deepcopy(new))[0]
    wire = [x.spec.model_dump(by_alias=True, exclude_none=True, mode="json") for x in (then, now)]
    block, reason, _ = spec_gate(wire[0], now.spec, spec_changes(*wire))
    assert reason == WORLD_SIZE_CHANGE_REFUSED, block
    return f"{plan.world_size_edit(then.spec, now.spec).path}: {block}"


def test_a_deferred_world_size_edit_is_warned_with_the_size_and_the_next_attempt() -> None:
    v = review(obj(data=SHARDS, **TWO_NODES), obj(data=SHARDS, status=STARTED), "UPDATE", Policy())
    assert v.allowed and v.warnings == (
        "[DeferredToNextAttempt] spec.resources.nodes: resources.nodes 1 -> 2, parallelism.dataParallelShardDegree "
        "2 -> 4 changes the world size 2 -> 4 and the data-parallel degree 2 -> 4: applied when the next attempt "
        "starts (a restart, or suspend and resume to apply now), which resumes the newest checkpoint at the new size; "
        "the running attempt goes on as it was created",)


def test_access_checks_per_mode() -> None:
    o = obj(resources={"env": SECRET_ENV, "imagePullSecrets": ["regcred"], "serviceAccountName": "s3",
                       "priorityClassName": "training"},
            tokenizer={"source": "builtin", "tokenSecretRef": {"name": "hf"}},
            data={"volume": {"claimName": "shards"}})
    assert parse(copy.deepcopy(o))[1] == []
    assert access_checks(o, None, "CREATE", Requester.OFF) == []
    assert access_checks(o, None, "CREATE", Requester.POD_CREATE) == [PODS]
    assert access_checks(o, None, "CREATE", Requester.REFERENCES) == [
        SECRET, Access("get", "", "secrets", "ml", "regcred"), Access("get", "", "secrets", "ml", "hf"),
        PVC, Access("get", "", "persistentvolumeclaims", "ml", "shards"),
        Access("create", "", "serviceaccounts/token", "ml", "s3"),
        Access("use", "scheduling.k8s.io", "priorityclasses", None, "training")]
    assert access_checks(o, o, "UPDATE", Requester.REFERENCES) == []  # nothing added
    assert [r.path for r in references(o["spec"])][:3] == [
        "spec.resources.env[0].valueFrom.secretKeyRef.name", "spec.resources.imagePullSecrets[0]",
        "spec.tokenizer.tokenSecretRef.name"]


def test_naming_the_default_service_account_is_the_same_as_leaving_it_out() -> None:
    """``serviceAccountName: default`` gives the pod that leaving it out gives: no requester check for it (a tenant
    without ``create serviceaccounts/token`` was refused for writing what the defaults mean), and the same pods."""
    named, omitted = obj(resources={"serviceAccountName": "default"}), obj()
    for mode in (Requester.REFERENCES, Requester.POD_CREATE):
        assert access_checks(named, None, "CREATE", mode) == access_checks(omitted, None, "CREATE", mode)
    checks = access_checks(named, None, "CREATE", Requester.REFERENCES)
    assert [c.resource for c in checks] == ["persistentvolumeclaims"]  # the checkpoint claim only
    v = review(named, None, "CREATE", Policy(), Requester.REFERENCES, {c: True for c in checks})
    assert v.allowed, v.message
    assert Access("create", "", "serviceaccounts/token", "ml", "s3") in access_checks(
        obj(resources={"serviceAccountName": "s3"}), None, "CREATE", Requester.REFERENCES)  # any other is checked
    pods = [plan.attempt_children(parse(copy.deepcopy(o))[0], 0)[-1]["spec"] for o in (named, omitted)]
    assert pods[0].get("serviceAccountName", "default") == pods[1].get("serviceAccountName", "default")


def test_the_subject_access_review_carries_the_requests_user() -> None:
    user = {"username": "alice", "uid": "u1", "groups": ["team-a", "system:authenticated"],
            "extra": {"scopes": ["x"]}}
    sar = Access("create", "", "serviceaccounts/token", "ml", "s3").sar(user)
    assert sar == {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {
        "resourceAttributes": {"verb": "create", "group": "", "resource": "serviceaccounts",
                               "subresource": "token", "namespace": "ml", "name": "s3"},
        "user": "alice", "groups": ["team-a", "system:authenticated"], "uid": "u1", "extra": {"scopes": ["x"]}}}


CODE_LOADING = [(e.pattern, n) for e in CODE_LOADING_ENV for n in e.names()]
"""Every code-loading variable the contract names (each pattern's examples), one test each."""
TUNING = [*sorted(TUNING_ENV), "WANDB_PROJECT", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS",
          "PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "HF_HUB_OFFLINE", "HF_HOME", "FI_PROVIDER"]
"""Variables that only tune (or name data): never refused."""


@pytest.mark.parametrize("pattern,name", CODE_LOADING, ids=[n for _, n in CODE_LOADING])
def test_a_code_loading_variable_is_refused_by_default_and_allowed_when_listed(pattern: str, name: str) -> None:
    o = obj(resources={"env": [{"name": "WANDB_PROJECT", "value": "x"}, {"name": name, "value": "/data/x"}]})
    v = review(o, None, "CREATE", Policy())
    assert not v.allowed and v.code == 403
    (line,) = v.errors
    assert line.startswith(f"spec.resources.env[1].name: {name} makes the trainer load code from outside its image "
                           f"({pattern}: "), line
    assert line.endswith("put the code into the image, or ask the cluster admin to add it to the kubetitan chart's "
                         "policy.codeLoadingEnv")
    assert review(o, None, "CREATE", Policy(code_loading_env=(name,))).allowed
    assert review(o, None, "CREATE", Policy(code_loading_env=("*",))).allowed


@pytest.mark.parametrize("name", TUNING)
def test_a_variable_that_only_tunes_is_not_refused(name: str) -> None:
    o = obj(resources={"env": [{"name": name, "value": "1"}]})
    assert review(o, None, "CREATE", Policy()).allowed


def test_the_issues_variables_are_code_loading() -> None:
    """The variables that were admitted before the list became a wide deny-list by pattern."""
    for name in ("PATH", "HOME", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH", "XDG_CACHE_HOME", "PYTHONWARNINGS",
                 "PYTHONPLATLIBDIR", "CUDA_INJECTION64_PATH", "OPENSSL_CONF", "AWS_CONFIG_FILE", "TMPDIR", "CC"):
        assert code_loading_env(name) is not None, name


def test_the_user_site_switch_is_the_operators() -> None:
    """The operator sets PYTHONNOUSERSITE=1 on every pod; a spec may not unset it (env.reserved)."""
    o = obj(resources={"env": [{"name": ENV_NO_USER_SITE, "value": "0"}]})
    v = review(o, None, "CREATE", Policy(code_loading_env=("*",)))
    assert v.code == 422 and v.errors[0].startswith(f"spec.resources.env[0].name: '{ENV_NO_USER_SITE}' is set by the "
                                                    "operator or the launcher and may not be overridden")
    pod = plan.pod(parse(copy.deepcopy(obj()))[0], 0, 0)
    (c,) = pod["spec"]["containers"]
    assert c["command"] == [TRAINER_PYTHON, "-s", "-m", "kubetitan_trainer.launch"]
    assert {"name": ENV_NO_USER_SITE, "value": "1"} in c["env"]
