"""What the trainer and the operator agree on: exit codes, env, file names, metric names.

Both sides import these constants; neither restates them. The typed parts live in submodules:
:mod:`kubetitan_core.contract.launcher` (the launcher's arguments), :mod:`kubetitan_core.contract.trainer_toml`
(the ``[kubetitan]`` table of ``trainer.toml``) and :mod:`kubetitan_core.contract.failure` (the in-place restart's
failure report). Pure, torch-free.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the contract stays import-free at run time
    from kubetitan_core.api import DataSpec


class ExitCode(IntEnum):
    """Exit codes of the trainer process (and so of the pod's container).

    The operator's restart decision classifies failures by these codes; docs/api.md lists them.
    """

    OK = 0
    """Training reached `spec.training.steps`; the final checkpoint is saved."""
    FAILED = 1
    """Unclassified error (a Python exception, a collective timeout). Retryable."""
    CONFIG_ERROR = 2
    """The configuration cannot work (bad value, missing file, unknown flavour). Not retried."""
    NON_FINITE_LOSS = 3
    """The loss became NaN or infinite. Retried from the last checkpoint; repeated ones stop the run."""
    STORAGE_FULL = 4
    """The checkpoint volume has less free space than a save needs (checked before each save). Not retried:
    free space or enlarge the volume, then re-create the run."""
    NETWORK_NOT_EFA = 5
    """EFA was requested on `eks`/`hyperpod` but NCCL did not use it (no aws-ofi-nccl plugin, or not its
    `efa` provider), checked after the first step. Not retried: use an image with the plugin (see
    `images/trainer.Dockerfile`) or set `spec.resources.networkFallback: AllowSockets`."""
    RETRYABLE = 6
    """A transient failure that outlasted the trainer's own retries: the tokenizer download or the opening of a hub
    dataset kept failing with connection errors, timeouts, HTTP 429 or 5xx (capped exponential backoff with jitter
    first), or a streamed hub dataset broke mid-way after the `datasets` library's own retries; or checkpoint saves
    failed `spec.checkpoint.maxFailedSaves` times in a row, or a checkpoint store the run reached
    before did not answer its start's pre-flight. Restarted like any
    failure (cause `ContainerFailed`, counted against `spec.runPolicy.maxRestarts`); to keep the hub out of the run,
    prepare the corpus into shards (`kubetitan prepare-data`) or pre-download it (`HF_HUB_OFFLINE=1`)."""
    HANG = 7
    """A launcher's watchdog stopped its workers: a step stood still for the hang limit (`runPolicy.hangTimeoutSeconds`,
    `hangTimeoutPolicy`). With in-place restarts on, every rank's workers restart in place (cause `Hang`); once those
    are used up the launcher exits with this code and the gang is re-created (cause `Hang`)."""
    PREFLIGHT_FAILED = 8
    """The pod's pre-flight gate (`spec.runPolicy.preflight`) found its node unfit before any worker started: fewer
    GPUs than `resources.gpusPerNode`, another GPU model than the spec names, uncorrectable ECC errors or a row remap
    pending or failed (NVML), a matrix product with a wrong result or below the card's floor, a failed local
    all-reduce, or fewer EFA devices than requested. The termination message names the node and the checks. The gang
    is re-created without that node (cause `PreflightFailed`)."""
    TERMINATED_CHECKPOINTED = 75
    """SIGTERM received (suspend, preemption, node drain); a full checkpoint was saved. Resumable."""


# Exit codes the kernel produces: 128 + signal number.
EXIT_SIGKILL = 137
EXIT_SIGTERM = 143

# ---- environment the planner sets on every training pod and the trainer reads
ENV_ATTEMPT = "KUBETITAN_ATTEMPT"
ENV_JOB_NAME = "KUBETITAN_JOB_NAME"
ENV_JOB_NAMESPACE = "KUBETITAN_JOB_NAMESPACE"
ENV_JOB_START_TIME = "KUBETITAN_JOB_START_TIME"  # unix seconds of the run's first attempt
ENV_POD_IP = "KUBETITAN_POD_IP"
ENV_NODE_NAME = "KUBETITAN_NODE_NAME"
# ---- set by the launcher on its workers when in-place restarts are on (launch.py --max-restarts=N)
ENV_RESTART_GENERATION = "KUBETITAN_RESTART_GENERATION"
"""Worker generation within the attempt: 0 for the first workers, +1 each time the launchers restarted every
rank's workers in place. The same on every rank (one rendezvous round per generation), unlike torchrun's
``TORCHELASTIC_RESTART_COUNT``, which counts only the local agent's own failures."""
ENV_RESTART_FAILURE = "KUBETITAN_RESTART_FAILURE"
"""JSON ``{"exit_code", "node_rank", "local_rank", "time"}`` of the worker failure that started this generation
(the earliest one any rank's launcher reported); unset in generation 0."""

