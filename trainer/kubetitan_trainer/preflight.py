"""The pod's pre-flight gate: before an attempt's first workers start, check the node's accelerators and network.

Each pod's launcher runs the gate once per attempt (``spec.runPolicy.preflight: Enabled``, ``[kubetitan.preflight]``
in ``trainer.toml``), before its workers start; a failed check ends the pod with exit code 8
(``ExitCode.PREFLIGHT_FAILED``, cause ``PreflightFailed``) and a termination message that names the node and the
check, and the operator re-creates the gang without that node. One :class:`Row` per check, in this order:

================  ===================================================================================================
``gpu_count``     the GPUs the pod sees against ``resources.gpusPerNode`` (fewer fails)
``gpu_model``     each GPU's name against the model the spec names (``gpuProduct``, else the instance type's)
``nvml``          through NVML (the ``pynvml`` module of nvidia-ml-py, a trainer dependency; where the driver's
                  library is missing the row says NVML is unavailable and why): a GPU NVML cannot reach, uncorrectable ECC errors since the driver loaded, a row
                  remap pending (a GPU reset applies it) or failed, retired pages pending
``matmul``        a matrix product of small integers on each GPU (bf16, n = 8192; fp32, n = 256 on CPU) against its
                  known result: every product of the inputs is exact, so each sampled entry must equal the exact
                  integer within one rounding to the output dtype
``matmul_tflops`` the same product's achieved TF/s on each GPU against the card's floor (:data:`FLOOR_FRACTION` of
                  the catalog's dense bf16 peak)
``allreduce``     an NCCL all-reduce across all of the pod's GPUs in one process (``torch.cuda.nccl``), checked
                  against the known sum; on a CPU pod a one-rank gloo all-reduce (the library loads and reduces)
``efa``           the EFA devices (``/dev/infiniband/uverbs*``) against the interfaces the pod requested
================  ===================================================================================================

Checks that do not apply say why (``skipped``: a CPU pod's GPU checks, no EFA requested, a model the spec does not
name). A check that raises fails with the exception's text (a CUDA error on a broken GPU is a finding).

Where it runs: on a CPU pod in the launcher itself after its warm imports, on one thread (milliseconds); on a GPU
pod in a process of its own (``python -m kubetitan_trainer.preflight --config trainer.toml --json``), started as the
launcher starts, so that its torch import and CUDA contexts overlap the launcher's own imports, and so that the
launcher, whose workers are forked from it, never initialises CUDA. Its seconds go into the start-up anatomy's
``preflight`` phase (:mod:`kubetitan_trainer.recovery.anatomy`: what the launcher waited beyond its imports) and
the record's ``preflight`` entry (every row, the gate's own seconds).

The judgements are pure functions of what a :class:`Probe` measured, so tests drive every check's pass and fail with
a fake probe; the real probe is :class:`TorchProbe`. torch is imported only inside the probe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kubetitan_core.catalog import ACCELERATORS, expected_product, product_of
from kubetitan_core.contract import ENV_NODE_NAME, ExitCode
from kubetitan_core.contract.trainer_toml import Kubetitan, KubetitanPreflight, from_table

log = logging.getLogger("kubetitan.preflight")

Status = Literal["passed", "failed", "skipped"]

FLOOR_FRACTION: dict[str, float] = {"H100": 0.5, "H200": 0.5, "B200": 0.5, "A100": 0.5, "L40S": 0.35, "L4": 0.35,
                                    "A10G": 0.35}
"""The matmul floor per GPU model, as a fraction of the catalog's dense bf16 peak (``catalog.ACCELERATORS``). An
8192-cube bf16 product reaches ~70 % of the peak on a healthy Hopper card (an H200 here: median 704 TF/s of 60
products, min 686, of 989: docs/benchmarks.md), so half of the peak passes a healthy card with margin and fails one
that runs throttled (clocks, power, thermals) or on a broken path; the power-limited cards (L40S, L4, A10G) reach
less of their peak, so theirs is lower. The catalog's H100 is the SXM card (700 W); an H100 PCIe (350 W) may run
below that floor. ``bench/device/preflight_gpu.sh`` measures the H100 against its floor; the others are estimates,
not measured here."""
GPU_N, CPU_N = 8192, 256
"""Sides of the checked matrix product on a GPU (bf16) and on a CPU pod (fp32)."""
SAMPLED_ROWS = 32
"""Rows of a GPU's product compared with the exact result (evenly spread; the whole product on CPU)."""
TIMED_ITERATIONS = 20
"""Timed products per GPU (after 3 untimed ones): ~35 ms on an H100."""
ALLREDUCE_BYTES = 64 * 2**20
"""Bytes per GPU of the timed all-reduce."""
GATE_TIMEOUT_SECONDS = 300.0
"""How long a launcher waits for its GPU gate process (a cold torch import on a new node included) before it counts
the gate as failed."""


