"""Semantic validation of a LlamaPretrain: the rules a JSON schema cannot express.

Every semantic rule is written once, as an entry of the table :data:`RULES` (id, field, what it checks, its CEL
twin where CEL can express it, the trainer.toml key the trainer re-checks it on) plus its Python predicate, one
function registered under the rule's id with :func:`check` (:data:`CHECKS`). :func:`validate` runs the predicates
in table order and each error carries its rule's id; the CRD's CEL rules (:mod:`kubetitan_core.crd`), docs/api.md
and the trainer's re-checks (``kubetitan_trainer.checks``) are generated or driven from the same table. Adding a
rule is a table entry, its predicate and a corpus case (tests/api/invalid_specs.yaml); nothing else.

Two layers check a spec. The CRD's OpenAPI schema (types, enums, bounds) plus the CEL twins run inside the API
server; :func:`parse` runs in ``kubetitan validate`` and in the operator, and covers everything, including the
checks CEL cannot express (flavour lookups, hardware). A test evaluates both on the same corpus so that the two
layers cannot disagree.

Each error names the field path, what is wrong, and how to fix it.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kubetitan_core import API_VERSION, KIND, contract, k8sfields, weights
from kubetitan_core.api import (
    LlamaPretrain,
    at_size,
    dp_degree,
    elastic_sizes,
    global_batch,
    LlamaPretrainSpec,
    ModelSpec,
    model_in,
    processes_per_node,
    reads_s3_shards,
    resolved_dp_shard,
    spec_shards_paths,
    weight_schedules,
    world_size,
)
from kubetitan_core.catalog import FLAVOURS, INSTANCE_TYPE_LABEL, INSTANCE_TYPES, InstanceType, ModelDims, accelerator_for
from kubetitan_core.contract import BUILTIN_TOKENIZER_VOCAB, CONFIG_MOUNT, DATA_STAGE_MOUNT, S3_SCHEME, SHM_MOUNT, is_s3_uri


@dataclass(frozen=True)
class FieldError:
    """One problem with a spec: where, what, and how to fix it."""

    path: str
    """Dotted wire path, e.g. ``spec.parallelism.tensorParallelDegree``."""
    message: str
    """What is wrong and how to fix it."""
    rule: str = "schema"
    """Id of the rule that failed (``schema`` for type/enum/bound errors)."""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class Cel:
    """The CEL twin of a rule: the expression the API server evaluates on ``spec`` (``x-kubernetes-validations``)."""

    rule: str
    message: str
    field_path: str


@dataclass(frozen=True)
class CelRule:
    """A rule the API server enforces through ``x-kubernetes-validations`` on ``spec`` (derived from ``RULES``)."""

    id: str
    rule: str
    message: str
    field_path: str


_PROCS = (
    "(has(self.resources.processesPerNode) ? self.resources.processesPerNode : "
    "(self.resources.gpusPerNode > 0 ? self.resources.gpusPerNode : 1))"
)
_OTHERS = (
    "self.parallelism.dataParallelReplicateDegree * self.parallelism.tensorParallelDegree"
    " * self.parallelism.pipelineParallelDegree * self.parallelism.contextParallelDegree"
)


@dataclass(frozen=True)
class Rule:
    """One semantic rule, written once: its id (the ``rule`` of its FieldErrors), the field it reports at, what it
    checks, its CEL twin where CEL can express it (the CRD's ``x-kubernetes-validations`` are generated from
    these, :mod:`kubetitan_core.crd`), and what the trainer re-checks at start-up (``trainer``: the torchtitan /
    ``[kubetitan]`` key; ``kubetitan_trainer.checks.RECHECKS`` holds one check per such rule, run in table
    order). Its Python predicate is ``CHECKS[id]`` (registered with :func:`check`)."""

    id: str
    field: str
    checks: str
    trainer: str = ""
    """The trainer.toml key the trainer re-checks this rule on (``kubetitan_trainer.checks``), or empty."""
    cel: Cel | None = None
    before_parse: bool = False
    """Its predicate reads the raw ``metadata`` mapping and :func:`parse` runs it before the model parses the object,
    so its errors are reported even when the spec does not parse; every other predicate reads the :class:`Facts` of
    a parsed object (:func:`validate`)."""

    @property
    def cel_rule(self) -> CelRule | None:
        return CelRule(self.id, self.cel.rule, self.cel.message, self.cel.field_path) if self.cel else None


RULES: tuple[Rule, ...] = (
    Rule("metadata.fields", "metadata", "known ObjectMeta fields; namespace a DNS-1123 label; label keys and values, "
         "annotation keys as the API server checks them", before_parse=True),
    Rule("metadata.name", "metadata.name", "a DNS-1035 label no longer than the computed limit (see Names and pod fields)"),
    Rule("parallelism.product", "spec.parallelism", "the degrees multiply to nodes x processes per node",
         "parallelism.* degrees x the world size",
         cel=Cel(
             f"self.parallelism.dataParallelShardDegree == -1 ? "
             f"(self.resources.nodes * {_PROCS}) % ({_OTHERS}) == 0 : "
             f"self.parallelism.dataParallelShardDegree * {_OTHERS} == self.resources.nodes * {_PROCS}",
             "the product of the parallel degrees must equal resources.nodes x processes per node",
             ".parallelism")),
    Rule("parallelism.ddp-1d", "spec.parallelism.dataParallelReplicateDegree",
         "replicas without sharding (DDP) only as the one parallelism (torchtitan's llama3 parallelize)"),
    Rule("parallelism.context-seq-len", "spec.training.seqLen",
         "seqLen divisible by tensorParallelDegree x 2 x contextParallelDegree (torchtitan's llama3 parallelize)",
         cel=Cel(
             "self.training.seqLen % (self.parallelism.tensorParallelDegree * 2 * "
             "self.parallelism.contextParallelDegree) == 0",
             "training.seqLen must be divisible by parallelism.tensorParallelDegree x 2 x "
             "parallelism.contextParallelDegree",
             ".training.seqLen")),
    Rule("model.custom", "spec.model.custom", "set exactly when flavor is custom",
         cel=Cel(
             "(self.model.flavor == 'custom') == has(self.model.custom)",
             "model.custom must be set exactly when model.flavor is custom",
             ".model.custom")),
    Rule("model.dims", "spec.model.custom", "dim divisible by nHeads into an even head size (RoPE), nKvHeads divides "
         "nHeads"),
    Rule("model.heads-tp", "spec.parallelism.tensorParallelDegree", "divides the model's heads and key/value heads"),
    Rule("model.layers-pp", "spec.parallelism.pipelineParallelDegree", "divides the model's layers"),
    Rule("tokenizer.vocab", "spec.model.custom.vocabSize", "the vocabulary holds every token of the tokenizer",
         "model vocab_size vs the tokenizer's real size"),
    Rule("training.global-batch", "spec.training.globalBatchSize", "a multiple of localBatchSize x data parallel",
         "training.global_batch_size"),
    Rule("training.warmup", "spec.training.warmupSteps", "below steps"),
    Rule("resources.gpus", "spec.resources.gpusPerNode", "at most the instance type's GPUs"),
    Rule("resources.efa", "spec.resources.efaPerNode", "at most the instance type's EFA interfaces"),
    Rule("resources.fit", "spec.resources.cpu, spec.resources.memory", "at most the instance type's vCPUs and memory "
         "(a pod asking for more is never scheduled)"),
    Rule("resources.gpu-product", "spec.resources.gpuProduct", "agrees with a catalog instance type's GPU"),
    Rule("resources.platform", "spec.resources.platform", "matches the instance type (ml. names are HyperPod)"),
    Rule("resources.instance-type-selector", "spec.resources.nodeSelector",
         "no instance-type label that contradicts resources.instanceType (the validator and the pods would see "
         "different hardware)"),
    Rule("resources.cpu-model", "spec.resources.gpusPerNode", "0 (CPU) only for the debug or a custom model"),
    Rule("resources.procs", "spec.resources.processesPerNode", "equals gpusPerNode on GPU nodes"),
    Rule("float8.hardware", "spec.precision.float8.enabled", "FP8 needs compute capability >= 8.9 (or emulate)",
         "quantize.linear.float8.emulate (no GPU)"),
    Rule("float8.emulate-compile", "spec.precision.float8.emulate", "emulation without torch.compile",
         "compile.enable with float8.emulate"),
    Rule("float8.all-gather-recipe", "spec.precision.float8.fsdpFloat8AllGather", "needs FP8 on, recipe tensorwise",
         "quantize.linear.float8.enable_fsdp_float8_all_gather",
         cel=Cel(
             "!self.precision.float8.fsdpFloat8AllGather || "
             "(self.precision.float8.enabled && self.precision.float8.recipe == 'tensorwise')",
             "precision.float8.fsdpFloat8AllGather needs precision.float8.enabled and recipe tensorwise",
             ".precision.float8.fsdpFloat8AllGather")),
    Rule("float8.all-gather-dp", "spec.precision.float8.fsdpFloat8AllGather", "needs a shard degree above 1"),
    Rule("float8.filter-fqns", "spec.precision.float8.filterFqns", "no empty fragment (it matches every module)"),
    Rule("float8.precompute-needs-all-gather", "spec.precision.float8.precomputeDynamicScale",
         "needs fsdpFloat8AllGather",
         cel=Cel(
             "!self.precision.float8.precomputeDynamicScale || self.precision.float8.fsdpFloat8AllGather",
             "precision.float8.precomputeDynamicScale needs precision.float8.fsdpFloat8AllGather",
             ".precision.float8.precomputeDynamicScale")),
    Rule("data.shards-required", "spec.data.shards", "set when data.source is shards", "kubetitan.data.shards_path",
         cel=Cel(
             "self.data.source != 'shards' || has(self.data.shards)",
             "data.shards is required when data.source is shards",
             ".data.shards")),
    Rule("data.mixture-required", "spec.data.mixture", "set exactly when data.source is mixture",
         cel=Cel(
             "(self.data.source == 'mixture') == (has(self.data.mixture) && size(self.data.mixture) > 0)",
             "data.mixture is required when data.source is mixture, and only then",
             ".data.mixture")),
    Rule("data.mixture-source", "spec.data.mixture[]", "each source sets exactly one of shards and huggingface",
         cel=Cel(
             "!has(self.data.mixture) || self.data.mixture.all(m, has(m.shards) != has(m.huggingface))",
             "each data.mixture source sets exactly one of shards and huggingface",
             ".data.mixture")),
    Rule("data.mixture-schedule-point", "spec.data.mixture[].schedule.points[]", "each point sets exactly one of "
         "step and percent",
         cel=Cel(
             "!has(self.data.mixture) || self.data.mixture.all(m, !has(m.schedule) || "
             "m.schedule.points.all(p, has(p.step) != has(p.percent)))",
             "each data.mixture[].schedule point sets exactly one of step and percent",
             ".data.mixture")),
    Rule("data.mixture-schedule", "spec.data.mixture[].schedule", "points in increasing step order within "
         "training.steps; a weight of 0 only with a schedule that raises it; some source's weight above 0 at every "
         "step", "kubetitan.data.mixture_schedule_* (weights by step)"),
    Rule("data.attention-mask", "spec.data.attentionMask", "document needs shards sources (the .idx boundaries) and "
         "no context parallelism",
         cel=Cel(
             "self.data.attentionMask != 'document' || ((self.data.source == 'shards' || (self.data.source == "
             "'mixture' && (!has(self.data.mixture) || self.data.mixture.all(m, !has(m.huggingface))))) && "
             "self.parallelism.contextParallelDegree == 1)",
             "data.attentionMask document needs shards sources and no context parallelism",
             ".data.attentionMask")),
    Rule("data.eval-held-out", "spec.data.eval", "eval.shards set when data.source is huggingface or a mixture source "
         "is (a stream has no held-out split)",
         cel=Cel(
             "!has(self.data.eval) || has(self.data.eval.shards) || (self.data.source != 'huggingface' && "
             "(!has(self.data.mixture) || self.data.mixture.all(m, !has(m.huggingface))))",
             "data.eval.shards is required with a huggingface source (a streamed dataset cannot be split)",
             ".data.eval")),
    Rule("tokenizer.path-required", "spec.tokenizer.path", "set when tokenizer.source is path",
         "kubetitan.tokenizer.path (holds tokenizer.json)",
         cel=Cel(
             "self.tokenizer.source != 'path' || has(self.tokenizer.path)",
             "tokenizer.path is required when tokenizer.source is path",
             ".tokenizer.path")),
    Rule("hub.repo-id", "spec.tokenizer.repo, spec.data.huggingface.dataset, spec.data.mixture[].huggingface.dataset",
         "a Hugging Face hub id (namespace/name), not a URL"),
    Rule("tokenizer.repo-required", "spec.tokenizer.repo", "set when tokenizer.source is huggingface",
         cel=Cel(
             "self.tokenizer.source != 'huggingface' || has(self.tokenizer.repo)",
             "tokenizer.repo is required when tokenizer.source is huggingface",
             ".tokenizer.repo")),
    Rule("precision.loss-chunks-parallelism", "spec.precision.lossChunks",
         "lossChunks only without tensor and pipeline parallelism",
         cel=Cel(
             "!has(self.precision.lossChunks) || self.precision.lossChunks <= 1 || "
             "(self.parallelism.tensorParallelDegree == 1 && self.parallelism.pipelineParallelDegree == 1)",
             "precision.lossChunks > 1 needs parallelism.tensorParallelDegree and pipelineParallelDegree 1 (under "
             "tensor or pipeline parallelism the loss is computed in pieces); set precision.lossChunks to 0",
             ".precision.lossChunks")),
    Rule("checkpoint.pinned-needs-gpu", "spec.checkpoint.asyncMode", "async_with_pinned_mem only on GPU pods",
         cel=Cel(
             "self.checkpoint.asyncMode != 'async_with_pinned_mem' || self.resources.gpusPerNode > 0",
             "checkpoint.asyncMode async_with_pinned_mem stages into pinned host memory with non-blocking GPU copies: "
             "it needs resources.gpusPerNode > 0 (use async on CPU pods)",
             ".checkpoint.asyncMode")),
    Rule("in-process-restarts.need-checkpoint", "spec.runPolicy.inProcessRestarts",
         "in-process restarts need checkpoint.enabled",
         cel=Cel(
             "!has(self.runPolicy.inProcessRestarts) || self.runPolicy.inProcessRestarts == 0 || self.checkpoint.enabled",
             "runPolicy.inProcessRestarts > 0 needs checkpoint.enabled (an in-process restart loads the newest saved "
             "state)",
             ".runPolicy.inProcessRestarts")),
    Rule("checkpoint.writable", "spec.checkpoint.storage.persistentVolumeClaim.readOnly",
         "not read-only while checkpoints are saved"),
    Rule("restarts.need-checkpoint", "spec.runPolicy.maxRestarts", "restarts need checkpoint.enabled",
         cel=Cel(
             "self.runPolicy.maxRestarts == 0 || self.checkpoint.enabled",
             "runPolicy.maxRestarts > 0 needs checkpoint.enabled (a restart resumes from a checkpoint)",
             ".runPolicy.maxRestarts")),
    Rule("checkpoint.keep-latest-k", "spec.checkpoint.keepLatestK",
         "0 or at least 2 when checkpoints are on (torchtitan's CheckpointManager refuses 1)",
         cel=Cel(
             "!self.checkpoint.enabled || self.checkpoint.keepLatestK != 1",
             "checkpoint.keepLatestK must be 0 (keep all) or at least 2",
             ".checkpoint.keepLatestK")),
    Rule("checkpoint.one-storage", "spec.checkpoint.storage", "at most one of persistentVolumeClaim, hostPath and s3",
         cel=Cel(
             "(has(self.checkpoint.storage.persistentVolumeClaim) ? 1 : 0) + (has(self.checkpoint.storage.hostPath) ? 1 : 0)"
             " + (has(self.checkpoint.storage.s3) ? 1 : 0) <= 1",
             "set at most one of checkpoint.storage.persistentVolumeClaim, hostPath and s3",
             ".checkpoint.storage")),
    Rule("checkpoint.storage-required", "spec.checkpoint.storage", "multi-node checkpoints need shared storage"),
    Rule("checkpoint.host-path-single-node", "spec.checkpoint.storage.hostPath", "hostPath only on one node"),
    Rule("checkpoint.s3-uri", "spec.checkpoint.storage.s3.uri",
         "s3://bucket[/prefix]: an S3 bucket name (3-63 of a-z 0-9 . -, not an IP address), a prefix without empty, "
         "'.' or '..' segments", trainer="kubetitan.checkpoint_storage.s3_uri"),
    Rule("checkpoint.s3-endpoint", "spec.checkpoint.storage.s3.endpoint",
         "an http(s)://host[:port] URL without path, query or credentials (http only where the admin policy's "
         "s3EndpointPrefixes allows it)"),
    Rule("data.s3-uri", "spec.data.shards.path, spec.data.mixture[].shards.path, spec.data.eval.shards.path",
         "an s3:// shards path is s3://bucket[/prefix] (the bucket naming and prefix rules of checkpoint.s3-uri)",
         trainer="kubetitan.data.shards_path"),
    Rule("data.s3-endpoint", "spec.data.s3.endpoint",
         "an http(s)://host[:port] URL without path, query or credentials (http only where the admin policy's "
         "s3EndpointPrefixes allows it)"),
    Rule("data.s3-one-secret", "spec.data.s3.credentialsSecretRef",
         "the same Secret and keys as checkpoint.storage.s3.credentialsSecretRef when both are set (the pod has one "
         "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"),
    Rule("run-policy.backoff-order", "spec.runPolicy.maxBackoffSeconds", "at least backoffSeconds",
         cel=Cel(
             "self.runPolicy.maxBackoffSeconds >= self.runPolicy.backoffSeconds",
             "runPolicy.maxBackoffSeconds must be at least runPolicy.backoffSeconds",
             ".runPolicy.maxBackoffSeconds")),
    Rule("elastic.range", "spec.runPolicy.elastic", "minNodes <= resources.nodes <= maxNodes"),
    Rule("elastic.layouts", "spec.runPolicy.elastic", "every size from minNodes to maxNodes is a valid layout: "
         "dataParallelShardDegree -1, the other degrees divide the processes, a shard degree above 1 for FP8 "
         "all-gather, and the global batch reachable exactly by gradient accumulation (a multiple of localBatchSize "
         "x the data-parallel degree at that size)"),
    Rule("elastic.data", "spec.data", "data that resumes at another data-parallel degree (no hub-streamed source: "
         "its position is per rank)"),
    Rule("elastic.needs-checkpoint", "spec.checkpoint.enabled", "a resize resumes from a checkpoint"),
    Rule("monitoring.port", "spec.monitoring.metricsPort", "not torchrun's rendezvous port 29500"),
    Rule("path.no-dot-dot", "spec.checkpoint.mountPath, data.mountPath, checkpoint.storage.hostPath, tokenizer.path, "
         "data.shards.path, data.mixture[].shards.path, data.eval.shards.path", "absolute, no '..' component (a "
         "shards path may instead be s3://: data.s3-uri)"),
    Rule("mounts.no-collision", "spec.checkpoint.mountPath, spec.data.mountPath",
         "no mount at, above or inside another (/etc/kubetitan, /dev/shm, checkpoint, data)"),
    Rule("pod.env", "spec.resources.env", "Kubernetes EnvVar (schema, name, value xor one valueFrom, refs)"),
    Rule("env.reserved", "spec.resources.env[].name", "not a name the operator or launcher sets"),
    Rule("env.secret-backed", "spec.resources.env[].name", "no plain HF_TOKEN when tokenizer.tokenSecretRef is set"),
    Rule("env.unique", "spec.resources.env[].name", "each name once"),
    Rule("pod.tolerations", "spec.resources.tolerations", "Kubernetes Toleration (schema, operator, effect, key)"),
    Rule("pod.affinity", "spec.resources.affinity", "Kubernetes Affinity (schema, operators, weights, topology)"),
    Rule("pod.node-selector", "spec.resources.nodeSelector", "label keys and values"),
    Rule("pod.image", "spec.resources.image", "a container image reference"),
    Rule("pod.names", "names that become pod fields", "DNS-1123 subdomains, Secret keys, the queue label value"),
)
"""Every semantic rule, once, in the order the validator reports them: each has one predicate in ``CHECKS`` whose
FieldErrors carry its id, the CEL twins share them, docs/api.md lists them, and the corpus tests check each one is
exercised."""

CEL_RULES: tuple[CelRule, ...] = tuple(r.cel_rule for r in RULES if r.cel_rule is not None)
"""The CRD's cross-field rules, in table order: every one is a ``RULES`` entry's CEL twin (tests/api/test_rule_table.py)."""


def model_dims(model: ModelSpec) -> ModelDims | None:
    """Dimensions of the spec's model, or None for an incomplete custom model."""
    if model.flavor != "custom":
        return FLAVOURS[model.flavor][1]
    c = model.custom
    if c is None:
        return None
    return ModelDims(
        c.dim, c.n_layers, c.n_heads, c.n_kv_heads or c.n_heads, c.ffn_dim_multiplier,
        c.multiple_of, c.rope_theta, c.vocab_size,
    )


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
ATTEMPT_DIGITS = 5
"""Digits reserved for the attempt number in pod names (attempts 0..99999, restarts and resumes)."""