ENV_NO_USER_SITE = "PYTHONNOUSERSITE"
"""Set to ``1`` by the operator on every training pod (and reserved): no Python process of the pod adds the user
site directory (``~/.local/lib/pythonX.Y/site-packages``), whose ``.pth`` files would run code from wherever the
home directory is, e.g. a writable claim. The launcher itself also runs with ``-s`` (:data:`TRAINER_COMMAND`)."""

# ---- environment a spec may not set (spec.resources.env): the operator's and the launchers' own variables.
# A user value would silently break the run (the attempt number, the rendezvous, torchrun's per-process ranks).
# Other operator defaults (NCCL_DEBUG, FI_*, TORCH_NCCL_*) may be replaced by a same-named spec variable.
RESERVED_ENV_PREFIXES = ("KUBETITAN_", "TORCHELASTIC_", "PET_")
"""Prefixes of reserved names: ours; torchrun's agent state; torchrun's env-var form of its flags (PET_NNODES)."""
RESERVED_ENV_NAMES = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "NODE_RANK",
    "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", ENV_NO_USER_SITE,
)
"""Exact reserved names: the rendezvous address and the per-process ranks and sizes torchrun sets on its
workers, the launcher's switch for the in-place rendezvous store, and the GPU selection: the device plugin
gives the pod its GPUs (with its default envvar strategy through NVIDIA_VISIBLE_DEVICES, so a pod setting
NVIDIA_VISIBLE_DEVICES=all could reach every GPU of the node) and torchrun maps LOCAL_RANK onto them
(CUDA_VISIBLE_DEVICES would hide some from the workers), and the operator's switch that keeps Python's user site
off (:data:`ENV_NO_USER_SITE`)."""
SECRET_ENV_TOKEN = "HF_TOKEN"
"""Set from ``spec.tokenizer.tokenSecretRef`` (a Secret); a plain spec variable of this name is refused then."""


def env_reserved(name: str) -> bool:
    """Whether ``spec.resources.env`` may not set ``name``."""
    return name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES)


# ---- object-store locations (checkpoints, shards): s3://bucket[/prefix]
S3_SCHEME = "s3://"


def is_s3_uri(path: str) -> bool:
    """Whether a checkpoint or shards location is an object-store URI (``s3://...``) rather than a filesystem path."""
    return str(path).startswith(S3_SCHEME)


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")`` (no leading or trailing slash); ValueError for a
    string that is not an ``s3://`` URI or names no bucket. Whether the bucket and prefix are usable is
    ``kubetitan_core.validation.s3_uri_error``."""
    if not is_s3_uri(uri):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, prefix = uri[len(S3_SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    return bucket, prefix.strip("/")


# ---- the trainer's process
TRAINER_PYTHON = "/opt/conda/bin/python"
"""The interpreter every training pod runs, by absolute path: the trainer image's Python (the PyTorch base image's
conda Python, which ``images/trainer.Dockerfile`` installs into and checks). Never ``python`` looked up through
``PATH``, which a spec's environment could point at a writable claim. A custom trainer image provides its
interpreter at this path (a symbolic link is enough)."""
TRAINER_COMMAND = (TRAINER_PYTHON, "-s", "-m", "kubetitan_trainer.launch")
"""The training container's ``command``: the launcher, with the user site directory disabled (``-s``)."""


@dataclass(frozen=True)
class CodeLoadingEnv:
    """Environment variables (one pattern) that make a process of the trainer image load or run code the spec names
    rather than the image: pointed at a writable claim, they run whatever a spec author put there."""

    pattern: str
    """A name, or a shell-style pattern (``LD_*``, ``NCCL_*_PLUGIN``)."""
    loads: str
    """What it makes the trainer load or run (docs/api.md, "Code-loading environment")."""
    examples: tuple[str, ...] = ()
    """Names it matches (each one tested; the pattern itself when it is a plain name)."""

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)

    def names(self) -> tuple[str, ...]:
        return self.examples or (self.pattern,)