# ------------------------------------------------------------------------------------------------- settings, rows
@dataclass(frozen=True)
class Settings:
    """What the gate checks against: ``[kubetitan.preflight]`` and the ``[kubetitan]`` keys it reads."""

    enabled: bool = True
    gpus: int = 0
    """GPUs the pod must see (``spec.resources.gpusPerNode``); 0: a CPU pod."""
    gpu_product: str = ""
    instance_type: str = ""
    efa_per_node: int = 0
    inject: str = ""
    """Tests only: a check reported failed after it ran (:attr:`KubetitanPreflight.inject`)."""

    @classmethod
    def from_table(cls, kt: Kubetitan) -> Settings:
        p = kt.preflight
        return cls(enabled=p.enabled, gpus=p.gpus, gpu_product=kt.gpu_product, instance_type=kt.instance_type,
                   efa_per_node=kt.efa_per_node, inject=p.inject)

    @classmethod
    def from_config(cls, path: str) -> Settings:
        """The settings of a ``trainer.toml``. An unreadable file or table is the workers' to report (exit 2): the
        gate then runs with the defaults (a CPU pod's checks), logging why."""
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f).get("kubetitan", {})
            kt = Kubetitan(**{k: v for k, v in table.items() if k in ("gpu_product", "instance_type", "efa_per_node")},
                           preflight=from_table(KubetitanPreflight, table.get("preflight", {})))
        except (OSError, ValueError, TypeError) as e:
            log.warning("Pre-flight gate: cannot read [kubetitan] of %s (%s); checking as a CPU pod (the workers "
                        "report the config)", path, e)
            return cls()
        return cls.from_table(kt)


@dataclass(frozen=True)
class Row:
    """One check's outcome."""

    check: str
    status: Status
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        return f"{self.check:14} {self.status:8} {self.seconds:6.2f} s  {self.detail}"


@dataclass(frozen=True)
class Result:
    """The gate's outcome on one node."""

    node: str
    rows: tuple[Row, ...]
    seconds: float
    """The gate's own wall time (in its process: imports, CUDA contexts and the checks)."""

    @property
    def failed(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if r.status == "failed")

    def termination_message(self) -> str:
        """The pod's termination message of a failed gate (the kubelet keeps 4096 bytes of it)."""
        checks = "; ".join(f"{r.check}: {r.detail}" for r in self.failed)
        return f"PreflightFailed: node {self.node} failed the pre-flight gate: {checks}"[:4000]

    def summary(self) -> str:
        n = {s: sum(r.status == s for r in self.rows) for s in ("passed", "failed", "skipped")}
        return (f"Pre-flight gate on node {self.node}: {n['passed']} passed, {n['failed']} failed, {n['skipped']} "
                f"skipped in {self.seconds:.2f} s")

    def to_dict(self) -> dict:
        return {"node": self.node, "seconds": round(self.seconds, 3),
                "rows": [dataclasses.asdict(r) | {"seconds": round(r.seconds, 3)} for r in self.rows]}

    @classmethod
    def from_dict(cls, d: dict) -> Result:
        return cls(d["node"], tuple(Row(**r) for r in d["rows"]), float(d["seconds"]))


def node_name(env: dict | None = None) -> str:
    """The node this pod runs on (the operator's ``KUBETITAN_NODE_NAME``), else this host's name (local runs)."""
    return (os.environ if env is None else env).get(ENV_NODE_NAME) or socket.gethostname()