KNOWN_TOKENIZERS: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"^meta-llama/(Meta-)?Llama-3(\.[0-9])?-", re.I), 128256),
)
"""Hub tokenizers whose size the validator knows before the download (the trainer measures every tokenizer
again once it has it: checks.vocab_error): Meta's Llama 3, 3.1, 3.2 and 3.3 repositories, 128256 tokens."""


_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]{0,95}$")


def hub_repo_error(repo: str) -> str | None:
    """Why ``repo`` is not a Hugging Face hub repository id (huggingface_hub's validate_repo_id), or None."""
    if repo.startswith(("http://", "https://")) or "huggingface.co/" in repo:
        return (f"{repo!r} is a URL; give the repository id, the part after huggingface.co/, e.g. "
                "meta-llama/Meta-Llama-3.1-8B")
    if not _HUB_ID.match(repo) or "--" in repo or ".." in repo or repo.endswith((".git", "-", ".")):
        return (f"{repo!r} is not a hub repository id: use namespace/name of letters, digits, '-', '_' and '.' "
                "(no spaces, '--' or '..'), e.g. meta-llama/Meta-Llama-3.1-8B")
    return None


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def hub_dataset_error(dataset: str) -> str | None:
    """Why ``dataset`` (``spec.data.huggingface.dataset``) is neither a hub dataset id, an absolute path in the pod
    nor ``builtin``, or None. The trainer hands anything else to ``datasets.load_dataset`` as a hub id."""
    if dataset == "builtin" or dataset.startswith("/"):
        return None
    if dataset != dataset.strip():
        return (f"{dataset!r} has leading or trailing white space; remove it (e.g. {dataset.strip()!r})")
    scheme = _SCHEME.match(dataset)
    if scheme and scheme.group(1).lower() == "hf":
        rest = dataset[len(scheme.group(0)):].removeprefix("datasets/")
        return (f"{dataset!r} is an hf:// URL; give the hub dataset id, the part after hf://datasets/ "
                f"(e.g. {rest or 'allenai/c4'})")
    if scheme and scheme.group(1).lower() in ("s3", "gs", "gcs", "az", "abfs", "file"):
        return (f"{dataset!r} is an object-store or file URL, which the huggingface source does not read; tokenize "
                "the files with `kubetitan prepare-data` and use data.source: shards (docs/data.md), or give a "
                "hub dataset id such as allenai/c4 or an absolute path in the pod")
    if scheme or dataset.startswith(("http://", "https://")) or "huggingface.co/" in dataset:
        return (f"{dataset!r} is a URL; give the hub dataset id (e.g. allenai/c4, the part after "
                "huggingface.co/datasets/), an absolute path in the pod, or builtin")
    if hub_repo_error(dataset) is not None:
        return (f"{dataset!r} is not a hub dataset id: use namespace/name of letters, digits, '-', '_' and '.' "
                "(no spaces, '--' or '..'), e.g. allenai/c4; or give an absolute path in the pod, or builtin")
    return None


