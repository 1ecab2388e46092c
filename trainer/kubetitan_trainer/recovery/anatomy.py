"""Recovery anatomy: where the seconds from a start (or an in-place restart) to the first trained step went.

Every worker process marks its start-up on one wall clock (``time.time()``) and, after its first optimizer
step, splits the span **origin -> end of the first step** into contiguous phases (they sum to the total):

============================  =================================================================================
phase                         from -> to
============================  =================================================================================
``process_start``             origin -> the worker's ``main()`` runs. For an in-place restart (generation > 0)
                              the origin is the moment this pod's agent began the restart (it detected its own
                              worker's failure, or a peer waiting in the rendezvous): then the stop of the other
                              local workers, the rendezvous and the fork. Else the launcher process's start
                              (interpreter, torchrun, worker spawn), less the two phases below that the launcher
                              spends in that span.
``preflight``                 generation 0: the launcher's wait for the pod's pre-flight gate
                              (:mod:`kubetitan_trainer.preflight`) beyond its warm imports, which a GPU pod's gate
                              overlaps (moved here out of ``process_start``); 0 for in-place generations and with the
                              gate off. The record's ``preflight`` entry keeps every check's row and the gate's own
                              seconds.
``imports``                   ``main()`` -> process-group init begins: torch/torchtitan/trainer imports, config
                              check, plus the launcher's one-time warm imports for generation 0 of a warm
                              launcher (moved here out of ``process_start``). About 0 for a forked warm worker.
``process_group_init``        torchtitan's ``init_distributed`` (the NCCL/gloo world).
``model_init``                model build, parallelisation, optimizer, data loader, up to the checkpoint load.
``checkpoint_load``           the checkpoint load (0 when there is none): DCP, or the node-local restore tier.
``first_step_compile``        torch.compile time (Dynamo + Inductor, forward and backward) inside the first step,
                              read from ``torch._dynamo.utils.calculate_time_spent``: a warm cache shrinks it.
``first_step``                the rest of the first step (and the few calls between the load and the step).
============================  =================================================================================

The record also keeps ``compile_parts``: the first step's seconds in each of torch's own compile phases
(``entire_frame_compile``, ``backend_compile``, ``inductor_compile``, ``code_gen``, ...; they nest), which say where
a warm cache's seconds still go; and ``compile_counts``: how many graphs the first step traced and how many of them
the AOTAutograd and Inductor caches served (``aot_autograd.autograd_cache_hit``, ``inductor.fxgraph_cache_miss``,
...), which say whether the warm start was served from the cache or compiled again.

Rank 0 of the job writes one JSON line per worker generation to ``<dump>/kubetitan/startup.jsonl``; local
rank 0 of every pod exports the phases as ``kubetitan_trainer_startup_phase_seconds{phase=...}`` (see
:mod:`kubetitan_trainer.metrics`). Pure of torch (torch is read only when a worker has imported it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from kubetitan_trainer import compat  # torch-free at import
from kubetitan_core.contract import STARTUP_PHASES as PHASES  # noqa: E402 - torch-free, shared with the operator

"""The phases, in order; they partition origin -> end of the first step."""

ENV_LAUNCHER_STATE = "KUBETITAN_LAUNCHER_STATE"  # same name as launch.ENV_LAUNCHER_STATE (launch imports this)

STARTUP_LOG = "startup.jsonl"


def process_start_time(pid: str | int = "self") -> float | None:
    """Unix time the process ``pid`` started (a fork counts), from ``/proc/<pid>/stat``; None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime (clock ticks since boot)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def read_launcher_state(env: dict | None = None) -> dict:
    """The launcher's JSON state (restarts, failures with their detection time, start time); {} without one."""
    path = (os.environ if env is None else env).get(ENV_LAUNCHER_STATE, "")
    if not path:
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def origin_of(state: dict, fallback: float) -> tuple[float, str, int]:
    """(origin time, what it is, generation) for a worker starting under the launcher ``state``.

    Generation = the worker generation every rank shares (``state['generation']``, one rendezvous round each),
    else the launcher's own in-place restarts. A restarted generation counts from the moment this pod's
    agent began the restart: its detection of its own worker's failure (``failure_detected``) or of a peer
    waiting in the rendezvous (``peer_restart``); generation 0 from the launcher's start."""
    generation = int(state.get("generation", state.get("restarts", 0)) or 0)
    if generation > 0:
        if state.get("restart_origin"):
            return float(state["restart_origin"]), str(state.get("restart_origin_kind", "failure_detected")), generation
        restarted = [f for f in state.get("failures", []) if f.get("restarted")]
        if restarted and restarted[-1].get("detected"):
            return float(restarted[-1]["detected"]), "failure_detected", generation
    if state.get("started"):
        return float(state["started"]), "launcher_start", generation
    return fallback, "worker_start", generation