# ------------------------------------------------------------------------------------------------------ the probe
@dataclass(frozen=True)
class Matmul:
    """One device's checked matrix product."""

    device: str
    n: int
    dtype: str
    sampled: int
    """Entries compared with the exact result."""
    wrong: int
    """Of those, how many differ from it by more than one rounding to ``dtype``."""
    max_rel_error: float
    tflops: float


@dataclass(frozen=True)
class Nvml:
    """What NVML says of one GPU (None: the query is not supported on this GPU)."""

    index: int
    name: str = ""
    lost: str = ""
    """Why NVML cannot reach the GPU ('' when it can)."""
    uncorrected_ecc: int | None = None
    """Uncorrectable ECC errors since the driver loaded (volatile counter)."""
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    retired_pending: bool | None = None


@dataclass(frozen=True)
class AllReduce:
    ok: bool
    detail: str
    seconds: float


class Probe(Protocol):
    """What the gate measures; :class:`TorchProbe` on a real node, a fake in tests."""

    def gpu_names(self) -> list[str]: ...
    def nvml(self) -> list[Nvml] | str: ...
    def matmuls(self) -> list[Matmul]: ...
    def allreduce(self) -> AllReduce: ...
    def efa_devices(self) -> int: ...


# ------------------------------------------------------------------------------------------------ the judgements
def _cpu_pod(s: Settings) -> Row | None:
    return None if s.gpus > 0 else Row("", "skipped", "a CPU pod ([kubetitan.preflight] gpus is 0: "
                                       "spec.resources.gpusPerNode 0, or a trainer.toml without it)")


def check_gpu_count(s: Settings, p: Probe) -> Row:
    if (cpu := _cpu_pod(s)) is not None:
        return dataclasses.replace(cpu, check="gpu_count")
    n = len(p.gpu_names())
    if n < s.gpus:
        return Row("gpu_count", "failed", f"{n} GPU(s) visible, the spec asks for {s.gpus} per pod "
                   "(spec.resources.gpusPerNode): a GPU is missing or its device plugin did not hand it over")
    more = f" ({n} visible: more than the pod requested)" if n > s.gpus else ""
    return Row("gpu_count", "passed", f"{s.gpus} GPU(s) as the spec asks{more}")


def check_gpu_model(s: Settings, p: Probe) -> Row:
    if (cpu := _cpu_pod(s)) is not None:
        return dataclasses.replace(cpu, check="gpu_model")
    names = p.gpu_names()
    want = expected_product(s.instance_type or None, s.gpu_product or None)
    seen = ", ".join(sorted(set(names)))
    if not names:
        return Row("gpu_model", "skipped", "no GPU visible to check (gpu_count fails)")
    if want is None:
        return Row("gpu_model", "skipped", f"the spec names no GPU model (spec.resources.gpuProduct or a catalog "
                   f"instanceType); seen: {seen}")
    wrong = [f"GPU {i} is {n!r}" for i, n in enumerate(names) if product_of(n) != want]
    if wrong:
        return Row("gpu_model", "failed", f"{'; '.join(wrong)}, not the {want} the spec names "
                   f"({'spec.resources.gpuProduct' if s.gpu_product else 'instance type ' + s.instance_type})")
    return Row("gpu_model", "passed", f"{seen}, as the spec names ({want})")


def check_nvml(s: Settings, p: Probe) -> Row:
    if (cpu := _cpu_pod(s)) is not None:
        return dataclasses.replace(cpu, check="nvml")
    state = p.nvml()
    if isinstance(state, str):
        return Row("nvml", "skipped", f"NVML unavailable ({state}): ECC and row-remapping state NOT checked")
    bad, unsupported = [], []
    for g in state:
        if g.lost:
            bad.append(f"GPU {g.index}: NVML cannot reach it ({g.lost})")
            continue
        if g.uncorrected_ecc:
            bad.append(f"GPU {g.index}: {g.uncorrected_ecc} uncorrectable ECC error(s) since the driver loaded")
        if g.remap_failed:
            bad.append(f"GPU {g.index}: a row remap failed")
        if g.remap_pending:
            bad.append(f"GPU {g.index}: a row remap is pending (a GPU reset applies it)")
        if g.retired_pending:
            bad.append(f"GPU {g.index}: retired pages are pending (a GPU reset applies them)")
        if g.uncorrected_ecc is None:
            unsupported.append(str(g.index))
    if bad:
        return Row("nvml", "failed", "; ".join(bad))
    note = f"; ECC counters not supported on GPU(s) {', '.join(unsupported)}" if unsupported else ""
    return Row("nvml", "passed", f"{len(state)} GPU(s): no uncorrectable ECC error, no row remap pending or "
               f"failed{note}")


