"""Transformer blocks compiled ahead of time: a restarted worker loads them instead of compiling.

With a warm compile cache a new worker still spends ~2 s of its first step in torch.compile (an H100,
bench/device/recovery_deferred_copy.sh): Dynamo traces each compiled region again (~0.85 s), then the caches hand back the graphs and their kernels.
torch 2.11 can compile a ``fullgraph`` region ahead of time into bytes that hold its guards, its bytecode and its
compiled forward and backward (``torch._dynamo.aot_compile``, experimental). Loading them needs no trace, and
needs no module either, so it runs on a thread of its own while the worker builds its model and loads its
checkpoint.

Opt-in (``spec.runtime.aotCompile``, ``[kubetitan.runtime] aot_compile``). On an H100 (docs/reliability.md) every
block call of a restarted worker ran the artefact, and the first step's compile took 0.55-0.80 s instead of 2.2-3.0
s; it stays opt-in until the H200 recipe has run with it. With compile on:

- :func:`install` (kubetitan's TrainSpec, after torchtitan's parallelize) gives every compiled transformer block a
  :class:`Dispatch` forward. If the artefact for these blocks exists it starts loading it in the background.
- Each call runs the artefact's graph when its guards pass (the same shapes, dtypes, grad mode, autocast...), and
  the block's own ``torch.compile`` forward otherwise (an evaluation under ``no_grad``, another batch shape), so
  nothing ever fails for want of a matching graph.
- Without an artefact, each rank makes its own after its first training step (:func:`after_first_step`) from the
  inputs the first block saw, and writes it into the compile cache's folder, named by the cache's key
  (``compile_cache.KEY_ENV``, also when the pod's env chose the folder), the Python version, the sources of the
  block's modules (the artefact holds their bytecode), the local rank and the device (its guards check the device:
  ``cuda:1``'s artefact serves local rank 1 only). That costs one compile of a block per local rank, once per key and
  node. An artefact that failed to load, or whose guards refused every call of the first step, is replaced the same
  way.
- A block with hooks on it or on a module inside it (``module_call_hooks``: the artefact holds the graph traced
  without them, and Dynamo does not guard on hooks) is never served from an artefact, nor made into one; such
  refusals do not count against the artefact.
- Several ranks (a multi-GPU pod, several pods): after the first step every rank says, in the trainer's all-reduce
  of the step's flags, whether it makes an artefact and whether it is ready to (at its first step, blocks installed:
  an in-process restart on one rank must not leave it gathering alone). Compiling a block sharded by FSDP2 needs its
  parameters gathered, a collective: when any rank makes one and every rank is ready, every rank gathers the first
  block of each kind (the ranks that have theirs only join the gather), so no rank waits on a collective another
  never calls. Every rank of a run must install the same way (one spec, one image). Each artefact loads on a thread
  bound to the rank's own device (no context on GPU 0 from another rank).
- A worker that used the artefact and died before the end of its second step (and before a clean end of training)
  leaves a marker holding a token of that process (not only its pid, which a container restarted in a new PID
  namespace reuses); the next worker then deletes the artefact instead of loading it (a broken artefact must not
  crash-loop a run), and the rank makes a new one, once: after :data:`MAX_CRASHES` such deletions in a row
  (``.crashed`` counts them; a worker that runs the artefact past its second step resets it) no worker makes it
  again. A worker that died while making one leaves a ``.making`` marker: no later worker tries to make it again.
  Delete those files to let one try.
- A cache folder that cannot be written (read-only, full) never stops a run: the blocks compile as usual.

What was used goes into the start-up record (``aot_precompile``: loaded or not, load seconds, calls served by the
artefact and calls that fell back).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubetitan_trainer import atomic, compat, runtime
from kubetitan_trainer.compile import compile_cache

log = logging.getLogger(__name__)


SUBDIR = "aot"
"""The artefacts' folder, beside the compile cache's ``inductor`` and ``triton`` folders (one cache key each)."""


MAX_CRASHES = 2
"""Artefacts deleted after a crash, in a row, after which no worker makes a new one (a deterministic fault in the
artefact then costs two crashes, not every other restart)."""

_TOKENS: dict[int, str] = {}


def process_token() -> str:
    """This process's token for the markers: its pid and a random part made once per process (a forked child gets its
    own; a pid reused by a later process, e.g. in a container restarted with a new PID namespace, does not match)."""
    pid = os.getpid()
    if pid not in _TOKENS:
        _TOKENS[pid] = f"{pid}-{uuid.uuid4().hex[:12]}"
    return _TOKENS[pid]


def _unlink(*paths: Path) -> bool:
    """Delete ``paths`` (missing ones are fine); False, logged, when one cannot be deleted (a read-only folder)."""
    try:
        for p in paths:
            p.unlink(missing_ok=True)
    except OSError as e:
        log.warning("AOT precompile: cannot delete %s (%s)", e.filename, e.strerror)
        return False
    return True


def _write(path: Path, body: bytes) -> None:
    """``body`` into ``path`` (its folder made if need be), atomically (:mod:`kubetitan_trainer.atomic`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(path, body)


def enabled() -> bool:
    """``[kubetitan.runtime] aot_compile`` (``spec.runtime.aotCompile``): off (the default), blocks compile as torch
    does; on, blocks use (and each rank makes) an ahead-of-time artefact."""
    return runtime.settings().aot_compile


def folder(env: Mapping[str, str] | None = None) -> Path | None:
    """``<compile cache>/aot`` (:func:`kubetitan_trainer.compile.compile_cache.root`); None without a cache folder."""
    cache = compile_cache.root(env)
    return cache / SUBDIR if cache is not None else None


def source_key(module: Any) -> str:
    """A hash of the source files of every class in ``module`` (the artefact holds their bytecode: an edited
    block, attention or FP8 linear, under the same package versions, makes a new artefact)."""
    files = set()
    for m in module.modules():
        src = sys.modules.get(type(m).__module__)
        path = getattr(src, "__file__", None)
        if path:
            files.add(path)
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.encode())
        try:
            digest.update(Path(path).read_bytes())
        except OSError:
            digest.update(b"?")
    return digest.hexdigest()[:16]