CODE_LOADING_ENV: tuple[CodeLoadingEnv, ...] = (
    CodeLoadingEnv("LD_*", "the dynamic loader's preloaded and audit libraries and its search path: every "
                   "process loads them", ("LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH")),
    CodeLoadingEnv("GCONV_PATH", "glibc's character-set conversion modules"),
    CodeLoadingEnv("PATH", "where every program named without a path is found (the launcher's helpers, compilers, "
                   "`ldconfig`)"),
    CodeLoadingEnv("HOME", "the home directory: Python's user site (`.pth` files run code), `~/.nccl.conf`, the "
                   "Triton and CUDA kernel caches, `~/.aws/config`"),
    CodeLoadingEnv("XDG_*", "the cache and configuration directories (torch hub, pip, Triton)",
                   ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME")),
    CodeLoadingEnv("TMPDIR", "the temporary directory: torch.compile's default cache of compiled shared objects"),
    CodeLoadingEnv("PYTHON*", "Python's module path, home, start-up file, user site, platform library directory, "
                   "bytecode cache and the modules its breakpoint and warning hooks import",
                   ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONPYCACHEPREFIX",
                    "PYTHONBREAKPOINT", "PYTHONWARNINGS", "PYTHONPLATLIBDIR")),
    CodeLoadingEnv("BASH_ENV", "a non-interactive bash's start-up file"),
    CodeLoadingEnv("ENV", "a POSIX shell's start-up file"),
    CodeLoadingEnv("NCCL_*_PLUGIN", "NCCL's network, tuner, profiler and environment plugins (shared objects "
                   "loaded by name or path)", ("NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN",
                                               "NCCL_ENV_PLUGIN")),
    CodeLoadingEnv("NCCL_CONF_FILE", "a file of NCCL settings, a plugin among them"),
    CodeLoadingEnv("TORCHINDUCTOR_*", "torch.compile's compiled-kernel cache, its remote caches and its compiler "
                   "settings", ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE",
                                "TORCHINDUCTOR_REDIS_HOST")),
    CodeLoadingEnv("TRITON_*", "Triton's kernel cache and overrides, and the `ptxas`, `cuobjdump` and `libcuda` it "
                   "runs or loads", ("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_PTXAS_PATH", "TRITON_LIBCUDA_PATH",
                                     "TRITON_OVERRIDE_DIR")),
    CodeLoadingEnv("TORCH_EXTENSIONS_DIR", "torch's JIT-built C++/CUDA extensions"),
    CodeLoadingEnv("TORCH_HOME", "torch hub's code and weights"),
    CodeLoadingEnv("PYTORCH_KERNEL_CACHE_PATH", "PyTorch's cache of compiled CUDA kernels"),
    CodeLoadingEnv("CUDA_CACHE_PATH", "the CUDA driver's cache of JIT-compiled kernels"),
    CodeLoadingEnv("CUDA_INJECTION*_PATH", "a library the CUDA driver injects into the process (profilers)",
                   ("CUDA_INJECTION64_PATH", "CUDA_INJECTION32_PATH")),
    CodeLoadingEnv("CUDA_HOME", "the CUDA toolkit torch and Triton compile with"),
    CodeLoadingEnv("CUDA_PATH", "the CUDA toolkit torch and Triton compile with"),
    CodeLoadingEnv("CC", "the C compiler Triton and torch.compile run"),
    CodeLoadingEnv("CXX", "the C++ compiler torch.compile runs"),
    CodeLoadingEnv("*_INCLUDE_PATH", "the headers compiled kernels include", ("C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")),
    CodeLoadingEnv("CPATH", "the headers compiled kernels include"),
    CodeLoadingEnv("LIBRARY_PATH", "the libraries compiled kernels link"),
    CodeLoadingEnv("HF_MODULES_CACHE", "the Hugging Face libraries' cache of remote code modules"),
    CodeLoadingEnv("OPENSSL_*", "OpenSSL's configuration (it can load engines and providers), modules and engines",
                   ("OPENSSL_CONF", "OPENSSL_MODULES", "OPENSSL_ENGINES")),
    CodeLoadingEnv("FI_PROVIDER_PATH", "libfabric's provider libraries"),
    CodeLoadingEnv("OMP_TOOL_LIBRARIES", "OpenMP tool libraries"),
    CodeLoadingEnv("AWS_CONFIG_FILE", "the AWS configuration, whose `credential_process` is a program the S3 client "
                   "runs"),
    CodeLoadingEnv("AWS_SHARED_CREDENTIALS_FILE", "the AWS credentials file, read like `AWS_CONFIG_FILE`"),
)
"""Code-loading environment: refused in ``spec.resources.env`` unless the admin policy lists the name
(``policy.codeLoadingEnv``). A deny-list by pattern, wide on purpose: a whole family (``PYTHON*``, ``TRITON_*``)
rather than the members known today. :data:`TUNING_ENV` names the few members that only tune."""
TUNING_ENV: frozenset[str] = frozenset({
    "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING",
    "PYTHONUTF8", "PYTHONTRACEMALLOC", "PYTHONPROFILEIMPORTTIME", "PYTHONMALLOC",
})
"""Names a :data:`CODE_LOADING_ENV` pattern matches that load nothing: output buffering, fault handler, hash seed,
bytecode writing, I/O encoding (codecs of the image's own library), UTF-8 mode, allocation tracing, import timing,
the allocator. Allowed without the policy."""