def compile_parts() -> dict[str, float]:
    """Seconds this process has spent in torch.compile so far, ``total_wall_time`` and each of torch's parts ({}
    when torch._dynamo is not loaded)."""
    return compat.compile_time_parts()


def parts_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The parts' seconds between two readings of :func:`compile_parts` (those of at least 5 ms, rounded)."""
    out = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}
    return {k: v for k, v in sorted(out.items()) if v >= 0.005}


def compile_counts() -> dict[str, int]:
    """This process's torch.compile counters so far (graphs traced; AOTAutograd and Inductor cache hits, misses
    and bypasses; {} when torch._dynamo is not loaded)."""
    return compat.compile_counts()


def counts_spent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that grew between two readings of :func:`compile_counts`, by how much."""
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v > before.get(k, 0)}


def split(marks: dict[str, float], compile_in_first_step: float, warm_import_seconds: float = 0.0,
          preflight_seconds: float = 0.0) -> dict[str, float]:
    """Contiguous phase seconds from the marks (unix times): ``origin``, ``main``, ``pg_begin``, ``pg_end``,
    ``load_begin``, ``load_end``, ``first_step_end``. A missing mark takes the previous one's time (a phase of 0);
    negative spans (clock steps, a mark out of order) count 0. The launcher's warm imports and its wait for the
    pre-flight gate, both spent before ``main``, are carved out of ``process_start`` (at most what it holds)."""
    order = ("origin", "main", "pg_begin", "pg_end", "load_begin", "load_end", "first_step_end")
    t: dict[str, float] = {}
    last = marks["origin"]
    for name in order:
        last = max(last, marks.get(name, last))
        t[name] = last
    first = t["first_step_end"] - t["load_end"]
    warm = min(max(0.0, warm_import_seconds), t["main"] - t["origin"])
    gate = min(max(0.0, preflight_seconds), t["main"] - t["origin"] - warm)
    compiled = min(max(0.0, compile_in_first_step), first)
    return {
        "process_start": t["main"] - t["origin"] - warm - gate,
        "preflight": gate,
        "imports": t["pg_begin"] - t["main"] + warm,
        "process_group_init": t["pg_end"] - t["pg_begin"],
        "model_init": t["load_begin"] - t["pg_end"],
        "checkpoint_load": t["load_end"] - t["load_begin"],
        "first_step_compile": compiled,
        "first_step": first - compiled,
    }


class Recorder:
    """One worker process's start-up marks (``begin`` at ``main()``; the trainer marks the rest)."""

    def __init__(self, state: dict | None = None, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.state = read_launcher_state() if state is None else state
        origin, self.origin_kind, self.generation = origin_of(self.state, process_start_time() or now)
        self.marks: dict[str, float] = {"origin": min(origin, now), "main": now}
        # A warm launcher's one-time imports belong to generation 0's imports, not to its process start.
        self.warm_import_seconds = float(self.state.get("warm_import_seconds", 0.0) or 0.0) if self.generation == 0 else 0.0
        # The launcher's pre-flight gate ran before generation 0 only (once per attempt).
        self.preflight = dict(self.state.get("preflight") or {}) if self.generation == 0 else {}
        self.load_source = "none"
        self._compile_before: dict[str, float] = {}
        self._counts_before: dict[str, int] = {}
        self.result: dict | None = None

    def mark(self, name: str, t: float | None = None) -> None:
        self.marks.setdefault(name, time.time() if t is None else t)

    def first_step_begins(self) -> None:
        self._compile_before = compile_parts()
        self._counts_before = compile_counts()

    def first_step_ends(self, step: int, attempt: int, t: float | None = None) -> dict:
        """Close the record at the end of the first step of this process; returns it (once)."""
        if self.result is not None:
            return self.result
        self.mark("first_step_end", t)
        spent = parts_spent(self._compile_before, compile_parts())
        phases = split(self.marks, spent.get("total_wall_time", 0.0), self.warm_import_seconds,
                       float(self.preflight.get("waited", 0.0) or 0.0))
        self.result = {"attempt": attempt, "generation": self.generation, "origin": self.origin_kind,
                       "first_step": step, "checkpoint_source": self.load_source, "phases": phases,
                       "total_seconds": sum(phases.values()), "time": self.marks["first_step_end"],
                       "compile_parts": {k: v for k, v in spent.items() if k != "total_wall_time"},
                       "compile_counts": counts_spent(self._counts_before, compile_counts())}
        from kubetitan_trainer.recovery import cuda_context  # torch-free

        if self.preflight:
            self.result["preflight"] = self.preflight
        early = cuda_context.settled()
        if early is not None:
            self.result["cuda_context"] = {k: early[k] for k in ("seconds", "device", "rc")}
        return self.result


RECORDER: Recorder | None = None
"""This process's recorder, created by :func:`begin` (``kubetitan_trainer.main``)."""


def begin(state: dict | None = None) -> Recorder:
    global RECORDER
    RECORDER = Recorder(state)
    return RECORDER


def current() -> Recorder:
    """The process's recorder (one is created on first use when ``main`` did not run, e.g. in tests)."""
    return RECORDER if RECORDER is not None else begin()


def append_log(folder: str | Path, record: dict) -> Path:
    path = Path(folder) / "kubetitan" / STARTUP_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return path


def describe(record: dict) -> str:
    p = record["phases"]
    return (f"Start-up of generation {record['generation']} (attempt {record['attempt']}, from {record['origin']}) "
            f"to the end of step {record['first_step']}: {record['total_seconds']:.1f} s = "
            + ", ".join(f"{k} {p[k]:.1f}" for k in PHASES) + f" (checkpoint: {record['checkpoint_source']})"
            + compile_note(record.get("compile_parts") or {}) + counts_note(record.get("compile_counts") or {})
            + context_note(record.get("cuda_context")) + aot_note(record.get("aot_precompile"))
            + gate_note(record.get("preflight")))


def gate_note(gate: dict | None) -> str:
    """The pod's pre-flight gate (:mod:`kubetitan_trainer.preflight`): off, or its outcome and seconds."""
    if not gate:
        return ""
    if gate.get("status") == "disabled":
        return "; pre-flight gate: off"
    rows = gate.get("rows") or []
    skipped = [r["check"] for r in rows if r.get("status") == "skipped"]
    return (f"; pre-flight gate: {gate.get('status')} in {float(gate.get('seconds', 0.0)):.2f} s (waited "
            f"{float(gate.get('waited', 0.0)):.2f} s)" + (f", skipped: {', '.join(skipped)}" if skipped else ""))


def aot_note(aot: dict | None) -> str:
    """The ahead-of-time compiled blocks' use (:mod:`kubetitan_trainer.compile.aot_precompile`)."""
    if not aot:
        return ""
    kinds = aot.get("kinds_loaded")  # [loaded, of] with several kinds of block (one artefact each)
    if kinds and 0 < kinds[0] < kinds[1]:
        loaded = f"loaded {kinds[0]} of {kinds[1]} kinds" + (f" in {aot['load_seconds']:.2f} s"
                                                              if aot.get("load_seconds") is not None else "")
    elif aot.get("loaded"):
        loaded = f"loaded in {aot['load_seconds']:.2f} s"
    else:
        loaded = "failed to load" if aot.get("error") else "none to load"
    made = aot.get("made") or {}
    of = f" {made['kinds_made'][0]} of {made['kinds_made'][1]} kinds" if made.get("kinds_made") else ""
    note = f"; AOT blocks: {loaded}, {aot['served']} calls served, {aot['fell_back']} compiled as usual"
    if made.get("seconds") is not None:
        note += f"; made{of} in {made['seconds']:.1f} s"
    if made.get("why"):
        note += f"; not made ({made['why']})"
    return note


def context_note(early: dict | None) -> str:
    """The CUDA context made on a side thread at the start (:mod:`kubetitan_trainer.recovery.cuda_context`)."""
    if not early:
        return ""
    return (f"; CUDA context on a side thread: {early['seconds']:.2f} s" if not early["rc"] else
            f"; CUDA context on a side thread: failed (CUDA error {early['rc']})")


def compile_note(parts: dict[str, float]) -> str:
    """The first step's compile parts, longest first (torch's own names; they nest, so they do not add up)."""
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:6]
    return "; first-step compile parts: " + ", ".join(f"{k} {v:.2f}" for k, v in top) if top else ""


def counts_note(counts: dict[str, int]) -> str:
    """The first step's compile counters (graphs traced, cache hits, misses and bypasses)."""
    return "; compile counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()) if counts else ""