def artefact_name(inner: Any, env: Mapping[str, str], device: str = "cpu") -> str:
    """``<block class>-<hash>-lr<local rank>.aot``: the hash of the compile cache's key, the Python version, the block's
    sources, the Inductor settings kubetitan changes (``compat.inductor_key``: baked into the generated kernels), the
    local rank (``LOCAL_RANK``) and the device its guards were made for (``cuda:1``, ``cpu``)."""
    local = env.get("LOCAL_RANK", "0") or "0"
    key = "/".join((env.get(compile_cache.KEY_ENV, ""), sys.version.split()[0], source_key(inner),
                    compat.inductor_key(), local, device))
    return f"{type(inner).__name__}-{hashlib.sha256(key.encode()).hexdigest()[:16]}-lr{local}.aot"


def sidecar(path: Path) -> Path:
    """The artefact's description (``{"autocast": [device, dtype name] or null}``), written before the artefact."""
    return path.with_name(path.name + ".json")


class Artefact:
    """An artefact file loaded on a thread of its own, bound to ``device`` (:meth:`get` waits for it)."""

    def __init__(self, path: Path, device: str = "cpu") -> None:
        self.path, self.device, self.compiled, self.error, self.seconds = path, device, None, None, None
        self._thread = threading.Thread(target=self._load, name="kubetitan-aot-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        import torch

        begin = time.perf_counter()
        try:
            if self.device.startswith("cuda"):  # the thread's current device: this rank's, not GPU 0
                torch.cuda.set_device(torch.device(self.device))
            # Loading rebuilds the guards with this thread's dispatch state (a tensor's expected dispatch keys hold
            # the thread's autocast keys): rebuild them under the autocast the artefact was made for, which is the
            # training calls' (else every call under autocast is refused: "dispatch key set mismatch").
            autocast = json.loads(sidecar(self.path).read_text()).get("autocast") if sidecar(self.path).exists() \
                else None
            with torch.autocast(autocast[0], dtype=getattr(torch, autocast[1])) if autocast else \
                    contextlib.nullcontext():
                self.compiled = compat.aot_deserialize(self.path.read_bytes())
        except Exception as e:  # noqa: BLE001 - any failure: the blocks compile as usual
            self.error = f"{type(e).__name__}: {e}"
        self.seconds = time.perf_counter() - begin

    def get(self) -> Any:
        self._thread.join()
        return self.compiled


class Spec:
    """What a call's argument was (a tensor's shape, strides, dtype, device and requires_grad; anything else as is),
    to rebuild an example input for the ahead-of-time compile."""

    def __init__(self, value: Any) -> None:
        import torch

        self.tensor = type(value) is torch.Tensor
        self.value = None if self.tensor else value
        if self.tensor:
            self.meta = (tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
        self.supported = self.tensor or value is None or isinstance(value, (bool, int, float, str))

    def build(self) -> Any:
        import torch

        if not self.tensor:
            return self.value
        shape, stride, dtype, device, grad = self.meta
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad)


class Dispatch:
    """A compiled block's forward: the artefact's graph when its guards pass, else the block's own compiled forward.

    ``capture``: the first call made with grad enabled is recorded (:attr:`seen`) for :func:`after_first_step`."""

    def __init__(self, owner: Precompiled, module: Any, fallback: Any) -> None:
        self.owner, self.module, self.fallback = owner, module, fallback
        self.seen: tuple[list[Spec], dict[str, Spec], tuple[str, Any] | None] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        compiled = owner.artefact.get() if owner.artefact is not None else None
        hooks = compat.module_call_hooks(self.module) if compiled is not None else None
        if hooks:  # the artefact holds the graph traced without them: the block's own compile runs them
            compiled = None
            owner.hooked = True
            owner.refused = owner.refused or f"the block has hooks the artefact would skip: {', '.join(hooks)}"
        if compiled is not None:
            served, out = compat.aot_run(compiled, self.module, args, kwargs)
            if served:
                owner.served += 1
                return out
            if owner.refused is None:  # the first refusal says why (the start-up record)
                owner.refused = compat.aot_guard_failure(compiled, self.module, args, kwargs)[:600]
        owner.fell_back += 1
        if owner.capture and self.seen is None and _grad_enabled():
            self.seen = _record(args, kwargs)
        return self.fallback(*args, **kwargs)


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def _record(args: tuple, kwargs: dict) -> tuple:
    import torch

    autocast = None
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            autocast = (device, torch.get_autocast_dtype(device))
            break
    return [Spec(a) for a in args], {k: Spec(v) for k, v in kwargs.items()}, autocast


class Precompiled:
    """The model's compiled blocks and their artefact (:func:`install`)."""

    def __init__(self, blocks: list[Any], path: Path, rank: int, device: str = "cpu") -> None:
        self.blocks, self.path, self.rank, self.device = blocks, path, rank, device
        self.marker = path.with_name(f"{path.name}.trying-rank{rank}")
        self.making = path.with_name(f"{path.name}.making-rank{rank}")  # one per rank: nodes may share the folder
        self.crashed = path.with_name(f"{path.name}.crashed")
        self.served = self.fell_back = self.steps = 0
        self.hooked = False
        self.refused: str | None = None
        self.saved: dict[str, Any] | None = None
        self.artefact: Artefact | None = None
        self._discard_if_it_failed_before()
        if path.exists():
            try:
                _write(self.marker, process_token().encode())  # removed once this worker's second step has ended
            except OSError as e:  # the artefact could not be deleted if it crashed this worker: do not use it
                log.warning("AOT precompile: cannot write %s (%s); the blocks compile as usual", self.marker,
                            e.strerror)
            else:
                self.artefact = Artefact(path, device)
        # the first call that falls back is recorded, to make an artefact from it (none yet, or a useless one)
        why_not = self._why_not_make()
        self.capture = why_not is None
        if why_not is not None:
            self.saved = {"saved": False, "why": why_not}
        self.dispatch = []
        for wrapper in blocks:
            inner, forward = compat.compiled_module_parts(wrapper)
            if isinstance(forward, Dispatch):  # installed before (the same model parallelised again)
                forward = forward.fallback
            self.dispatch.append(Dispatch(self, inner, forward))
            compat.set_compiled_forward(wrapper, self.dispatch[-1])

    def _discard_if_it_failed_before(self) -> None:
        """This rank's marker left by another process (its last worker used the artefact and ended before its second
        step did): delete the artefact. Only this rank's own marker counts: another rank's may be a live worker's."""
        try:
            writer = self.marker.read_text().strip()
        except OSError:
            return
        if writer == process_token():  # this process's own (an in-process restart)
            return
        crashes = self._crashes() + 1
        log.warning("AOT precompile: the last worker of rank %d (process %s) used %s and ended before its second "
                    "step did; deleting the artefact (%d time(s) in a row) so that this run compiles its blocks",
                    self.rank, writer, self.path, crashes)
        if _unlink(self.path, sidecar(self.path), self.marker):
            try:
                _write(self.crashed, str(crashes).encode())
            except OSError as e:
                log.warning("AOT precompile: cannot write %s (%s)", self.crashed, e.strerror)

    def _crashes(self) -> int:
        """Artefacts deleted after a crash, in a row (``.crashed``; 0 without the file)."""
        try:
            return int(self.crashed.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _why_not_make(self) -> str | None:
        """Why this rank must not make an artefact (None: it may): a worker died making one (a crash in the compile, the
        host's OOM killer: making it again would kill this one too), or artefacts were deleted after crashes
        :data:`MAX_CRASHES` times in a row."""
        try:
            writer = self.making.read_text().strip()
        except OSError:
            writer = None
        crashes = self._crashes()
        if writer is not None and writer != process_token():
            why = f"a worker (process {writer}) died making it; delete {self.making} to let one try again"
        elif crashes >= MAX_CRASHES:
            why = (f"{crashes} artefacts in a row were deleted after a worker running them died; delete "
                   f"{self.crashed} to let one be made again")
        else:
            return None
        log.warning("AOT precompile: not making %s: %s", self.path, why)
        return why

    def useless(self) -> str | None:
        """Why the loaded artefact should be replaced (None: keep it): it failed to load, or it refused every call."""
        a = self.artefact
        if a is None:
            return None
        if a.error:
            return f"loading it failed ({a.error})"
        if self.served == 0 and self.fell_back and not self.hooked:
            return f"its guards refused every call of the first step ({self.refused})"
        return None

    def prepare(self) -> bool:
        """After the first step: drop a useless artefact; whether this rank makes one now."""
        why = self.useless()
        if why is not None:
            log.warning("AOT precompile: %s: %s; the blocks compiled as usual, and it is deleted so that this rank "
                        "makes a new one", self.path, why)
            if _unlink(self.path, sidecar(self.path)):
                self.artefact = None
                _unlink(self.marker)  # this worker no longer runs an artefact
        makes, self.capture = self.capture and self.artefact is None, False
        return makes

    def make(self, makes: bool, gather: bool) -> None:
        """Make this rank's artefact (``makes``); ``gather``: some rank makes one, so every rank gathers the first
        block's parameters (for a block sharded by FSDP2 that is a collective every rank must join)."""
        wrapper = self.blocks[0]
        unshard, reshard = getattr(wrapper, "unshard", None), getattr(wrapper, "reshard", None)
        if not gather or unshard is None:
            if makes:
                self.saved = self._save()
            return
        unshard()  # an FSDP2 block: compile it as its forward sees it, gathered
        try:
            if makes:
                self.saved = self._save()
        finally:
            if reshard is not None:
                reshard()

    def step_ended(self) -> None:
        """After each training step: the marker goes once the second step has ended (the first with optimizer
        state allocated: an artefact that made a worker run out of memory there still counts as its death)."""
        self.steps += 1
        if self.steps == 2:
            self.survived()

    def survived(self) -> None:
        """This worker is past the point where the artefact could have killed it (its second step, or a clean end
        of training): its marker goes, and an artefact it ran resets the count of crashes."""
        _unlink(self.marker)
        if self.served:
            _unlink(self.crashed)

    def _save(self) -> dict[str, Any]:
        import torch

        seen = next((d.seen for d in self.dispatch if d.seen is not None), None)
        wrapper = self.blocks[0]
        if seen is None:
            return {"saved": False, "why": "no block was called with grad enabled"}
        hooks = compat.module_call_hooks(compat.compiled_module_parts(wrapper)[0])
        if hooks:
            return {"saved": False, "why": f"the block has hooks the artefact would skip: {', '.join(hooks)}"}
        args, kwargs, autocast = seen
        unsupported = [s for s in (*args, *kwargs.values()) if not s.supported]
        if unsupported:
            return {"saved": False, "why": f"an input of type {type(unsupported[0].value).__name__}"}
        try:
            _write(self.making, process_token().encode())  # a crash while making it: no later worker tries again
        except OSError as e:
            return {"saved": False, "why": f"cannot write {self.making}: {e.strerror}"}
        begin = time.perf_counter()
        try:
            contexts = [torch.autocast(autocast[0], dtype=autocast[1])] if autocast else []
            # The first step's gradients are set aside while it compiles: a parameter's .grad would be written into
            # the artefact's guards and fail its load ("assigned grad expected to be a Tensor or None").
            params = list(wrapper.parameters())
            grads = [p.grad for p in params]
            try:
                for p in params:
                    p.grad = None
                compiled = compat.aot_compile_module(wrapper, tuple(s.build() for s in args),
                                                     {k: s.build() for k, s in kwargs.items()}, contexts)
            finally:
                for p, g in zip(params, grads):
                    p.grad = g
            data = compat.aot_serialize(compiled)
            described = [autocast[0], str(autocast[1]).removeprefix("torch.")] if autocast else None
            _write(sidecar(self.path), json.dumps({"autocast": described}).encode())
            _write(self.path, data)
        except Exception as e:  # noqa: BLE001 - an experimental torch API: never fail training for it
            log.warning("AOT precompile: compiling the blocks ahead of time failed (%s: %s); restarted workers "
                        "compile them as usual", type(e).__name__, e)
            return {"saved": False, "why": f"{type(e).__name__}: {e}"[:300]}
        finally:
            _unlink(self.making)
        seconds = time.perf_counter() - begin
        log.info("AOT precompile: compiled the transformer blocks ahead of time in %.1f s (%.1f MiB) into %s; "
                 "restarted workers load it instead of compiling them", seconds, len(data) / 2**20, self.path)
        return {"saved": True, "seconds": round(seconds, 2), "bytes": len(data), "autocast": described}

    def summary(self) -> dict[str, Any]:
        a = self.artefact
        out: dict[str, Any] = {"loaded": bool(a is not None and a.compiled is not None), "served": self.served,
                               "fell_back": self.fell_back}
        if a is not None:
            out["load_seconds"] = None if a.seconds is None else round(a.seconds, 3)
            if a.error:
                out["error"] = a.error[:300]
        if self.refused is not None:
            out["refused"] = self.refused
        if self.saved is not None:
            out["made"] = self.saved
        return out


CURRENT: list[Precompiled] = []
"""This process's compiled blocks, one :class:`Precompiled` per kind of block (the last :func:`install`)."""


def _kinds(blocks: list[Any]) -> list[list[Any]]:
    """The compiled blocks grouped by the class of the module each wraps, in the order the classes first appear: with
    activation checkpointing of every N-th block those are ``CheckpointWrapper`` and the others the model's block
    class, and one artefact cannot serve both (its guards check the module's type)."""
    kinds: dict[type, list[Any]] = {}
    for b in blocks:
        kinds.setdefault(type(compat.compiled_module_parts(b)[0]), []).append(b)
    return list(kinds.values())


def _device(block: Any) -> str:
    """The device a block's artefact is made for: its parameters' (``cuda:1``, ``cpu``); while they are still on the
    meta device (torchtitan materialises them after parallelising), this process's current GPU, else ``cpu``."""
    import torch

    param = next(iter(block.parameters()), None)
    if param is not None and param.device.type != "meta":
        return str(param.device)
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def install(model: Any, rank: int | None = None, env: Mapping[str, str] | None = None) -> list[Precompiled] | None:
    """Give ``model``'s compiled transformer blocks (``model.layers``) their :class:`Dispatch` forwards, one
    :class:`Precompiled` (and artefact) per kind of block; None when off, without a compile cache folder, or without
    compiled blocks."""
    global CURRENT
    env = os.environ if env is None else env
    if not enabled():
        return None
    CURRENT = []
    where = folder(env)
    layers = getattr(model, "layers", None)
    blocks = [b for b in (layers.children() if layers is not None else ()) if compat.compiled_module_parts(b)]
    if where is None or not blocks:
        log.info("AOT precompile: %s; the blocks compile as usual",
                 "no compile cache folder (TORCHINDUCTOR_CACHE_DIR)" if where is None else "no compiled blocks")
        return None
    device = _device(blocks[0])
    rank = int(env.get("RANK", "0") or 0) if rank is None else rank
    for kind in _kinds(blocks):
        inner = compat.compiled_module_parts(kind[0])[0]
        p = Precompiled(kind, where / artefact_name(inner, env, device), rank, device)
        log.info("AOT precompile: %s for %d %s blocks on %s", "loading %s" % p.path if p.artefact else
                 ("this rank makes %s after its first step" % p.path if p.capture else "no artefact yet"),
                 len(kind), type(inner).__name__, device)
        CURRENT.append(p)
    return CURRENT


def step_ended() -> None:
    """The trainer's call after every training step (cheap: a counter)."""
    for p in CURRENT:
        p.step_ended()


def training_ended() -> None:
    """The trainer's call when training ends without an error (the last step, or a stop on SIGTERM), also before a
    second step: what the worker ran did not kill it."""
    for p in CURRENT:
        p.survived()


def agree(makes: bool, installed: bool) -> tuple[bool, bool]:
    """``(some rank makes an artefact, every rank installed its blocks)``: one MAX all-reduce over the default process
    group when there is one of several ranks (on the rank's GPU under NCCL), else this rank's own answer."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return makes, installed
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor([float(makes), float(not installed)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    anyone, missing = (bool(v) for v in flags.tolist())
    return anyone, not missing


def _merged(summaries: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One start-up record entry for every kind of block: loaded when each kind's artefact loaded, the calls served
    and fallen back summed, the longest load (they load on threads of their own), the first refusal or error, what
    was made; ``kinds``: each kind's own, by class."""
    out: dict[str, Any] = {"loaded": all(s["loaded"] for s in summaries),
                           "served": sum(s["served"] for s in summaries),
                           "fell_back": sum(s["fell_back"] for s in summaries)}
    loads = [s["load_seconds"] for s in summaries if s.get("load_seconds") is not None]
    if loads:
        out["load_seconds"] = max(loads)
    for key in ("error", "refused"):
        first = next((s[key] for s in summaries if key in s), None)
        if first is not None:
            out[key] = first
    made = [s["made"] for s in summaries if "made" in s]
    if made:
        saved = [m for m in made if m.get("saved")]
        out["made"] = {"saved": len(saved) == len(made)}
        if saved:
            out["made"].update(seconds=round(sum(m.get("seconds", 0) for m in saved), 2),
                               bytes=sum(m.get("bytes", 0) for m in saved), autocast=saved[0].get("autocast"))
        if len(saved) < len(made):
            out["made"]["why"] = next(m["why"] for m in made if not m.get("saved"))
        if len(made) > 1:
            out["made"]["kinds_made"] = [len(saved), len(made)]
    if len(summaries) > 1:
        out["kinds_loaded"] = [sum(s["loaded"] for s in summaries), len(summaries)]
        out["kinds"] = dict(zip(names, summaries))
    return out


_VOTED: tuple[list[dict[str, Any]], list[bool]] | None = None
"""What this rank's first step used and which kinds it makes, from :func:`vote` to :func:`after_first_step`."""

NOT_EVERY_RANK = ("not every rank could take part: another rank has no compiled blocks or no compile cache folder, "
                  "or was not at its first step")


def vote() -> tuple[bool, bool]:
    """This rank's part of the decision after its first step: ``(it makes an artefact, it installed its blocks)``.
    What the step used is kept for the start-up record first; a useless artefact is dropped here."""
    global _VOTED
    if not CURRENT:
        _VOTED = None
        return False, False
    summaries = [p.summary() for p in CURRENT]
    makes = [p.prepare() for p in CURRENT]
    _VOTED = (summaries, makes)
    return any(makes), True


def after_first_step(decision: tuple[bool, bool] | None = None) -> dict[str, Any] | None:
    """After the first training step, on every rank: make what this rank makes, gathering each kind's first block
    with the other ranks when any rank makes one; the summary for the start-up record (None when this rank installed
    nothing). ``decision``: ``(some rank makes one, every rank voted ready)``, from the trainer's agreement after the
    first step (one all-reduce with the step's own flags, so a rank that is not at its first step says so there);
    None: this rank votes and agrees on its own (:func:`agree`, a collective)."""
    global _VOTED
    if decision is None:
        decision = agree(*vote())
    if not CURRENT or _VOTED is None:
        return None
    (summaries, makes), _VOTED = _VOTED, None
    anyone, everyone = decision
    for p, m, summary in zip(CURRENT, makes, summaries):
        if not everyone:
            if m:
                p.saved = {"saved": False, "why": NOT_EVERY_RANK}
        else:
            p.make(m, gather=anyone)  # every kind, in the same order on every rank: the gathers match
        if p.saved is not None:
            summary["made"] = p.saved
    names = [type(compat.compiled_module_parts(p.blocks[0])[0]).__name__ for p in CURRENT]
    return _merged(summaries, names)