def known_tokenizer_vocab(repo: str | None) -> int | None:
    return next((n for pattern, n in KNOWN_TOKENIZERS if repo and pattern.match(repo)), None)


def max_name_length(spec: LlamaPretrainSpec) -> int:
    """The longest run name whose pod hostnames ``<name>-a<attempt>-<rank>`` are DNS labels (<= 63)."""
    return 63 - len("-a") - ATTEMPT_DIGITS - len("-") - len(str(max(spec.resources.nodes - 1, 0)))


# ------------------------------------------------------------------ the predicates, one per rule
@dataclass(frozen=True)
class Facts:
    """A parsed (defaulted) LlamaPretrain and what several rules derive from its spec, computed once."""

    obj: LlamaPretrain
    spec: LlamaPretrainSpec
    world_size: int
    """nodes x processes per node."""
    procs: int
    """Processes per node (torchrun's ``--nproc-per-node``)."""
    others: int
    """dataParallelReplicateDegree x tensorParallelDegree x pipelineParallelDegree x contextParallelDegree."""
    dp_shard: int | None
    """dataParallelShardDegree with -1 resolved; None when the other degrees do not divide the world."""
    dims: ModelDims | None
    """The model's dimensions; None for a custom model without ``custom``."""
    instance: InstanceType | None
    """The catalog's entry for ``resources.instanceType``; None when unset or unknown to the catalog."""
    token: bool
    """Whether ``tokenizer.tokenSecretRef`` is set."""

    @classmethod
    def of(cls, lpt: LlamaPretrain) -> Facts:
        s = lpt.spec
        p = s.parallelism
        others = (p.data_parallel_replicate_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree
                  * p.context_parallel_degree)
        return cls(lpt, s, world_size(s), processes_per_node(s), others, resolved_dp_shard(s), model_dims(s.model),
                   INSTANCE_TYPES.get(s.resources.instance_type or ""), s.tokenizer.token_secret_ref is not None)


Problems = Iterator[tuple[str, str]]
"""What a predicate yields: (wire path, message with the fix) of each violation of its rule."""
Check = Callable[[Any], list[FieldError]]

CHECKS: dict[str, Check] = {}
"""Rule id -> its predicate (registered with :func:`check`): it takes the :class:`Facts` of a parsed object (the raw
``metadata`` mapping for a ``before_parse`` rule) and returns that rule's FieldErrors."""

_IDS = frozenset(r.id for r in RULES)


def check(rule_id: str) -> Callable[[Callable[[Any], Problems]], Check]:
    """Register the predicate of the table's rule ``rule_id``: every error it yields carries that id."""

    def register(fn: Callable[[Any], Problems]) -> Check:
        if rule_id not in _IDS:
            raise LookupError(f"{rule_id!r} is not a RULES entry; add the rule to the table first")
        if rule_id in CHECKS:
            raise ValueError(f"{rule_id!r} has a predicate already ({CHECKS[rule_id].__name__}); one per rule")

        @functools.wraps(fn)
        def errors(subject: Any) -> list[FieldError]:
            return [FieldError(path, message, rule_id) for path, message in fn(subject)]

        CHECKS[rule_id] = errors
        return errors

    return register


def validate(lpt: LlamaPretrain) -> list[FieldError]:
    """All semantic errors of a parsed (defaulted) LlamaPretrain, rule by rule in table order; empty when it is
    good (the ``before_parse`` rules are :func:`parse`'s)."""
    facts = Facts.of(lpt)
    return [e for rule in RULES if not rule.before_parse for e in CHECKS[rule.id](facts)]


def _before_parse_errors(meta: Any) -> list[FieldError]:
    return [e for rule in RULES if rule.before_parse for e in CHECKS[rule.id](meta)]


# ---- metadata
@check("metadata.fields")
def _metadata_fields(meta: Any) -> Problems:
    """What the API server checks in ``metadata`` beyond the name (``metadata.name``'s)."""
    from kubetitan_core.k8sfields import DNS1123_LABEL, label_key_error, label_value_error

    if not isinstance(meta, dict):
        return  # the model refuses it with its path
    for e in _unknown_keys(meta, _OBJECT_META, "metadata."):
        yield e.path, e.message
    ns = meta.get("namespace")
    if isinstance(ns, str) and ns and (len(ns) > 63 or not DNS1123_LABEL.match(ns)):  # "": the context's namespace
        yield "metadata.namespace", (f"{ns!r} is not a namespace name: use at most 63 lower-case letters, digits and "
                                     "'-', starting and ending with a letter or digit (a DNS-1123 label)")
    for key, item in (("finalizers", str), ("ownerReferences", dict)):
        value = meta.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, item) for v in value)):
            yield f"metadata.{key}", (f"must be a list of {'names' if item is str else 'mappings'}; fix it or remove "
                                      "it (the operator sets what it needs)")
    fins = meta.get("finalizers")
    for i, fin in enumerate(fins if isinstance(fins, list) else []):
        if isinstance(fin, str) and (msg := label_key_error(fin)) is not None:
            yield f"metadata.finalizers[{i}]", msg.replace("label key", "finalizer name")
    labels, annotations = meta.get("labels"), meta.get("annotations")
    if isinstance(labels, dict):
        for k, v in labels.items():
            if not isinstance(k, str) or not isinstance(v, str):
                continue  # the model refuses non-strings
            if (msg := label_key_error(k) or label_value_error(v)) is not None:
                yield f"metadata.labels[{k}]", msg
    if isinstance(annotations, dict):
        for k in annotations:
            if isinstance(k, str) and (msg := label_key_error(k)) is not None:
                yield f"metadata.annotations[{k}]", msg.replace("label key", "annotation key")
        size = sum(len(str(k).encode()) + len(str(v).encode()) for k, v in annotations.items())
        if size > MAX_ANNOTATIONS_BYTES:
            yield "metadata.annotations", (f"hold {size} bytes; the API server takes at most {MAX_ANNOTATIONS_BYTES} "
                                           "in all: move the large values elsewhere (a ConfigMap)")


