"""The in-place agent: torchrun's ``LocalElasticAgent`` that restarts a failed gang's workers in the same pods.

In-place restarts (``--max-restarts=N``, N > 0; docs/operator.md "In-place restarts"): the same
torchrun agent, with a **c10d rendezvous** hosted by node rank 0's launcher at
``master-addr:master-port`` instead of the static one. When a worker of any pod dies, that pod's agent
stops its other local workers and re-enters the rendezvous; every other agent sees a node waiting
(``num_nodes_waiting() > 0`` in ``SimpleElasticAgent._invoke_run``) and restarts its own workers too, so
the whole gang restarts together and resumes from the newest complete checkpoint, while the pods, their
volumes and their placement stay. After N such restarts the next failure ends the launcher with the
worker's exit code, and the operator re-creates the gang as before. Failures that a restart in the same pods
cannot cure are never restarted in place: the causes of ``kubetitan_core.causes.CAUSES`` whose row says so (exit
2, 4, 5 and 75, a GPU fault such as NVIDIA Xid 79 in the worker's failure report) and a SIGTERM stop (the pod is
going away). A GPU fault is also written to the pod's termination message, where the operator reads it.

The launchers talk through their rendezvous store (:mod:`kubetitan_trainer.launch.store`); this module imports
torch's elastic agent, so the launcher imports it only when in-place restarts are on."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Callable

from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from kubetitan_core import contract
from kubetitan_core.contract import ExitCode
from kubetitan_core.contract.failure import FailureReport
from kubetitan_trainer import compat
from kubetitan_trainer.launch import orphans
from kubetitan_trainer.launch import store as rdzv_store
from kubetitan_trainer.launch.failures import restartable, xid_report
from kubetitan_trainer.launch.state import IN_RENDEZVOUS, LauncherState, StoppedInRendezvous, kill_workers, process_state
from kubetitan_trainer.recovery import heartbeat

log = logging.getLogger("kubetitan.launch")


def poll_seconds(nnodes: int) -> float:
    """How often an agent polls the rendezvous store: 0.01 s per node, within [0.02 s, 1 s] (torch's fixed 1 s
    is most of an in-place restart's rendezvous on a small gang, and a round takes several polls: the exit from
    the old round, the join, the completion; a large gang keeps the store's load at torch's: 1,000 nodes poll
    once a second each). Only agents waiting in a round poll."""
    return min(1.0, max(0.02, 0.01 * nnodes))


def fast_rendezvous_polls(nnodes: int) -> None:
    """torch 2.11's c10d rendezvous sleeps a fixed 1 s between polls of the shared state while it waits for the
    other nodes (``dynamic_rendezvous._DistributedRendezvousOpExecutor.run``, ``_delay(seconds=1)``), and serves
    polls within 1 s of the last read from a cache (``_BackendRendezvousStateHolder(cache_duration=1)``, shortened
    in :func:`in_place_rendezvous_handler`); poll every :func:`poll_seconds` instead. Other delays (the first
    round's random skew) are kept."""
    compat.poll_rendezvous_every(poll_seconds(nnodes))


def in_place_rendezvous_handler(config, nnodes: int, agents: list):
    """torch's c10d rendezvous handler for ``config``, whose ``num_nodes_waiting`` also counts a peer's announcement
    of the next generation (:func:`~kubetitan_trainer.launch.store.rejoin`), and whose state cache lasts one
    :func:`poll_seconds`. ``agents``: the one agent of this launcher, once it exists."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                  min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                  local_addr=config.local_addr, **config.rdzv_configs)
    handler = rdzv_registry.get_rendezvous_handler(params)

    def counting_rejoins(torch_waiting):
        def num_nodes_waiting() -> int:
            """torch's count, or 1 when a peer announced the next generation (:func:`rejoin`): this agent's healthy
            workers must restart too (``SimpleElasticAgent._invoke_run`` polls this every monitor interval)."""
            agent = agents[0] if agents else None
            store = compat.agent_store(agent) if agent is not None else None
            if store is not None and agent.generation >= 0:
                try:
                    if rdzv_store.rejoin_announced(store, agent.generation + 1):
                        return 1
                except Exception as e:  # noqa: BLE001 - torch's own count still applies
                    log.debug("Could not read the rejoin key: %s", e)
            return torch_waiting()

        return num_nodes_waiting

    compat.wrap_num_nodes_waiting(handler, counting_rejoins)
    compat.shorten_rendezvous_cache(handler, poll_seconds(nnodes))  # (1 s in torch 2.11: a poll within it re-reads)
    return handler


@dataclasses.dataclass(frozen=True)
class InPlaceRun:
    """What an in-place agent knows of its launcher's run."""

    state: LauncherState
    stop_requested: Callable[[], bool]
    """True once SIGTERM came: no restart then."""
    node_rank: int = 0
    nnodes: int = 1
    nproc_per_node: int = 1
    hang_rule: heartbeat.Rule | None = None
    beat_dir: str = ""
    """The workers' heartbeat folder; '' turns the hang watchdog off."""
    join_timeout: float = 600.0
    """Seconds a rejoin waits for every node's agent (:func:`~kubetitan_trainer.launch.store.rejoin`)."""


@compat.overrides(*compat.ELASTIC_AGENT_OVERRIDES)
class InPlaceAgent(LocalElasticAgent):
    """An agent that records failures, refuses restarts that cannot help
    (:func:`~kubetitan_trainer.launch.failures.restartable`) and, with a heartbeat folder, stops workers whose step
    stands still past the hang rule (:mod:`kubetitan_trainer.recovery.heartbeat`): every rank's workers then restart
    in place, cause Hang. A restart of the same gang skips torch's rendezvous round
    (:func:`~kubetitan_trainer.launch.store.rejoin`)."""

    generation = -1
    """Worker generation (contract.ENV_RESTART_GENERATION): one rendezvous round per generation on every
    rank, so every pod counts the same, where torchrun's restart count moves only on the failing pod."""

    hang_report: FailureReport | None = None
    """This generation's hang, once the watchdog stopped the workers for one (posted as its failure)."""

    def __init__(self, run: InPlaceRun, spec: WorkerSpec, logs_specs, **kwargs) -> None:
        super().__init__(spec=spec, logs_specs=logs_specs, **kwargs)
        self.in_place = run

    def _monitor_workers(self, worker_group):
        if len(worker_group.workers) > 1 and self.hang_report is None:
            # A local worker exited while another is stopped: torch's join would SIGTERM the stopped one and
            # wait its 30 s for it. It is the hung one: say so and kill it now.
            states = [process_state(w.id) for w in worker_group.workers if w.id]
            if "Z" in states and any(x in ("T", "t") for x in states):
                self._stop_frozen(worker_group, "stopped (state T) when a local peer worker exited")
        compat.tolerate_torn_error_files(compat.workers_context(self))
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY:
            self._watch_heartbeats(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            self._record_failures(worker_group, result.failures)
        return result

    def _watch_heartbeats(self, worker_group) -> None:
        """The hang watchdog: stop the workers when their step stands still past the hang rule."""
        run = self.in_place
        if not (run.beat_dir and run.hang_rule) or self.hang_report is not None or run.stop_requested():
            return
        stall = heartbeat.stalled(heartbeat.read(run.beat_dir, range(len(worker_group.workers))),
                                  self.generation, time.monotonic(), run.hang_rule)
        if stall is not None:
            self._stop_hung(worker_group, stall)

    def _record_failures(self, worker_group, failures: dict) -> None:
        """Record the workers' failures, decide whether the gang restarts in place, and post the failure for the
        next generation when it does."""
        run, detected = self.in_place, time.time()
        if self.hang_report is not None:  # the watchdog's SIGKILL: report the hang, not signal 9
            for f in failures.values():
                if f.exitcode == -signal.SIGKILL:  # a worker that exited by itself keeps its own code
                    f.exitcode = int(ExitCode.HANG)
        report = xid_report(since=run.state.data["started"])
        ok = restartable(failures, run.stop_requested(), report) and compat.remaining_restarts(self) > 0
        if not ok:
            compat.forbid_restarts(self)
        run.state.failed(failures, restarting=ok, detected=detected, report=report)
        if ok:
            rdzv_store.post_failure(worker_group.store, self.generation, run.node_rank, failures, self.hang_report)
            log.warning("Worker(s) failed (%s); restarting every rank's workers in place (%d left)",
                        {r: f.exitcode for r, f in failures.items()}, compat.remaining_restarts(self) - 1)

    def _stop_hung(self, worker_group, stall: heartbeat.Stall) -> None:
        """Post the hang as this generation's failure (before the rejoin that the rank 0 launcher reads it
        after), then SIGKILL every local worker: the agent sees them fail (or, when a peer's announcement
        comes first, restarts them) and the whole gang restarts in place."""
        node_rank = self.in_place.node_rank
        pids = [w.id for w in worker_group.workers if w.id]
        stopped = any(process_state(pid) in ("T", "t") for pid in pids)
        self.hang_report = FailureReport(exit_code=int(ExitCode.HANG), node_rank=node_rank, time=time.time(),
                                         local_rank=stall.local_rank, stopped=stopped, message=stall.describe())
        rdzv_store.post_failure(worker_group.store, self.generation, node_rank, {}, self.hang_report)
        log.warning("Hang: %s%s; stopping this pod's workers (every rank's workers restart in place)",
                    stall.describe(), " (the worker is stopped, state T)" if stopped else "")
        kill_workers(pids)

    def _stop_frozen(self, worker_group, how: str) -> None:
        """A local worker is stopped (SIGSTOP, state T) while the gang restarts: it would never act on torch's
        SIGTERM; report it as the hang (the record then names this node) and kill it."""
        frozen = [w for w in worker_group.workers if w.id and process_state(w.id) in ("T", "t")]
        if not frozen:
            return
        beat_dir = self.in_place.beat_dir
        beats = heartbeat.read(beat_dir, range(len(worker_group.workers))) if beat_dir else {}
        last = max((b for b in beats.values() if b.get("generation") == self.generation),
                   key=lambda b: b["monotonic"], default=None)
        idle = time.monotonic() - last["monotonic"] if last else 0.0
        self._stop_hung(worker_group, heartbeat.Stall(local_rank=frozen[0].local_rank,
                                                      step=int(last["step"]) if last else 0,
                                                      idle_seconds=idle, limit_seconds=0.0, how=how))

    def _shutdown(self, death_sig=signal.SIGTERM) -> None:
        """torch's: the workers stopped; then whatever they left running, which became the launcher's children
        (:mod:`kubetitan_trainer.launch.orphans`)."""
        super()._shutdown(death_sig)
        orphans.reap()

    def _restart_workers(self, worker_group):
        # A peer announced the next generation. A worker of ours that is stopped is the hung one.
        if self.hang_report is None:
            self._stop_frozen(worker_group, "stopped (state T) when a peer's launcher restarted the gang")
        self.in_place.state.restart_begins()
        super()._restart_workers(worker_group)

    def _rendezvous(self, worker_group):
        run = self.in_place
        old = worker_group.store if self.generation >= 0 else None
        begin = time.time()
        if run.stop_requested():
            raise StoppedInRendezvous()
        IN_RENDEZVOUS["now"] = True
        try:
            if old is None:  # the gang forms: torch's c10d rendezvous assigns the node ranks
                super()._rendezvous(worker_group)
            else:  # the same gang again: same ranks, same store (see rejoin)
                rdzv_store.rejoin(old, self.generation + 1, run.nnodes, run.join_timeout)
        finally:
            IN_RENDEZVOUS["now"] = False
        if old is not None:
            log.info("Rendezvous round for worker generation %d took %.2f s", self.generation + 1,
                     time.time() - begin)
        # Every failing launcher posted its failure before it joined this round, so all are readable now.
        failure = rdzv_store.earliest_failure(old, self.generation, run.nnodes) if old is not None else None
        self._next_generation(failure)

    def _next_generation(self, failure: FailureReport | None) -> None:
        """Begin the next worker generation after ``failure`` (None: the first, or no pod posted one): the
        environment the forked workers inherit, the heartbeats cleared, the launcher's state file."""
        run = self.in_place
        if failure is not None and run.beat_dir:
            # the last step the ending generation trained (this pod's workers' heartbeats; every rank steps
            # together): the work lost is exact, not what the operator's last scrape happened to see
            steps = [b["step"] for b in heartbeat.read(run.beat_dir, range(run.nproc_per_node)).values()
                     if b.get("generation") == self.generation]
            if steps:
                failure = dataclasses.replace(failure, previous_step=max(steps))
        self.generation += 1
        self.hang_report = None
        if run.beat_dir:
            heartbeat.clear(run.beat_dir, range(run.nproc_per_node))
        os.environ[contract.ENV_RESTART_GENERATION] = str(self.generation)  # forked workers inherit it
        if failure is not None:
            os.environ[contract.ENV_RESTART_FAILURE] = failure.to_json()
            log.warning("Worker generation %d starts after a failure of node rank %s (exit code %s)",
                        self.generation, failure.node_rank, failure.exit_code)
        else:
            os.environ.pop(contract.ENV_RESTART_FAILURE, None)
        run.state.data["generation"] = self.generation
        run.state.write()


def run_in_place(config, entrypoint, args: list, state: LauncherState, stop_requested, node_rank: int = 0,
                 nnodes: int = 1, hang_rule: heartbeat.Rule | None = None, beat_dir: str = "") -> None:
    """``torch.distributed.launcher.api.launch_agent`` with an :class:`InPlaceAgent`. Raises ChildFailedError when
    the workers fail."""
    fast_rendezvous_polls(nnodes)
    run = InPlaceRun(state=state, stop_requested=stop_requested, node_rank=node_rank, nnodes=nnodes,
                     nproc_per_node=config.nproc_per_node, hang_rule=hang_rule, beat_dir=beat_dir,
                     join_timeout=float(config.rdzv_configs.get("join_timeout", 600) or 600))
    agents: list = []
    handler = in_place_rendezvous_handler(config, nnodes, agents)
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=handler,
                      max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
                      local_addr=config.local_addr)
    agent = InPlaceAgent(run, spec=spec, logs_specs=config.logs_specs, start_method="fork",
                         log_line_prefix_template=config.log_line_prefix_template)
    agents.append(agent)
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name="kubetitan_trainer.main", failures=result.failures)
    finally:
        spec.rdzv_handler.shutdown()