def check_matmul(s: Settings, p: Probe) -> Row:
    results = p.matmuls()
    wrong = [m for m in results if m.wrong]
    if wrong:
        return Row("matmul", "failed", "; ".join(
            f"{m.device}: {m.wrong} of {m.sampled} sampled entries of a {m.n}-cube {m.dtype} product wrong (largest "
            f"relative error {m.max_rel_error:.3g})" for m in wrong))
    m = results[0]
    return Row("matmul", "passed", f"{len(results)} device(s): a {m.n}-cube {m.dtype} product equals its known "
               f"result ({m.sampled} entries each)")


def floor_tflops(product: str | None) -> float | None:
    """The matmul floor of a GPU model (:data:`FLOOR_FRACTION`), TF/s; None for a model the catalog lacks."""
    if product is None or product not in ACCELERATORS:
        return None
    return ACCELERATORS[product].peak_bf16_tflops * FLOOR_FRACTION.get(product, 0.35)


def check_matmul_tflops(s: Settings, p: Probe) -> Row:
    results = p.matmuls()
    rates = ", ".join(f"{m.device} {m.tflops:.3g}" for m in results)
    if s.gpus == 0:
        return Row("matmul_tflops", "skipped", f"a CPU pod: no floor ({rates} TF/s)")
    names = p.gpu_names()
    below, floors = [], set()
    for i, m in enumerate(results):
        product = expected_product(s.instance_type or None, s.gpu_product or None) or \
            product_of(names[i] if i < len(names) else None)
        floor = floor_tflops(product)
        if floor is None:
            continue
        floors.add(f"{product} {floor:.0f}")
        if m.tflops < floor:
            below.append(f"{m.device} {m.tflops:.1f} TF/s < {floor:.0f} TF/s, the {product} floor "
                         f"({FLOOR_FRACTION.get(product, 0.35):.0%} of its {ACCELERATORS[product].peak_bf16_tflops:g} "
                         "TF/s dense bf16 peak)")
    if below:
        return Row("matmul_tflops", "failed", "; ".join(below))
    if not floors:
        return Row("matmul_tflops", "skipped", f"no floor for this GPU model (not in the catalog): {rates} TF/s")
    return Row("matmul_tflops", "passed", f"{rates} TF/s, above the floor ({', '.join(sorted(floors))} TF/s)")


def check_allreduce(s: Settings, p: Probe) -> Row:
    r = p.allreduce()
    return Row("allreduce", "passed" if r.ok else "failed", r.detail)


def check_efa(s: Settings, p: Probe) -> Row:
    if s.efa_per_node <= 0:
        return Row("efa", "skipped", "no EFA interfaces requested (spec.resources.efaPerNode, platform)")
    n = p.efa_devices()
    if n < s.efa_per_node:
        return Row("efa", "failed", f"{n} EFA device(s) in /dev/infiniband, the pod requested {s.efa_per_node} "
                   "(vpc.amazonaws.com/efa): the EFA device plugin did not hand them over, or an interface is down")
    return Row("efa", "passed", f"{n} EFA device(s), {s.efa_per_node} requested")


Check = Callable[[Settings, Probe], Row]
CHECKS: tuple[tuple[str, Check], ...] = (
    ("gpu_count", check_gpu_count), ("gpu_model", check_gpu_model), ("nvml", check_nvml), ("matmul", check_matmul),
    ("matmul_tflops", check_matmul_tflops), ("allreduce", check_allreduce), ("efa", check_efa),
)
"""Every check, in the order the gate runs and reports them."""