@check("metadata.name")
def _metadata_name(f: Facts) -> Problems:
    name, field = f.obj.metadata.name, "metadata.name"
    gen = (f.obj.metadata.model_extra or {}).get("generateName")
    if not name and isinstance(gen, str) and gen:
        # kubectl create with generateName: the API server appends 5 random lower-case letters and digits
        name, field = gen + "xxxxx", "metadata.generateName"
    if not name:
        yield "metadata.name", "is required: give the run a name"
    elif not _DNS1035.match(name):
        yield field, (f"{name!r} cannot name the run's headless Service (a DNS-1035 label): use lower-case letters, "
                      "digits and '-', starting with a letter and ending with a letter or digit, e.g. 'llama3-8b-run'")
    elif len(name) > (limit := max_name_length(f.spec)):
        yield field, (f"{name!r} is {len(name)} characters; pod hostnames <name>-a<attempt>-<rank> must stay DNS "
                      f"labels of at most 63, so with {f.spec.resources.nodes} node(s) use at most {limit} characters")


# ---- parallel degrees vs processes
@check("parallelism.product")
def _parallelism_product(f: Facts) -> Problems:
    p, r = f.spec.parallelism, f.spec.resources
    if p.data_parallel_shard_degree == 0:
        yield ("spec.parallelism.dataParallelShardDegree",
               "0 is not a degree: set -1 (all remaining processes) or a value >= 1")
    elif p.data_parallel_shard_degree == -1 and f.dp_shard is None:
        yield "spec.parallelism", (
            f"with dataParallelShardDegree -1 the other degrees (replicate x tensor x pipeline x context = "
            f"{f.others}) must divide the {f.world_size} processes (resources.nodes {r.nodes} x {f.procs} per node); "
            "change a degree or the number of nodes")
    elif f.dp_shard is not None and f.dp_shard * f.others != f.world_size:
        yield "spec.parallelism", (
            f"dataParallelShardDegree ({f.dp_shard}) x dataParallelReplicateDegree "
            f"({p.data_parallel_replicate_degree}) x tensorParallelDegree ({p.tensor_parallel_degree}) x "
            f"pipelineParallelDegree ({p.pipeline_parallel_degree}) x contextParallelDegree "
            f"({p.context_parallel_degree}) = {f.dp_shard * f.others} must equal resources.nodes ({r.nodes}) x "
            f"processes per node ({f.procs}) = {f.world_size}; change a degree, or set dataParallelShardDegree: -1 to "
            "use every remaining process")


@check("parallelism.ddp-1d")
def _parallelism_ddp_1d(f: Facts) -> Problems:
    p = f.spec.parallelism
    if f.dp_shard == 1 and p.context_parallel_degree == 1 and p.data_parallel_replicate_degree > 1 \
            and p.tensor_parallel_degree * p.pipeline_parallel_degree > 1:
        # no sharding: torchtitan falls back to DDP, which it supports only as the one parallelism
        yield "spec.parallelism.dataParallelReplicateDegree", (
            f"{p.data_parallel_replicate_degree} replicas with no sharding is DDP, which torchtitan cannot combine "
            f"with tensor ({p.tensor_parallel_degree}) or pipeline ({p.pipeline_parallel_degree}) parallelism; "
            "shard too (dataParallelShardDegree above 1: HSDP) or set the replicate degree to 1")


@check("parallelism.context-seq-len")
def _parallelism_context_seq_len(f: Facts) -> Problems:
    p, t = f.spec.parallelism, f.spec.training
    divisor = p.tensor_parallel_degree * 2 * p.context_parallel_degree
    if t.seq_len % divisor != 0:
        # torchtitan's llama3 parallelize asserts seq_len % (tp x 2 x cp) == 0 (sequence parallel splits the
        # sequence over TP ranks, context parallel's load balancing into 2 x cp chunks), also for tp = cp = 1.
        yield "spec.training.seqLen", (
            f"{t.seq_len} is not divisible by tensorParallelDegree x 2 x contextParallelDegree "
            f"({p.tensor_parallel_degree} x 2 x {p.context_parallel_degree} = {divisor}), which torchtitan "
            f"requires; use a multiple of {divisor}, e.g. {max(divisor, t.seq_len // divisor * divisor)}")


# ---- model
@check("model.custom")
def _model_custom(f: Facts) -> Problems:
    m = f.spec.model
    if m.flavor == "custom" and m.custom is None:
        yield "spec.model.custom", "is required when model.flavor is custom: give dim, nLayers and nHeads"
    if m.flavor != "custom" and m.custom is not None:
        yield "spec.model.custom", f"must be unset when model.flavor is {m.flavor}; remove it or use flavor custom"