def code_loading_env(name: str) -> CodeLoadingEnv | None:
    """The :data:`CODE_LOADING_ENV` entry ``name`` matches (None: it loads no code, or is in :data:`TUNING_ENV`)."""
    if name in TUNING_ENV:
        return None
    return next((e for e in CODE_LOADING_ENV if e.matches(name)), None)


PER_RANK_DATA_SOURCES = frozenset({"huggingface"})
"""``spec.data.source`` values whose read position the trainer keeps per data-parallel rank: ``huggingface`` streams
the dataset (hub or local) through torchtitan's ``ParallelAwareDataloader``, which splits it by DP rank and saves one
position per rank, so its checkpoint resumes only at the DP degree it was saved at (the trainer refuses another one
with a configuration error). Every other source (``synthetic``, ``shards``, ``mixture``)
reads one global sample stream whose position is the same on every rank (``kubetitan_trainer.data``): it resumes at
any world size and DP degree, and DCP reshards the model and optimizer, unless a mixture entry is ``huggingface``
(such an entry keeps a per-rank stream position too: :func:`per_rank_sources`). The trainer picks its loader by
this set."""


def resumes_at_another_dp_degree(data: DataSpec) -> bool:
    """Capability of the trainer for one run's data (``spec.data``): whether a checkpoint of it resumes at another
    data-parallel degree (and so at another world size). False iff a source is hub-streamed: the source itself (in
    :data:`PER_RANK_DATA_SOURCES`) or a ``huggingface`` entry of a mixture. The operator defers a mid-run edit of
    ``resources.nodes``/``gpusPerNode``/``processesPerNode``/``parallelism`` that changes the DP degree to the next
    attempt when this holds, and refuses it otherwise (``SpecAccepted=False``, reason ``WorldSizeChangeRefused``;
    the admission webhook refuses it the same way): ``kubetitan.plan.world_size_change_allowed``."""
    return not per_rank_sources(data)


def per_rank_sources(data: DataSpec) -> list[str]:
    """The spec paths of ``data``'s hub-streamed sources, whose read position is kept per data-parallel rank:
    ``data.source`` itself (``data.source huggingface``) or the ``huggingface`` entries of a mixture
    (``data.mixture[1].huggingface``). Empty when the run resumes at any data-parallel degree."""
    if data.source in PER_RANK_DATA_SOURCES:
        return [f"data.source {data.source}"]
    return [f"data.mixture[{i}].huggingface" for i, m in enumerate(data.mixture or []) if m.huggingface is not None]


BUILTIN_TOKENIZER_VOCAB = 644
"""Tokens of the builtin tokenizer (trainer/kubetitan_trainer/assets/tokenizer; a trainer test checks the number)."""