def run(s: Settings, probe: Probe, node: str | None = None, clock: Callable[[], float] = time.perf_counter,
        began: float | None = None) -> Result:
    """Run every check of :data:`CHECKS` (all of them, whatever fails first) and return the rows. ``began``: when the
    gate's process started (its imports count), else now."""
    start = clock() if began is None else began
    rows = []
    for name, fn in CHECKS:
        t = clock()
        try:
            row = fn(s, probe)
        except Exception as e:  # noqa: BLE001 - a check that cannot run on this node is a finding about the node
            row = Row(name, "failed", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        if s.inject == name:
            row = Row(name, "failed", f"injected failure ([kubetitan.preflight] inject, tests only); the check "
                      f"itself: {row.status}: {row.detail}")
        rows.append(dataclasses.replace(row, seconds=clock() - t))
    return Result(node or node_name(), tuple(rows), clock() - start)


# --------------------------------------------------------------------------------------------------- real probe
def _exactness(got, exact, dtype) -> tuple[int, float]:
    """(entries of ``got`` farther than one rounding to ``dtype`` from the exact integers ``exact``, the largest
    relative error). Rounding an integer to bf16 (8 significant bits) moves it by less than 2^-7 of itself; fp32 by
    less than 2^-22 (for these magnitudes: exact)."""
    import torch

    rel = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
    err = (got.double() - exact).abs()
    bad = err > exact.abs() * rel
    scale = exact.abs().clamp(min=1.0)
    return int(bad.sum()), float((err / scale).max()) if err.numel() else 0.0


class TorchProbe:
    """The real measurements, on every visible GPU (``cuda``) or on the CPU."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.torch = torch
        self.cuda = cuda
        """A GPU pod: the products and the all-reduce run on its GPUs (none visible: they fail), else on the CPU."""
        self._names: list[str] | None = None
        self._matmuls: list[Matmul] | None = None

    def gpu_names(self) -> list[str]:
        if self._names is None:
            t = self.torch
            visible = self.cuda and t.cuda.is_available()
            self._names = [t.cuda.get_device_name(i) for i in range(t.cuda.device_count())] if visible else []
        return self._names

    def nvml(self) -> list[Nvml] | str:
        return nvml_state()

    @contextlib.contextmanager
    def _one_thread(self):
        """torch's CPU ops on this thread alone: a CPU pod's gate runs in the launcher, whose workers are forked
        after it, and a fork after OpenMP's thread pool started leaves the child's first parallel region hung (seen:
        a worker stuck after building its model). One thread starts no pool."""
        threads = self.torch.get_num_threads()
        self.torch.set_num_threads(1)
        try:
            yield
        finally:
            self.torch.set_num_threads(threads)

    def matmuls(self) -> list[Matmul]:
        if self._matmuls is None:
            if not self.cuda:
                with self._one_thread():
                    self._matmuls = [self._matmul("cpu", CPU_N, self.torch.float32, timed=3)]
            else:
                devices = [f"cuda:{i}" for i in range(len(self.gpu_names()))]
                if not devices:
                    raise RuntimeError("no CUDA device to run the product on")
                with ThreadPoolExecutor(len(devices)) as pool:  # contexts and products on every GPU at once
                    self._matmuls = list(pool.map(lambda d: self._matmul(d, GPU_N, self.torch.bfloat16,
                                                                         timed=TIMED_ITERATIONS), devices))
        return self._matmuls

    def _matmul(self, device: str, n: int, dtype, timed: int) -> Matmul:
        t = self.torch
        dev = t.device(device)
        if dev.type == "cuda":
            t.cuda.set_device(dev)
            t.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # fp32 sums: exact for integers
        g = t.Generator(device=dev).manual_seed(41)
        a = t.randint(-2, 3, (n, n), generator=g, device=dev).to(dtype)
        b = t.randint(-2, 3, (n, n), generator=g, device=dev).to(dtype)
        c = a @ b
        rows = t.arange(0, n, max(1, n // SAMPLED_ROWS), device=dev) if dev.type == "cuda" else t.arange(n)
        exact = a[rows].double() @ b.double()  # integers below 2^53: exact
        wrong, rel = _exactness(c[rows], exact, dtype)
        for _ in range(2):
            a @ b
        if dev.type == "cuda":
            start, end = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(timed):
                a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            for _ in range(timed):
                a @ b
            seconds = time.perf_counter() - begin
        tflops = 2 * n**3 * timed / max(seconds, 1e-9) / 1e12
        return Matmul(device, n, str(dtype).removeprefix("torch."), rows.numel() * n, wrong, rel, tflops)

    def allreduce(self) -> AllReduce:
        return self._nccl() if self.cuda else self._gloo()

    def _nccl(self) -> AllReduce:
        t = self.torch
        import torch.cuda.nccl as nccl

        n = len(self.gpu_names())
        if not n:
            raise RuntimeError("no CUDA device to all-reduce across")
        elems = ALLREDUCE_BYTES // 4
        tensors = [t.full((elems,), float(i + 1), device=f"cuda:{i}") for i in range(n)]
        if not nccl.is_available(tensors):
            return AllReduce(False, "NCCL cannot all-reduce these tensors (torch.cuda.nccl.is_available)", 0.0)
        nccl.all_reduce(tensors)  # the communicator's set-up, and a first check
        for i, x in enumerate(tensors):
            x.fill_(float(i + 1))
        for i in range(n):
            t.cuda.synchronize(i)
        begin = time.perf_counter()
        nccl.all_reduce(tensors)
        for i in range(n):
            t.cuda.synchronize(i)
        seconds = time.perf_counter() - begin
        want = n * (n + 1) / 2
        bad = [i for i, x in enumerate(tensors) if not bool((x == want).all())]
        if bad:
            return AllReduce(False, f"NCCL all-reduce across {n} GPU(s) gave a wrong sum on GPU(s) "
                             f"{', '.join(map(str, bad))}", seconds)
        busbw = 2 * (n - 1) / n * ALLREDUCE_BYTES / seconds / 1e9 if n > 1 else 0.0
        bw = f", bus bandwidth {busbw:.0f} GB/s" if n > 1 else " (one GPU: no link crossed)"
        return AllReduce(True, f"NCCL all-reduce of {ALLREDUCE_BYTES >> 20} MiB across {n} GPU(s) in "
                         f"{seconds * 1e3:.1f} ms, sum right{bw}", seconds)

    def _gloo(self) -> AllReduce:
        t = self.torch
        from datetime import timedelta

        import torch.distributed as dist

        begin = time.perf_counter()
        with self._one_thread():
            pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
            x = t.arange(4, dtype=t.float32)
            work = pg.allreduce([x])
            work.wait()
            del work, pg  # the group and its threads end here, before the launcher forks its workers
            ok = bool((x == t.arange(4, dtype=t.float32)).all())
        return AllReduce(ok, "gloo all-reduce of one rank in this process (the workers' own gloo world starts later): "
                         + ("sum right" if ok else f"wrong sum {x.tolist()}"), time.perf_counter() - begin)

    def efa_devices(self) -> int:
        return efa_devices()


def efa_devices(root: str = "/dev/infiniband") -> int:
    """EFA (and other RDMA) devices the pod sees: ``/dev/infiniband/uverbs<N>``."""
    return len(glob.glob(os.path.join(root, "uverbs*")))


def nvml_state() -> list[Nvml] | str:
    """Every GPU NVML sees, or why NVML cannot be asked (no ``pynvml`` module, no driver library)."""
    try:
        import pynvml  # nvidia-ml-py, a dependency of the trainer
    except ImportError:
        return "the pynvml module (nvidia-ml-py) is not installed in the image"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return f"nvmlInit failed: {e}"
    try:
        return [_nvml_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def _nvml_gpu(pynvml, i: int) -> Nvml:
    def ask(fn, *args):
        try:
            return fn(*args)
        except pynvml.NVMLError_NotSupported:
            return None

    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(h)
        ecc = ask(pynvml.nvmlDeviceGetTotalEccErrors, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                  pynvml.NVML_VOLATILE_ECC)
        remap = ask(pynvml.nvmlDeviceGetRemappedRows, h)  # (correctable, uncorrectable, pending, failed)
        retired = ask(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
    except pynvml.NVMLError as e:  # GPU lost, unknown error: the GPU is not usable
        return Nvml(i, lost=str(e))
    return Nvml(i, name=name if isinstance(name, str) else name.decode(), uncorrected_ecc=ecc,
                remap_pending=None if remap is None else bool(remap[2]),
                remap_failed=None if remap is None else bool(remap[3]),
                retired_pending=None if retired is None else bool(retired))


# ------------------------------------------------------------------------------------------- in the launcher
@dataclass
class Pending:
    """A gate under way for a launcher: a process of its own on a GPU pod, or nothing yet on a CPU pod (it runs in
    :meth:`end`, in the launcher, once torch is imported)."""

    settings: Settings
    config: str
    proc: subprocess.Popen | None = None
    started: float = field(default_factory=time.time)

    def cancel(self) -> None:
        """The launcher will not start: stop the gate's process."""
        if self.proc is not None and self.proc.poll() is None:
            self._kill()

    def _kill(self) -> None:
        """SIGKILL the gate's process group (it runs in a session of its own: nothing it started keeps its output
        pipe open), then reap it."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate()

    def end(self, timeout: float = GATE_TIMEOUT_SECONDS) -> Result:
        if self.proc is None:
            return run(self.settings, TorchProbe(cuda=False))
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            return _gate_failed(f"the gate process did not finish within {timeout:.0f} s (a GPU or the driver hangs)",
                                time.time() - self.started)
        try:
            return Result.from_dict(json.loads(out.decode().strip().splitlines()[-1]))
        except (ValueError, KeyError, TypeError, IndexError):
            return _gate_failed(f"the gate process exited with code {self.proc.returncode} without its result (its "
                                "log is above)", time.time() - self.started)


def _gate_failed(why: str, seconds: float) -> Result:
    return Result(node_name(), (Row("gate", "failed", why, seconds),), seconds)


def begin(settings: Settings, config: str) -> Pending:
    """Start the gate of a launcher: on a GPU pod its own process now (stdout: its JSON result; its log on the
    launcher's stderr); on a CPU pod nothing until :meth:`Pending.end`."""
    pending = Pending(settings, config)
    if settings.gpus > 0:
        pending.proc = subprocess.Popen([sys.executable, "-s", "-m", "kubetitan_trainer.preflight",
                                         f"--config={config}", "--json"], stdout=subprocess.PIPE,
                                        start_new_session=True)
    return pending


# ---------------------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kubetitan_trainer.preflight [--config trainer.toml] [--gpus N] [--gpu-product P] [--efa N]
    [--inject CHECK] [--json]``: run the gate here and print its rows (``--json``: the result as one JSON line, what
    the launcher reads); exit code 8 when a check failed. The flags override the config's keys."""
    import argparse

    began = time.perf_counter()
    ap = argparse.ArgumentParser(prog="python -m kubetitan_trainer.preflight", description=main.__doc__)
    ap.add_argument("--config", help="a trainer.toml to read [kubetitan.preflight] and the GPU model from")
    ap.add_argument("--gpus", type=int, help="GPUs the pod must see (0: a CPU pod)")
    ap.add_argument("--gpu-product", choices=sorted(ACCELERATORS), help="the GPU model the spec names")
    ap.add_argument("--efa", type=int, help="EFA interfaces the pod requested")
    ap.add_argument("--inject", choices=[c for c, _ in CHECKS], help="tests only: report this check failed")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    a = ap.parse_args(argv)
    s = Settings.from_config(a.config) if a.config else Settings()
    over = {k: v for k, v in (("gpus", a.gpus), ("gpu_product", a.gpu_product), ("efa_per_node", a.efa),
                              ("inject", a.inject)) if v is not None}
    s = dataclasses.replace(s, **over)
    result = run(s, TorchProbe(cuda=s.gpus > 0), began=began)
    if a.json:
        print(json.dumps(result.to_dict()), flush=True)
    else:
        print(result.summary())
        for r in result.rows:
            print("  " + r.line())
        if result.failed:
            print(result.termination_message())
    return int(ExitCode.PREFLIGHT_FAILED) if result.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