@check("model.dims")
def _model_dims(f: Facts) -> Problems:
    if (d := f.dims) is None:
        return
    if d.dim % d.n_heads != 0:
        yield "spec.model.custom.dim", f"{d.dim} is not divisible by nHeads ({d.n_heads}); use a multiple of {d.n_heads}"
    elif (d.dim // d.n_heads) % 2 != 0:  # rotary embeddings rotate pairs of each head's dimensions
        yield "spec.model.custom.dim", (
            f"{d.dim} / nHeads ({d.n_heads}) = {d.dim // d.n_heads} per head is odd, and the rotary position "
            f"embedding needs an even head size; use a multiple of {2 * d.n_heads}")
    if d.n_heads % d.n_kv_heads != 0:
        yield "spec.model.custom.nKvHeads", (f"{d.n_kv_heads} does not divide nHeads ({d.n_heads}); use a divisor of "
                                             f"{d.n_heads}")


@check("model.heads-tp")
def _model_heads_tp(f: Facts) -> Problems:
    if (d := f.dims) is None:
        return
    tp = f.spec.parallelism.tensor_parallel_degree
    if d.n_heads % tp != 0:
        yield "spec.parallelism.tensorParallelDegree", (
            f"{tp} does not divide the model's {d.n_heads} attention heads; use a divisor of {d.n_heads}")
    elif d.n_kv_heads % tp != 0:
        yield "spec.parallelism.tensorParallelDegree", (
            f"{tp} does not divide the model's {d.n_kv_heads} key/value heads; use a divisor of {d.n_kv_heads}")


@check("model.layers-pp")
def _model_layers_pp(f: Facts) -> Problems:
    pp = f.spec.parallelism.pipeline_parallel_degree
    if f.dims is not None and f.dims.n_layers % pp != 0:
        yield "spec.parallelism.pipelineParallelDegree", (
            f"{pp} does not divide the model's {f.dims.n_layers} layers; use a divisor of {f.dims.n_layers}")


@check("tokenizer.vocab")
def _tokenizer_vocab(f: Facts) -> Problems:
    s, d = f.spec, f.dims
    if d is not None:
        hub = known_tokenizer_vocab(s.tokenizer.repo) \
            if s.tokenizer.source == "huggingface" and s.model.flavor == "custom" else None
        if hub is not None and d.vocab_size < hub:
            yield "spec.model.custom.vocabSize", (
                f"{d.vocab_size} is below the {hub} tokens of the {s.tokenizer.repo} tokenizer (token ids past the "
                f"vocabulary crash the embedding); raise vocabSize to at least {hub}")
        if s.tokenizer.source == "builtin" and d.vocab_size < BUILTIN_TOKENIZER_VOCAB:
            yield "spec.model.custom.vocabSize", (
                f"{d.vocab_size} is below the {BUILTIN_TOKENIZER_VOCAB} tokens of the builtin tokenizer; raise "
                f"vocabSize to at least {BUILTIN_TOKENIZER_VOCAB}")
    if s.model.flavor == "debug" and s.tokenizer.source != "builtin":
        yield "spec.tokenizer.source", (
            f"the debug model has a {FLAVOURS['debug'][1].vocab_size}-token vocabulary and needs the builtin "
            "tokenizer; set tokenizer.source: builtin or pick a larger model")


# ---- batch
@check("training.global-batch")
def _training_global_batch(f: Facts) -> Problems:
    t = f.spec.training
    if f.dp_shard is not None and f.dp_shard >= 1 and t.global_batch_size is not None:  # 0: parallelism.product
        dp = f.dp_shard * f.spec.parallelism.data_parallel_replicate_degree
        micro = t.local_batch_size * dp
        if t.global_batch_size % micro != 0:
            yield "spec.training.globalBatchSize", (
                f"{t.global_batch_size} is not a multiple of localBatchSize ({t.local_batch_size}) x data-parallel "
                f"degree ({dp}) = {micro}; use a multiple of {micro} or leave it unset")


@check("training.warmup")
def _training_warmup(f: Facts) -> Problems:
    t = f.spec.training
    if t.warmup_steps >= t.steps and t.steps > 1:
        yield "spec.training.warmupSteps", (f"{t.warmup_steps} warm-up steps leave nothing of the {t.steps} steps; "
                                            "lower warmupSteps below steps")


# ---- hardware (the instance-type rules apply to the types the catalog knows)
@check("resources.gpus")
def _resources_gpus(f: Facts) -> Problems:
    r, it = f.spec.resources, f.instance
    if it is not None and r.gpus_per_node > it.gpus:
        yield "spec.resources.gpusPerNode", (f"{r.gpus_per_node} exceeds the {it.gpus} GPUs of {r.instance_type}; "
                                             f"request at most {it.gpus}")


@check("resources.efa")
def _resources_efa(f: Facts) -> Problems:
    r, it = f.spec.resources, f.instance
    if it is not None and r.efa_per_node is not None and r.efa_per_node > it.efa:
        yield "spec.resources.efaPerNode", (f"{r.efa_per_node} exceeds the {it.efa} EFA interfaces of "
                                            f"{r.instance_type}; request at most {it.efa} or leave it unset")


@check("resources.fit")
def _resources_fit(f: Facts) -> Problems:
    r, it = f.spec.resources, f.instance
    if it is None:
        return
    if it.vcpus and r.cpu is not None and _cpu_cores(r.cpu) > it.vcpus:
        yield "spec.resources.cpu", (
            f"{r.cpu} CPUs exceed the {it.vcpus} vCPUs of {r.instance_type}, so the pod would never be scheduled; "
            f"request at most {int(it.vcpus * 0.9)} (leave room for the node's daemons) or leave it unset")
    if it.memory_gib and r.memory is not None and _gib(r.memory) > it.memory_gib:
        yield "spec.resources.memory", (
            f"{r.memory} exceeds the {it.memory_gib} GiB of {r.instance_type}, so the pod would never be scheduled; "
            f"request at most {int(it.memory_gib * 0.85)}Gi (the node's allocatable memory is lower than the "
            "instance's) or leave it unset")


@check("resources.gpu-product")
def _resources_gpu_product(f: Facts) -> Problems:
    r, it = f.spec.resources, f.instance
    if it is not None and r.gpu_product and r.gpu_product != it.gpu:
        yield "spec.resources.gpuProduct", (
            f"{r.gpu_product} contradicts instance type {r.instance_type}, which has {it.gpu} GPUs (the FP8 check and "
            f"MFU would use {r.gpu_product}); remove gpuProduct or set it to {it.gpu}")


@check("resources.platform")
def _resources_platform(f: Facts) -> Problems:
    r, it = f.spec.resources, f.instance
    if it is not None and it.hyperpod != (r.platform == "hyperpod"):
        want = "hyperpod" if it.hyperpod else "eks or generic"
        yield "spec.resources.platform", (f"instance type {r.instance_type} belongs to platform {want}; set "
                                          "resources.platform accordingly (HyperPod names start with ml.)")


@check("resources.instance-type-selector")
def _resources_instance_type_selector(f: Facts) -> Problems:
    r = f.spec.resources
    for label in (INSTANCE_TYPE_LABEL, "beta.kubernetes.io/instance-type"):
        chosen = r.node_selector.get(label)
        if r.instance_type and chosen is not None and chosen != r.instance_type:
            yield f"spec.resources.nodeSelector[{label}]", (
                f"{chosen!r} contradicts resources.instanceType {r.instance_type!r} (the validator checks GPUs, EFA "
                f"and FP8 against that, the pods would land on {chosen}); remove this label or set instanceType: "
                f"{chosen}")


@check("resources.cpu-model")
def _resources_cpu_model(f: Facts) -> Problems:
    s = f.spec
    if s.resources.gpus_per_node == 0 and s.model.flavor not in ("debug", "custom"):
        yield "spec.resources.gpusPerNode", (f"0 (CPU) cannot train the {s.model.flavor} model; request GPUs or use "
                                             "model.flavor debug")


@check("resources.procs")
def _resources_procs(f: Facts) -> Problems:
    r = f.spec.resources
    if r.processes_per_node is not None and r.gpus_per_node > 0 and r.processes_per_node != r.gpus_per_node:
        yield "spec.resources.processesPerNode", (f"{r.processes_per_node} differs from gpusPerNode "
                                                  f"({r.gpus_per_node}); one process drives one GPU, so leave it "
                                                  "unset on GPU nodes")


# ---- FP8
@check("float8.hardware")
def _float8_hardware(f: Facts) -> Problems:
    r, f8 = f.spec.resources, f.spec.precision.float8
    if not f8.enabled or f8.emulate:
        return
    acc = accelerator_for(r.instance_type, r.gpu_product)
    if r.gpus_per_node == 0:
        yield "spec.precision.float8.enabled", ("FP8 needs GPUs with compute capability >= 8.9; on CPU set "
                                                "precision.float8.emulate: true (tests only)")
    elif acc is not None and not acc.supports_float8:
        yield "spec.precision.float8.enabled", (
            f"{acc.product} has compute capability {acc.compute_capability[0]}.{acc.compute_capability[1]} < 8.9 and "
            "no FP8 tensor cores; disable FP8 or use H100/H200 nodes")


@check("float8.emulate-compile")
def _float8_emulate_compile(f: Facts) -> Problems:
    if f.spec.precision.float8.emulate and f.spec.precision.compile:
        yield "spec.precision.float8.emulate", ("FP8 emulation does not work with torch.compile; set "
                                                "precision.compile: false")


def _all_gather_recipe_ok(f8: Any) -> bool:
    return f8.enabled and f8.recipe == "tensorwise"


@check("float8.all-gather-recipe")
def _float8_all_gather_recipe(f: Facts) -> Problems:
    f8 = f.spec.precision.float8
    if f8.fsdp_float8_all_gather and not _all_gather_recipe_ok(f8):
        yield "spec.precision.float8.fsdpFloat8AllGather", ("needs precision.float8.enabled: true and recipe "
                                                            "tensorwise; set those or turn it off")


@check("float8.all-gather-dp")
def _float8_all_gather_dp(f: Facts) -> Problems:
    f8 = f.spec.precision.float8
    # only once float8.all-gather-recipe holds: one error about the same field at a time
    if f8.fsdp_float8_all_gather and _all_gather_recipe_ok(f8) and f.dp_shard is not None and f.dp_shard <= 1:
        yield "spec.precision.float8.fsdpFloat8AllGather", (
            f"needs a data-parallel shard degree above 1 (it is {f.dp_shard}): with one shard there is nothing to "
            "all-gather; turn it off or add processes")


@check("float8.filter-fqns")
def _float8_filter_fqns(f: Facts) -> Problems:
    for i, fqn in enumerate(f.spec.precision.float8.filter_fqns):
        if not fqn.strip():
            yield f"spec.precision.float8.filterFqns[{i}]", ("is empty, and an empty fragment matches every module "
                                                             "name, so no layer would train in FP8; remove it (or "
                                                             "turn FP8 off)")


@check("float8.precompute-needs-all-gather")
def _float8_precompute_needs_all_gather(f: Facts) -> Problems:
    f8 = f.spec.precision.float8
    if f8.precompute_dynamic_scale and not f8.fsdp_float8_all_gather:
        yield "spec.precision.float8.precomputeDynamicScale", ("needs precision.float8.fsdpFloat8AllGather: true; "
                                                               "set it or turn this off")


# ---- data and tokenizer
@check("data.shards-required")
def _data_shards_required(f: Facts) -> Problems:
    if f.spec.data.source == "shards" and f.spec.data.shards is None:
        yield "spec.data.shards", "is required when data.source is shards: set data.shards.path"


@check("data.mixture-required")
def _data_mixture_required(f: Facts) -> Problems:
    d = f.spec.data
    if d.source == "mixture" and not d.mixture:
        yield "spec.data.mixture", ("is required when data.source is mixture: add the sources, each with "
                                    "shards.path (or huggingface) and a weight")
    elif d.source != "mixture" and d.mixture:
        yield "spec.data.mixture", f"is only read when data.source is mixture (it is {d.source}); set the source or remove it"


@check("data.mixture-source")
def _data_mixture_source(f: Facts) -> Problems:
    for i, m in enumerate(f.spec.data.mixture or []):
        if (m.shards is None) == (m.huggingface is None):
            yield f"spec.data.mixture[{i}]", ("sets " + ("both shards and huggingface" if m.shards else "neither shards "
                                              "nor huggingface") + ": give each source exactly one of them")


@check("data.mixture-schedule-point")
def _data_mixture_schedule_point(f: Facts) -> Problems:
    for i, m in enumerate(f.spec.data.mixture or []):
        for k, p in enumerate(m.schedule.points if m.schedule else []):
            if (p.step is None) == (p.percent is None):
                yield f"spec.data.mixture[{i}].schedule.points[{k}]", ("sets " + ("both step and percent" if p.step
                      is not None else "neither step nor percent") + ": give each point exactly one of them")


@check("data.mixture-schedule")
def _data_mixture_schedule(f: Facts) -> Problems:
    d = f.spec.data
    if d.source != "mixture" or not d.mixture:
        return
    for i, msg in weights.problems(weight_schedules(f.spec), f.spec.training.steps):
        yield ("spec.data.mixture" if i is None else f"spec.data.mixture[{i}]"
               + (".schedule" if d.mixture[i].schedule else ".weight")), msg


@check("data.attention-mask")
def _data_attention_mask(f: Facts) -> Problems:
    d = f.spec.data
    if d.attention_mask != "document":
        return
    if d.source not in ("shards", "mixture") or any(m.huggingface for m in d.mixture or []):
        yield "spec.data.attentionMask", ("document needs the document boundaries of shards (written by `kubetitan "
                                          f"prepare-data`), and data.source {d.source} "
                                          + ("has a huggingface source" if d.source == "mixture" else "has none")
                                          + ": prepare the data into shards, or set attentionMask to causal")
    if f.spec.parallelism.context_parallel_degree > 1:
        yield "spec.data.attentionMask", ("document is not supported with context parallelism (the sequence is split "
                                          "over ranks): set parallelism.contextParallelDegree to 1, or attentionMask "
                                          "to causal")


@check("data.eval-held-out")
def _data_eval_held_out(f: Facts) -> Problems:
    d = f.spec.data
    hub = d.source == "huggingface" or (d.source == "mixture" and any(m.huggingface for m in d.mixture or []))
    if d.eval is not None and hub and d.eval.shards is None:
        what = "data.source huggingface" if d.source == "huggingface" else "a huggingface mixture source"
        yield "spec.data.eval", (f"shards is required with {what}: a streamed dataset has no held-out "
                                 "split; prepare a held-out set with `kubetitan prepare-data` and point "
                                 "data.eval.shards.path at it, or train on shards")


@check("tokenizer.path-required")
def _tokenizer_path_required(f: Facts) -> Problems:
    if f.spec.tokenizer.source == "path" and not f.spec.tokenizer.path:
        yield "spec.tokenizer.path", ("is required when tokenizer.source is path: set it to the directory holding "
                                      "tokenizer.json")


@check("hub.repo-id")
def _hub_repo_id(f: Facts) -> Problems:
    tok, data = f.spec.tokenizer, f.spec.data
    if tok.repo and (msg := hub_repo_error(tok.repo)) is not None:
        yield "spec.tokenizer.repo", msg
    if data.source == "huggingface" and data.huggingface is not None \
            and (msg := hub_dataset_error(data.huggingface.dataset)) is not None:
        yield "spec.data.huggingface.dataset", msg
    for i, m in enumerate(data.mixture or []):
        if m.huggingface is not None and (msg := hub_dataset_error(m.huggingface.dataset)) is not None:
            yield f"spec.data.mixture[{i}].huggingface.dataset", msg


@check("tokenizer.repo-required")
def _tokenizer_repo_required(f: Facts) -> Problems:
    if f.spec.tokenizer.source == "huggingface" and not f.spec.tokenizer.repo:
        yield "spec.tokenizer.repo", ("is required when tokenizer.source is huggingface: set the hub repository, "
                                      "e.g. meta-llama/Meta-Llama-3.1-8B")


# ---- checkpoints and restarts
@check("checkpoint.writable")
def _checkpoint_writable(f: Facts) -> Problems:
    ck = f.spec.checkpoint
    pvc = ck.storage.persistent_volume_claim
    if ck.enabled and pvc is not None and pvc.read_only:
        yield "spec.checkpoint.storage.persistentVolumeClaim.readOnly", (
            "is true, but checkpoints are written there: the first save would fail; set it to false (or "
            "checkpoint.enabled: false to only read)")


@check("restarts.need-checkpoint")
def _restarts_need_checkpoint(f: Facts) -> Problems:
    rp = f.spec.run_policy
    if rp.max_restarts > 0 and not f.spec.checkpoint.enabled:
        yield "spec.runPolicy.maxRestarts", (
            f"{rp.max_restarts} restarts need checkpoint.enabled: true (each restart resumes from the newest "
            "checkpoint); enable checkpoints or set maxRestarts: 0")


@check("precision.loss-chunks-parallelism")
def _loss_chunks_parallelism(f: Facts) -> Problems:
    par = f.spec.parallelism
    if f.spec.precision.loss_chunks > 1 and (par.tensor_parallel_degree > 1 or par.pipeline_parallel_degree > 1):
        yield "spec.precision.lossChunks", (
            f"chunks the output projection and the loss of the whole batch, but tensor parallelism (degree "
            f"{par.tensor_parallel_degree}) or pipeline parallelism (degree {par.pipeline_parallel_degree}) computes "
            "the loss in pieces; set precision.lossChunks to 0, or both degrees to 1")


@check("checkpoint.pinned-needs-gpu")
def _checkpoint_pinned_needs_gpu(f: Facts) -> Problems:
    if f.spec.checkpoint.async_mode == "async_with_pinned_mem" and f.spec.resources.gpus_per_node == 0:
        yield "spec.checkpoint.asyncMode", (
            "async_with_pinned_mem stages each save into pinned host memory with non-blocking copies from the GPU, "
            "and a CPU pod (resources.gpusPerNode: 0) has no GPU: its first save would fail; use asyncMode: async "
            "(or disabled) on CPU pods")


@check("in-process-restarts.need-checkpoint")
def _in_process_restarts_need_checkpoint(f: Facts) -> Problems:
    rp = f.spec.run_policy
    if rp.in_process_restarts > 0 and not f.spec.checkpoint.enabled:
        yield "spec.runPolicy.inProcessRestarts", (
            f"{rp.in_process_restarts} in-process restarts need checkpoint.enabled: true (each loads the newest "
            "saved state); enable checkpoints or set inProcessRestarts: 0")


@check("checkpoint.keep-latest-k")
def _checkpoint_keep_latest_k(f: Facts) -> Problems:
    ck = f.spec.checkpoint
    if ck.keep_latest_k == 1 and ck.enabled:  # torchtitan checks it only with checkpointing on
        yield "spec.checkpoint.keepLatestK", ("must be 0 (keep all) or at least 2, so that a cut-off newest save "
                                              "never leaves nothing to resume from")


def _storage_count(f: Facts) -> int:
    st = f.spec.checkpoint.storage
    return sum(x is not None for x in (st.persistent_volume_claim, st.host_path, st.s3))


@check("checkpoint.one-storage")
def _checkpoint_one_storage(f: Facts) -> Problems:
    if _storage_count(f) > 1:
        yield "spec.checkpoint.storage", ("has more than one location; keep only one of persistentVolumeClaim, "
                                          "hostPath and s3")


@check("checkpoint.storage-required")
def _checkpoint_storage_required(f: Facts) -> Problems:
    nodes = f.spec.resources.nodes
    if f.spec.checkpoint.enabled and _storage_count(f) == 0 and nodes > 1:
        yield "spec.checkpoint.storage", (f"a {nodes}-node run needs shared checkpoint storage: set "
                                          "persistentVolumeClaim (ReadWriteMany, e.g. FSx for Lustre) or s3")


@check("checkpoint.host-path-single-node")
def _checkpoint_host_path_single_node(f: Facts) -> Problems:
    if f.spec.checkpoint.storage.host_path is not None and f.spec.resources.nodes > 1:
        yield "spec.checkpoint.storage.hostPath", ("is per node and cannot hold a multi-node checkpoint; use a "
                                                   "ReadWriteMany persistentVolumeClaim (e.g. FSx for Lustre)")


@check("checkpoint.s3-uri")
def _checkpoint_s3_uri(f: Facts) -> Problems:
    s3 = f.spec.checkpoint.storage.s3
    if s3 is not None and (msg := s3_uri_error(s3.uri)) is not None:
        yield "spec.checkpoint.storage.s3.uri", msg


@check("checkpoint.s3-endpoint")
def _checkpoint_s3_endpoint(f: Facts) -> Problems:
    s3 = f.spec.checkpoint.storage.s3
    if s3 is not None and s3.endpoint is not None and (msg := s3_endpoint_error(s3.endpoint)) is not None:
        yield "spec.checkpoint.storage.s3.endpoint", msg


@check("data.s3-uri")
def _data_s3_uri(f: Facts) -> Problems:
    for p in spec_shards_paths(f.spec):
        if is_s3_uri(p.path) and (msg := s3_uri_error(p.path)) is not None:
            yield f"spec.{p.spec_field}", msg


@check("data.s3-endpoint")
def _data_s3_endpoint(f: Facts) -> Problems:
    s3 = f.spec.data.s3
    if s3 is not None and s3.endpoint is not None and (msg := s3_endpoint_error(s3.endpoint)) is not None:
        yield "spec.data.s3.endpoint", msg


@check("data.s3-one-secret")
def _data_s3_one_secret(f: Facts) -> Problems:
    d, c = f.spec.data.s3, f.spec.checkpoint.storage.s3
    a = d.credentials_secret_ref if d is not None else None
    b = c.credentials_secret_ref if c is not None else None
    if a is not None and b is not None and a != b:
        yield "spec.data.s3.credentialsSecretRef", (
            f"names Secret {a.name!r} but checkpoint.storage.s3.credentialsSecretRef names {b.name!r} (or other keys); "
            "the pod has one AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY for every S3 request: use one Secret whose "
            "credentials can read the data and write the checkpoints, or remove one of them")


@check("run-policy.backoff-order")
def _run_policy_backoff_order(f: Facts) -> Problems:
    rp = f.spec.run_policy
    if rp.max_backoff_seconds < rp.backoff_seconds:
        yield "spec.runPolicy.maxBackoffSeconds", (f"{rp.max_backoff_seconds} is below backoffSeconds "
                                                   f"({rp.backoff_seconds}); raise it")


# ---- elastic training (runPolicy.elastic)
@check("elastic.range")
def _elastic_range(f: Facts) -> Problems:
    e, n = f.spec.run_policy.elastic, f.spec.resources.nodes
    if e is None:
        return
    top = e.max_nodes if e.max_nodes is not None else n
    if e.min_nodes > n:
        yield "spec.runPolicy.elastic.minNodes", (f"{e.min_nodes} is above resources.nodes ({n}), the size the run "
                                                 f"starts at; set minNodes to at most {n}")
    if top < n:
        yield "spec.runPolicy.elastic.maxNodes", (f"{top} is below resources.nodes ({n}), the size the run starts at; "
                                                 f"set maxNodes to at least {n} or leave it unset (= {n})")


_SIZE_RULES = ("parallelism.product", "parallelism.ddp-1d", "training.global-batch", "float8.all-gather-dp",
               "metadata.name")
"""The rules that depend on the gang's size: ``elastic.layouts`` runs them at every size of the elastic range."""


def _size_errors(f: Facts, n: int) -> list[FieldError]:
    """The size-dependent errors of the spec at ``n`` nodes (the global batch pinned as an elastic run pins it)."""
    spec = at_size(f.spec, n)
    if spec is f.spec:  # the spec's own size: its own rules report it
        return []
    if spec.training.global_batch_size is None:
        spec.training.global_batch_size = global_batch(f.spec)
    sized = Facts.of(f.obj.model_copy(update={"spec": spec}))
    return [e for rid in _SIZE_RULES for e in CHECKS[rid](sized)]


@check("elastic.layouts")
def _elastic_layouts(f: Facts) -> Problems:
    s, e = f.spec, f.spec.run_policy.elastic
    if e is None:
        return
    if s.parallelism.data_parallel_shard_degree != -1:
        yield "spec.parallelism.dataParallelShardDegree", (
            f"{s.parallelism.data_parallel_shard_degree} fixes the number of processes, so the gang cannot change "
            "size; set dataParallelShardDegree: -1 (every process the other degrees leave) with runPolicy.elastic")
        return
    sizes = list(elastic_sizes(s))
    gb = global_batch(s)
    if len(sizes) < 2 or gb is None or s.resources.nodes not in sizes:
        return  # one size: the spec's own rules; no global batch: parallelism.product, a bad range: elastic.range
    bad = {n: errs for n in sizes if (errs := _size_errors(f, n))}
    if not bad:
        return
    good = [n for n in sizes if n not in bad]
    per = "; ".join(f"at {n} node(s) {errs[0].message.split('; ')[0]}" for n, errs in bad.items())  # the what
    fix = [f"narrow minNodes..maxNodes to sizes that work ({', '.join(map(str, good))})" if good else
           "no size in the range works"]
    batch_bad = [n for n, errs in bad.items() if all(x.rule == "training.global-batch" for x in errs)]
    if batch_bad:
        micro = [s.training.local_batch_size * (dp_degree(at_size(s, n)) or 1) for n in sizes]
        lcm = math.lcm(*micro)
        fix.append(f"or set training.globalBatchSize to a multiple of {lcm} (localBatchSize x the data-parallel "
                   f"degree of every size: {', '.join(map(str, micro))}) so that gradient accumulation keeps it "
                   "exactly at every size")
    which = f"sizes {', '.join(map(str, bad))} are not valid layouts" if len(bad) > 1 else \
        f"size {next(iter(bad))} is not a valid layout"
    yield "spec.runPolicy.elastic", (
        f"{which} of minNodes..maxNodes ({sizes[0]}..{sizes[-1]}) "
        f"for a global batch of {gb} samples: {per}; {' '.join(fix)}")


@check("elastic.data")
def _elastic_data(f: Facts) -> Problems:
    if f.spec.run_policy.elastic is None:
        return
    streamed = contract.per_rank_sources(f.spec.data)
    if streamed:
        yield "spec.data", (
            f"runPolicy.elastic resumes the run at another data-parallel degree, but {', '.join(streamed)} "
            "keep(s) a per-rank position in a streamed Hugging Face dataset that cannot be resumed at another degree; "
            "tokenize the data into shards first (kubetitan prepare-data, data.source: shards) or remove "
            "runPolicy.elastic")


@check("elastic.needs-checkpoint")
def _elastic_needs_checkpoint(f: Facts) -> Problems:
    if f.spec.run_policy.elastic is not None and not f.spec.checkpoint.enabled:
        yield "spec.checkpoint.enabled", ("runPolicy.elastic resizes the gang by resuming a checkpoint at the new "
                                          "size; set checkpoint.enabled: true or remove runPolicy.elastic")


@check("monitoring.port")
def _monitoring_port(f: Facts) -> Problems:
    if f.spec.monitoring.metrics_port == 29500:
        yield "spec.monitoring.metricsPort", "29500 is torchrun's rendezvous port; pick another"


# ---- the fields that become pod fields: paths, mounts, env, Kubernetes syntax
@check("path.no-dot-dot")
def _path_no_dot_dot(f: Facts) -> Problems:
    s = f.spec
    paths = [("checkpoint.mountPath", s.checkpoint.mount_path), ("data.mountPath", s.data.mount_path),
             ("checkpoint.storage.hostPath", s.checkpoint.storage.host_path), ("tokenizer.path", s.tokenizer.path)]
    paths += [(p.spec_field, p.path) for p in spec_shards_paths(s) if not is_s3_uri(p.path)]  # s3://: data.s3-uri
    for path, value in paths:
        if value is not None and ".." in value.split("/"):
            yield f"spec.{path}", f"{value!r} contains a '..' component; give the absolute path without it"
        elif value is not None and not value.startswith("/"):  # the CRD's pattern covers the others
            yield f"spec.{path}", (f"{value!r} is relative (to the trainer's working directory); give the absolute "
                                   "path in the pod, e.g. /data/shards")


@check("mounts.no-collision")
def _mounts_no_collision(f: Facts) -> Problems:
    mounts = mount_points(f.spec)
    for i, (pa, a) in enumerate(mounts):  # the operator's own mounts come first and never collide
        for pb, b in mounts[:i]:
            if _inside(_norm(a), _norm(b)) or _inside(_norm(b), _norm(a)):
                yield f"spec.{pa}", (f"{a!r} collides with {pb} {b!r} (a mount may not be at, above or inside "
                                     "another); move it to a separate directory, e.g. /data or /checkpoints")


@check("pod.env")
def _pod_env(f: Facts) -> Problems:
    for path, msg in k8sfields.env_errors(f.spec.resources.env, "resources.env"):
        yield f"spec.{path}", msg


def _env_names(f: Facts) -> Iterator[tuple[int, str]]:
    """(index, name) of each ``resources.env`` entry with a string name (``pod.env`` reports the others)."""
    for i, e in enumerate(f.spec.resources.env):
        name = e.get("name") if isinstance(e, dict) else None
        if isinstance(name, str):
            yield i, name


@check("env.reserved")
def _env_reserved(f: Facts) -> Problems:
    for i, name in _env_names(f):
        if contract.env_reserved(name):
            yield f"spec.resources.env[{i}].name", (
                f"{name!r} is set by the operator or the launcher and may not be overridden (reserved: "
                + ", ".join(p + "*" for p in contract.RESERVED_ENV_PREFIXES) + ", "
                + ", ".join(contract.RESERVED_ENV_NAMES) + "); remove it or rename it")


@check("env.secret-backed")
def _env_secret_backed(f: Facts) -> Problems:
    for i, name in _env_names(f):
        # a reserved name is env.reserved's error only
        if f.token and name == contract.SECRET_ENV_TOKEN and not contract.env_reserved(name):
            yield f"spec.resources.env[{i}].name", (
                f"{name} comes from tokenizer.tokenSecretRef; remove this variable (or remove tokenSecretRef and "
                "reference the Secret here with valueFrom.secretKeyRef)")


@check("env.unique")
def _env_unique(f: Facts) -> Problems:
    seen: dict[str, int] = {}
    for i, name in _env_names(f):
        if name in seen:
            yield f"spec.resources.env[{i}].name", f"{name!r} is already set by resources.env[{seen[name]}]; keep one"
        seen.setdefault(name, i)


@check("pod.tolerations")
def _pod_tolerations(f: Facts) -> Problems:
    for path, msg in k8sfields.toleration_errors(f.spec.resources.tolerations, "resources.tolerations"):
        yield f"spec.{path}", msg


@check("pod.affinity")
def _pod_affinity(f: Facts) -> Problems:
    if f.spec.resources.affinity is not None:
        for path, msg in k8sfields.affinity_errors(f.spec.resources.affinity, "resources.affinity"):
            yield f"spec.{path}", msg


@check("pod.node-selector")
def _pod_node_selector(f: Facts) -> Problems:
    for path, msg in k8sfields.node_selector_errors(f.spec.resources.node_selector, "resources.nodeSelector"):
        yield f"spec.{path}", msg


@check("pod.image")
def _pod_image(f: Facts) -> Problems:
    if (msg := k8sfields.image_error(f.spec.resources.image)) is not None:
        yield "spec.resources.image", msg


@check("pod.names")
def _pod_names(f: Facts) -> Problems:
    s = f.spec
    r, tok, pvc = s.resources, s.tokenizer, s.checkpoint.storage.persistent_volume_claim
    s3_secret = s.checkpoint.storage.s3.credentials_secret_ref if s.checkpoint.storage.s3 else None
    data_secret = s.data.s3.credentials_secret_ref if s.data.s3 else None
    names: list[tuple[str, str | None, str]] = [
        ("resources.serviceAccountName", r.service_account_name, "ServiceAccount"),
        ("resources.priorityClassName", r.priority_class_name, "PriorityClass"),
        ("scheduling.schedulerName", s.scheduling.scheduler_name, "scheduler"),
        ("tokenizer.tokenSecretRef.name", tok.token_secret_ref.name if tok.token_secret_ref else None, "Secret"),
        ("checkpoint.storage.persistentVolumeClaim.claimName", pvc.claim_name if pvc else None,
         "PersistentVolumeClaim"),
        ("data.volume.claimName", s.data.volume.claim_name if s.data.volume else None, "PersistentVolumeClaim"),
        ("checkpoint.storage.s3.credentialsSecretRef.name", s3_secret.name if s3_secret else None, "Secret"),
        ("data.s3.credentialsSecretRef.name", data_secret.name if data_secret else None, "Secret"),
    ]
    names += [(f"resources.imagePullSecrets[{i}]", n, "Secret") for i, n in enumerate(r.image_pull_secrets)]
    for path, value, what in names:
        if value is not None and (msg := k8sfields.subdomain_error(value, what)) is not None:
            yield f"spec.{path}", msg
    if tok.token_secret_ref is not None and (msg := k8sfields.key_error(tok.token_secret_ref.key)) is not None:
        yield "spec.tokenizer.tokenSecretRef.key", msg
    for where, secret in (("checkpoint.storage.s3", s3_secret), ("data.s3", data_secret)):
        if secret is None:
            continue
        for field, key in (("accessKeyIdKey", secret.access_key_id_key),
                           ("secretAccessKeyKey", secret.secret_access_key_key)):
            if (msg := k8sfields.key_error(key)) is not None:
                yield f"spec.{where}.credentialsSecretRef.{field}", msg
    if r.instance_type is not None and (msg := k8sfields.label_value_error(r.instance_type)):
        yield "spec.resources.instanceType", f"becomes the pods' node selector node.kubernetes.io/instance-type: {msg}"
    if s.scheduling.queue_name == "":
        yield "spec.scheduling.queueName", ("is empty, which Kueue reads as no queue (the pods would not be queued); "
                                            "set the LocalQueue's name or remove the key")
    elif s.scheduling.queue_name is not None and (msg := k8sfields.label_value_error(s.scheduling.queue_name)):
        yield "spec.scheduling.queueName", f"becomes the pod label kueue.x-k8s.io/queue-name: {msg}"


# ------------------------------------------------------------------ helpers of the predicates
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4 = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


def s3_uri_error(uri: str) -> str | None:
    """Why ``uri`` is not a usable ``s3://bucket[/prefix]`` location of checkpoints or shards (None when it is)."""
    if not is_s3_uri(uri):
        return f"{uri!r} is not an s3:// URI; use the form s3://bucket/prefix"
    bucket, _, prefix = uri[len(S3_SCHEME):].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket or _IPV4.match(bucket) or bucket.startswith("xn--"):
        return (f"{bucket!r} is not an S3 bucket name: 3-63 characters of lowercase letters, digits, '.' and '-', "
                "starting and ending with a letter or digit, no '..', not an IP address; use the bucket's real name")
    parts = prefix.rstrip("/").split("/") if prefix.rstrip("/") else []
    if any(p in ("", ".", "..") for p in parts):
        return (f"the prefix {prefix!r} has an empty, '.' or '..' segment; use s3://{bucket}/a/b (one prefix per "
                "run: each save goes to <prefix>/step-N/)")
    return None


def s3_endpoint_error(endpoint: str) -> str | None:
    """Why ``endpoint`` is not an acceptable S3-compatible endpoint URL (None when it is)."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(endpoint)
        _ = u.port
    except ValueError as e:
        return f"{endpoint!r} is not a URL ({e}); use the form https://host[:port]"
    if u.scheme not in ("https", "http"):
        return f"{endpoint!r} is not an http(s) URL; use the server's https:// URL"
    if not u.hostname or u.username or u.password or u.path not in ("", "/") or u.query or u.fragment:
        return f"{endpoint!r} has credentials, a path or a query; use the form https://host[:port]"
    return None




def _cpu_cores(q: str) -> float:
    """``resources.cpu`` (pattern ``^[0-9]+(\\.[0-9]+|m)?$``) in cores."""
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _gib(q: str) -> float:
    """``resources.memory`` (pattern ``^[0-9]+(Ki|Mi|Gi|Ti)?$``) in GiB."""
    for suffix, scale in (("Ki", 2**-20), ("Mi", 2**-10), ("Gi", 1), ("Ti", 2**10)):
        if q.endswith(suffix):
            return int(q[:-2]) * scale
    return int(q) / 2**30


def mount_points(s: LlamaPretrainSpec) -> list[tuple[str, str]]:
    """(spec field path, mount path) of every volume mount of a trainer pod, the operator's own first."""
    ck, data = s.checkpoint, s.data
    mounts = [("(the operator's config mount)", CONFIG_MOUNT), ("(the operator's /dev/shm mount)", SHM_MOUNT)]
    if ck.enabled and (ck.storage.persistent_volume_claim is not None or ck.storage.host_path is not None):
        mounts.append(("checkpoint.mountPath", ck.mount_path))
    if reads_s3_shards(s):
        mounts.append(("(the operator's staging mount for s3:// shards)", DATA_STAGE_MOUNT))
    if data.volume is not None:
        mounts.append(("data.mountPath", data.mount_path))
    return mounts


def _norm(path: str) -> str:
    return "/" + "/".join(p for p in path.split("/") if p and p != ".")


def _inside(a: str, b: str) -> bool:
    """Whether path ``a`` is ``b`` or below it."""
    return a == b or a.startswith(b.rstrip("/") + "/")


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for x in loc:
        if isinstance(x, int) and parts:  # a list index: field[3]
            parts[-1] = f"{parts[-1]}[{x}]"
        elif isinstance(x, int):  # a mapping key that is not a string, at the top (YAML's `0:`)
            parts.append(f"[{x}]")
        elif x in ("function-after", "function-before", "literal_error") or str(x).startswith("function-"):
            continue
        else:
            parts.append(str(x))
    return ".".join(parts)


def _pydantic_errors(e: ValidationError) -> list[FieldError]:
    out = []
    for d in e.errors():
        path = _loc_to_path(d["loc"])
        kind = d["type"]
        if kind == "extra_forbidden":
            near = _closest(str(d["loc"][-1]), _fields_at(d["loc"][:-1]))
            msg = (f"unknown field; did you mean {near!r}? rename it (or remove it)" if near else
                   "unknown field; remove it (see `kubectl explain llamapretrain.spec` or docs/api.md for the fields)")
        elif kind == "invalid_key":
            what = {"int": "a number", "float": "a number", "bool": "true/false", "NoneType": "null"}.get(
                type(d.get("input")).__name__, type(d.get("input")).__name__)
            msg = (f"the key {d.get('input')!r} is not a field name (YAML read it as {what}); remove it, or quote it "
                   "if it was meant as a name")
        elif kind == "literal_error":
            msg = f"{d.get('input')!r} is not allowed: {d['msg'].replace('Input should be', 'use')}"
        elif kind == "missing":
            msg = "is required"
        elif kind == "string_type" and isinstance(d.get("input"), (bool, int, float)):
            what = "boolean" if isinstance(d["input"], bool) else "number"
            msg = (f"must be a string, got the {what} {str(d['input']).lower() if what == 'boolean' else d['input']} "
                   "(YAML reads unquoted true/false/yes/no/y/n/on/off as booleans and digits as numbers); quote the "
                   "value")
        else:
            msg = d["msg"].replace("Input should be", "must be").replace("String should", "must")
            msg = f"{msg} (got {d.get('input')!r}); fix the value (bounds and allowed values: docs/api.md)"
        out.append(FieldError(path, msg, "schema"))
    return out


def _python_names(value: Any, model: Any, path: str) -> list[FieldError]:
    """Keys spelled the Python way (``seq_len``) where the API has camelCase (``seqLen``): the API server refuses them."""
    if not isinstance(value, dict):
        return []
    out: list[FieldError] = []
    for name, field in model.model_fields.items():
        alias = field.alias or name
        if name != alias and name in value:
            out.append(FieldError(f"{path}.{name}", f"unknown field; the API spells it {alias!r}: rename it", "schema"))
        sub = model_in(field.annotation)
        if sub is not None and alias in value:
            items = value[alias] if isinstance(value[alias], list) else [value[alias]]
            for i, item in enumerate(items):
                where = f"{path}.{alias}[{i}]" if isinstance(value[alias], list) else f"{path}.{alias}"
                out += _python_names(item, sub, where)
    return out


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _out_of_range(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and not INT64_MIN <= v <= INT64_MAX


def _unrepresentable(value: Any, path: str) -> list[FieldError]:
    """Values the API server cannot take anywhere in spec: ``key: null`` (the CRD has no nullable field) and
    integers outside int64 (every integer field is int64 there)."""
    out: list[FieldError] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        where = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}"
        if v is None:
            out.append(FieldError(where, "is null, which the API server refuses; remove the key to leave it unset "
                                  "(its default applies) or give a value", "schema"))
        elif _out_of_range(v):
            out.append(FieldError(where, f"{str(v)[:24]}{'...' if len(str(v)) > 24 else ''} is outside the 64-bit "
                                  f"integer range the API server accepts ({INT64_MIN} to {INT64_MAX}); "
                                  "give a smaller value", "schema"))
        else:
            out += _unrepresentable(v, where)
    return out


def parse(obj: Any) -> tuple[LlamaPretrain | None, list[FieldError]]:
    """Parse a raw object (from YAML or the API) into a defaulted LlamaPretrain.

    Returns the object and every error; the object is None when it cannot be parsed at all.
    Semantic errors are included only when the object parsed.
    """
    if not isinstance(obj, dict):
        return None, [FieldError("<document>", f"expected a YAML mapping (a LlamaPretrain object), got "
                                 f"{_type_name(obj)}; use a mapping with apiVersion: {API_VERSION}, "
                                 f"kind: {KIND}, metadata and spec")]
    errs: list[FieldError] = []
    if obj.get("apiVersion") != API_VERSION:
        errs.append(FieldError("apiVersion", f"{obj.get('apiVersion')!r} is not served here; use {API_VERSION}",
                               "schema"))
    if obj.get("kind") != KIND:
        errs.append(FieldError("kind", f"{obj.get('kind')!r} is not {KIND}; set kind: {KIND} (this file is not a "
                               "LlamaPretrain otherwise)", "schema"))
    if errs:
        return None, errs + _unknown_keys(obj, _TOP_LEVEL, "")
    meta_errs = _before_parse_errors(obj.get("metadata"))
    body = {k: v for k, v in obj.items() if k != "status"}
    if named := _python_names(body.get("spec"), LlamaPretrainSpec, "spec"):
        return None, named
    if nulls := _unrepresentable(body.get("spec"), "spec"):
        body = {**body, "spec": _without_unrepresentable(body["spec"])}  # report the rest as if those keys were unset
    try:
        lpt = LlamaPretrain.model_validate(body)
    except ValidationError as e:
        return None, meta_errs + nulls + _pydantic_errors(e)
    if nulls or meta_errs:
        return None, meta_errs + nulls + validate(lpt)
    return lpt, validate(lpt)


_TOP_LEVEL = ("apiVersion", "kind", "metadata", "spec", "status")
_OBJECT_META = ("name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
                "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations",
                "ownerReferences", "finalizers", "managedFields")
"""The fields of Kubernetes' ObjectMeta (apimachinery meta/v1): the API server refuses any other key in metadata."""
MAX_ANNOTATIONS_BYTES = 256 * 1024
"""The API server's limit on the total size of an object's annotations (keys + values)."""


def _closest(name: str, known: Any) -> str | None:
    """The known field a misspelt ``name`` most likely meant (``trainig`` -> ``training``), or None."""
    import difflib

    known = list(known)
    folded = {k.lower().replace("_", ""): k for k in known}
    if name.lower().replace("_", "") in folded:
        return folded[name.lower().replace("_", "")]
    hit = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return hit[0] if hit else None


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The wire names of the fields of the model at ``loc`` inside a LlamaPretrain (empty if not a model)."""
    model: Any = LlamaPretrain
    for part in loc:
        if isinstance(part, int):
            continue
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        model = model_in(field.annotation) if field is not None else None
        if model is None:
            return []
    return [f.alias or n for n, f in model.model_fields.items()]


def _type_name(v: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "nothing (null)"}.get(type(v), type(v).__name__)


def _unknown_keys(obj: dict[Any, Any], known: tuple[str, ...], prefix: str) -> list[FieldError]:
    out = []
    for k in obj:
        if k in known:
            continue
        near = _closest(str(k), known)
        hint = f"did you mean {near!r}? rename it (or remove it)" if near else \
            f"remove it (the fields here: {', '.join(known)})"
        out.append(FieldError(f"{prefix}{k}", f"unknown field; {hint}", "schema"))
    return out


def _without_unrepresentable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_unrepresentable(v) for k, v in value.items() if v is not None and not _out_of_range(v)}
    if isinstance(value, list):
        return [_without_unrepresentable(v) for v in value if v is not None and not _out_of_range(v)]
    return value