# ---- files
CONFIG_KEY = "trainer.toml"  # ConfigMap key, and file name under CONFIG_MOUNT
CONFIG_MOUNT = "/etc/kubetitan"
SHM_MOUNT = "/dev/shm"  # memory-backed emptyDir of every trainer pod
DATA_STAGE_MOUNT = "/var/cache/kubetitan/data"
"""Node-local emptyDir that ``s3://`` shards are staged to at start (kubetitan_trainer.data.s3shards); only in pods whose
spec reads such a path."""
CHECKPOINT_SUBDIR = "checkpoint"  # torchtitan's checkpoint.folder under job.dump_folder
DCP_METADATA_FILE = ".metadata"  # written last by torch.distributed.checkpoint

# ---- metrics the trainer exports and the operator scrapes (rank 0 of each pod)
M_STEP = "kubetitan_trainer_step"
M_TOTAL_STEPS = "kubetitan_trainer_total_steps"
M_LOSS = "kubetitan_trainer_loss"
M_GRAD_NORM = "kubetitan_trainer_grad_norm"
M_TOKENS_PER_SECOND = "kubetitan_trainer_tokens_per_second"
M_TOKENS_PER_SECOND_PER_GPU = "kubetitan_trainer_tokens_per_second_per_gpu"
M_FLOPS_PER_GPU = "kubetitan_trainer_flops_per_second_per_gpu"
M_MFU = "kubetitan_trainer_mfu_ratio"
M_STEP_DURATION = "kubetitan_trainer_step_duration_seconds"
M_DATA_LOADING_DURATION = "kubetitan_trainer_data_loading_duration_seconds"
M_DATA_TOKENS = "kubetitan_trainer_data_tokens_total"  # label source: tokens each data source gave the job
M_DATA_WEIGHT = "kubetitan_trainer_data_weight_ratio"  # label source: its share of the current step's samples
M_DATA_EPOCHS = "kubetitan_trainer_data_epochs"  # label source: passes over its training sequences so far
M_SOURCE_LOSS = "kubetitan_trainer_source_loss"  # label source: a mixture source's training loss at the last log
M_SOURCE_EVAL_LOSS = "kubetitan_trainer_source_eval_loss"  # label source: its held-out loss at the last evaluation
M_EVAL_LOSS = "kubetitan_trainer_eval_loss"  # held-out loss at M_EVAL_STEP; absent before the first evaluation
M_EVAL_PERPLEXITY = "kubetitan_trainer_eval_perplexity"  # exp(eval loss)
M_EVAL_STEP = "kubetitan_trainer_eval_step"  # step of the last evaluation
M_MEMORY_MAX_ACTIVE = "kubetitan_trainer_memory_max_active_bytes"
M_MEMORY_MAX_RESERVED = "kubetitan_trainer_memory_max_reserved_bytes"
M_CHECKPOINT_SAVE_DURATION = "kubetitan_trainer_checkpoint_save_duration_seconds"
M_LAST_CHECKPOINT_STEP = "kubetitan_trainer_last_checkpoint_step"
M_LAST_CHECKPOINT_TIMESTAMP = "kubetitan_trainer_last_checkpoint_timestamp_seconds"
M_RESUMED_FROM_STEP = "kubetitan_trainer_resumed_from_step"  # -1 until loaded; 0 = a fresh start
M_CHECKPOINT_INTERVAL = "kubetitan_trainer_checkpoint_interval_steps"
M_CHECKPOINT_SAVES_FAILED = "kubetitan_trainer_checkpoint_saves_failed_total"  # failed saves of this generation
M_CHECKPOINT_SAVES_FAILED_IN_A_ROW = "kubetitan_trainer_checkpoint_saves_failed_in_a_row"  # since the last that worked
M_CHECKPOINT_MAX_FAILED_SAVES = "kubetitan_trainer_checkpoint_max_failed_saves"  # spec.checkpoint.maxFailedSaves
M_CHECKPOINT_LAST_FAILED_SAVE_STEP = "kubetitan_trainer_checkpoint_last_failed_save_step"  # -1 before any
M_CHECKPOINT_SAVE_FAILURE = "kubetitan_trainer_checkpoint_save_failure_info"  # label error: SAVE_ERROR, 1 while failing
SAVE_ERROR = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,39}$")
"""What the ``error`` label of :data:`M_CHECKPOINT_SAVE_FAILURE` may hold: an errno name (``ENOSPC``, ``EIO``) or an
exception's type name (``S3Exception``); the operator drops any other value (it goes into a condition message)."""
M_TOKENS = "kubetitan_trainer_tokens_total"
M_ATTEMPT = "kubetitan_trainer_attempt"
M_LAST_STEP_TIMESTAMP = "kubetitan_trainer_last_step_timestamp_seconds"  # the heartbeat
M_FIRST_STEP_TIMESTAMP = "kubetitan_trainer_first_step_timestamp_seconds"  # this worker generation's; 0 before it
M_PRODUCTIVE_SECONDS = "kubetitan_trainer_productive_step_seconds_total"
M_JOB_START_TIMESTAMP = "kubetitan_trainer_job_start_timestamp_seconds"
M_STARTUP_PHASE_SECONDS = "kubetitan_trainer_startup_phase_seconds"  # label phase: one of STARTUP_PHASES
STARTUP_PHASES = ("process_start", "preflight", "imports", "process_group_init", "model_init", "checkpoint_load",
                  "first_step_compile", "first_step")
"""The trainer's start-up phases, in order (kubetitan_trainer.recovery.anatomy; status.restarts[].startup)."""
M_STARTUP_SECONDS = "kubetitan_trainer_startup_seconds"
M_RESTART_GENERATION = "kubetitan_trainer_restart_generation"  # ENV_RESTART_GENERATION
M_RESTART_EXIT_CODE = "kubetitan_trainer_restart_exit_code"  # of the failure that began this generation
M_RESTART_NODE_RANK = "kubetitan_trainer_restart_node_rank"  # node rank (pod rank) of that failure
M_RESTART_TIMESTAMP = "kubetitan_trainer_restart_timestamp_seconds"  # when a launcher saw that failure
M_RESTART_PREVIOUS_STEP = "kubetitan_trainer_restart_previous_step"  # the last step the previous generation trained
M_INPROCESS_RESTARTS = "kubetitan_trainer_inprocess_restarts_total"  # label cause: in-process restarts of this process
M_STEP_DURATION_MEDIAN = "kubetitan_trainer_step_duration_median_seconds"  # recent steps of this generation

# ---- metrics the operator exports (kubetitan.operator_metrics), which its dashboards and alerts query
# (kubetitan.monitoring): one definition for both
OP_BUILD_INFO = "kubetitan_build_info"
OP_LLAMAPRETRAINS = "kubetitan_operator_llamapretrains"
OP_RESTARTS = "kubetitan_operator_restarts_total"
OP_RECONCILE_DURATION = "kubetitan_operator_reconcile_duration_seconds"
OP_RUN_CYCLES = "kubetitan_operator_run_cycles_total"
OP_RECONCILE_ERRORS = "kubetitan_operator_reconcile_errors_total"
OP_API_UNAVAILABLE_CYCLES = "kubetitan_operator_api_unavailable_cycles_total"
OP_LEADER = "kubetitan_operator_leader"
OP_RECOVERY_DURATION = "kubetitan_operator_recovery_duration_seconds"
OP_SCRAPE_FAILURES = "kubetitan_operator_scrape_failures_total"
OP_SCRAPED_VALUES_REFUSED = "kubetitan_operator_scraped_values_refused_total"
OP_JOB_STEP = "kubetitan_operator_job_step"
OP_JOB_TOKENS_PER_SECOND = "kubetitan_operator_job_tokens_per_second"
OP_JOB_MFU = "kubetitan_operator_job_mfu_ratio"
OP_JOB_GOODPUT = "kubetitan_operator_job_goodput_ratio"
OP_JOB_RESTARTS = "kubetitan_operator_job_restarts"
OP_JOB_PHASE_INFO = "kubetitan_operator_job_phase_info"

_STEP_DIR = re.compile(r"^step-(\d+)$")


def newest_complete_step(entries: Iterable[tuple[str, bool]]) -> int | None:
    """The one resume rule: the highest ``step-N`` whose DCP metadata file exists.

    ``entries`` are (directory name, has metadata file) pairs of the checkpoint folder.
    torch.distributed.checkpoint writes ``.metadata`` last, so a step directory without it
    is a save that was cut off and must never be loaded.
    """
    steps = [int(m.group(1)) for name, done in entries if done and (m := _STEP_DIR.match(name))]
    return max(steps) if steps else None


def incomplete_steps(entries: Iterable[tuple[str, bool]]) -> list[int]:
    """Step directories without their metadata file (partial saves), oldest first."""
    return sorted(int(m.group(1)) for name, done in entries if not done and (m := _STEP_DIR.match(name)))
