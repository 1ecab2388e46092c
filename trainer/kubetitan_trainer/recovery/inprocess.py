"""In-process restart: a fault that leaves the worker process alive restarts the training loop inside it.

A Python exception in a step, a non-finite loss, a collective error or a collective timeout (a hung peer) does not
need a new process: the worker keeps its imports, its built model and its compiled code, drops the process group,
joins a new one with the same ranks, reloads the training state (the restore tier, else the newest complete DCP
checkpoint) and trains on. The design follows nvidia-resiliency-ext's ``inprocess.Wrapper`` (read, not used: see
docs/reliability.md) in what matters, at a fraction of its size:

- **One store the ranks share** (the launchers' TCPStore; any ``torch.distributed.Store``) under a prefix per worker
  generation, holding per restart *iteration* ``g``: ``fault/g`` (the first fault, set with ``compare_set``: first
  writer wins), ``fault/g/rank/r`` (each faulted rank's own record), ``barrier/g`` (the ranks that have torn down)
  and ``done/g`` (the ranks that finished).
- **A monitor thread** per rank watches ``fault/g``. When another rank has faulted it interrupts this rank's main
  thread: NCCL's communicators are aborted (that unblocks a collective stuck on the GPU) and ``SIGUSR2`` makes the main
  thread raise :class:`RestartInterrupt` (a ``BaseException``, as nvidia-resiliency-ext's ``RestartAbort``) at its
  next bytecode, or at once from an interruptible wait (``time.sleep``, a lock). A gloo collective cannot be
  aborted (torch 2.11: ``abort``/``shutdown`` of a gloo group wake nobody): it ends when the faulted peer's sockets
  close (its group destroyed and no longer referenced) or, when something still holds that group (FSDP does), at the
  collective timeout.
- **Hangs** are collective timeouts: a rank whose peer never arrives gets the process group's timeout error
  (``collective_timeout``), reports it as a ``Hang`` fault, and the hung rank is interrupted as above.
- **Agreement**: every rank writes its own fault (if any), tears its process group down (NCCL: ``abort``), and meets
  the others at ``barrier/g``; then each reads the same records and applies the same pure rule (:func:`decide`), so
  every rank retries or every rank gives up. A rank that never reaches the barrier (stuck where no signal reaches)
  ends the wait after ``barrier_timeout``: every other rank gives up with exit code 7 (``Hang``).
- **Fallback** to today's path (the worker exits, the launcher restarts every worker in place or the gang is
  re-created): a cause the causes table does not restart in place (``kubetitan_core.causes``: a GPU Xid, a
  configuration error, a full volume), the same fault at the same step twice in a row, or the in-process budget
  used up. :class:`GangGaveUp` carries the exit code the launcher classifies.
- **Iteration ``g+1``** gets a new process group on the store prefix ``pg/g+1`` (same world, same ranks) and the
  same ``body``; the body reloads the state it needs (anything bound to the old group, such as a device mesh, must
  be re-bound by the body: the old one is destroyed).
- **Kept state**: with the fault each rank writes ``state/g/rank/r``, the body's word for the state it holds
  (``state_token``; the trainer's is :class:`StepState`'s: the last step whose optimizer step ended, as long as the
  next one's has not begun). When every rank wrote the same non-empty word (:func:`kept_state`), :attr:`kept` says
  so for iteration ``g+1`` and the body keeps its state instead of loading one: a fault that stops every rank's
  host before its optimizer step (gloo collectives block the host; with NCCL a peer's host may already have queued
  its optimizer step, and then the gang loads) loses no step and loads nothing; the step trains again on the
  microbatches it had drawn.

Test-only fault injection: ``KUBETITAN_TEST_FAULT=<rank>:<step>:<kind>`` (:func:`inject`), ``kind`` one of
``raise`` (a RuntimeError; several faults: comma-separated), ``nan`` (the step's loss becomes NaN), ``hang`` (the rank sleeps in the step), ``config``
(a ConfigError, not restartable), each once per process, or ``raise-always`` (every time: a fault that repeats);
``raise-in-backward`` (:func:`inject_into_backward`) raises in the backward of the model's middle block, after the
later blocks' gradients were reduced.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from kubetitan_core import causes
from kubetitan_core.contract import ExitCode

from kubetitan_trainer import errors

log = logging.getLogger("kubetitan.inprocess")
T = TypeVar("T")

ENV_TEST_FAULT = "KUBETITAN_TEST_FAULT"
"""Test-only fault injection (see the module docstring); unset in every real run."""
INTERRUPT_SIGNAL = signal.SIGUSR2
"""The signal the monitor thread sends the main thread (nothing else in kubetitan uses it)."""


class RestartInterrupt(BaseException):
    """Raised in a rank's main thread when another rank of the gang has faulted (a ``BaseException``: a step's own
    ``except Exception`` does not swallow it)."""


class GangGaveUp(Exception):
    """The gang stopped restarting in-process: the worker exits with ``exit_code`` and the launcher's path follows."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = int(exit_code)


# --------------------------------------------------------------------------------------------------- classification
COLLECTIVE_TIMEOUT = re.compile(r"[Tt]imed out|[Tt]imeout|Watchdog caught collective operation timeout")
"""A collective that ended by the process group's timeout (gloo: ``Timed out waiting ... for recv``; NCCL's
watchdog): a peer never arrived, the ``Hang`` cause (exit code 7)."""


@dataclass(frozen=True)
class Fault:
    """One rank's fault in restart iteration ``generation``, as every rank reads it from the store."""

    rank: int
    generation: int
    step: int
    cause: str
    """A ``kubetitan_core.causes`` id."""
    seen: str
    in_place: bool
    """The causes table restarts this cause in place (so in-process too)."""
    exit_code: int
    time: float = field(default=0.0, compare=False)
    """Wall-clock time of the fault (``time.time()``; the bench's fault → next step)."""

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: bytes | str) -> Fault:
        return cls(**json.loads(text))


def exit_code_of(exc: BaseException) -> int:
    """The exit code a worker ends with for ``exc``: a kubetitan error's own (``kubetitan_trainer.errors``: its
    ``exit_code``), ``Hang`` for a collective timeout, else FAILED."""
    own = getattr(exc, "exit_code", None)
    if isinstance(exc, Exception) and isinstance(own, int) and not isinstance(exc, GangGaveUp):
        return int(own)
    return int(ExitCode.HANG if COLLECTIVE_TIMEOUT.search(str(exc)) else ExitCode.FAILED)


def classify(exc: BaseException, *, rank: int, generation: int, step: int) -> Fault:
    """``exc`` as a fault, through the causes table (its exit code, then what its text says: an Xid is GPUXidError)."""
    code = exit_code_of(exc)
    text = f"{type(exc).__name__}: {exc}"
    found = causes.worker_cause(code, text)
    return Fault(rank=rank, generation=generation, step=step, cause=found.cause.id, seen=text[:500],
                 in_place=found.cause.in_place, exit_code=code, time=time.time())


@dataclass(frozen=True)
class Decision:
    retry: bool
    reason: str
    exit_code: int = int(ExitCode.OK)


def decide(primary: Fault, faults: Sequence[Fault], previous: Fault | None, restarts: int,
           max_restarts: int) -> Decision:
    """Retry in-process, or give up (pure; every rank applies it to the same records).

    ``primary`` is the iteration's first fault, ``faults`` every rank's own record, ``previous`` the primary fault
    of the iteration before (None for the first), ``restarts`` the in-process restarts done so far."""
    for f in (primary, *faults):
        if not f.in_place:
            return Decision(False, f"rank {f.rank}: cause {f.cause} is not restarted in place ({f.seen})", f.exit_code)
    if restarts >= max_restarts:
        return Decision(False, f"in-process restarts used up ({max_restarts}); last: rank {primary.rank} "
                               f"{primary.cause} at step {primary.step}", primary.exit_code)
    if previous is not None and (previous.rank, previous.cause, previous.step) == (primary.rank, primary.cause,
                                                                                   primary.step):
        return Decision(False, f"the same fault repeated: rank {primary.rank} {primary.cause} at step "
                               f"{primary.step} ({primary.seen})", primary.exit_code)
    return Decision(True, f"rank {primary.rank} {primary.cause} at step {primary.step}: restarting in-process")


def kept_state(tokens: Sequence[str], world_size: int) -> str | None:
    """The state every rank kept through the fault (pure): the ranks' common word when all ``world_size`` of them
    wrote the same non-empty one, else None (some rank's optimizer step had begun, or the ranks hold different
    steps): the body loads a saved state."""
    if len(tokens) != world_size or len(set(tokens)) != 1 or not tokens[0]:
        return None
    return tokens[0]


@dataclass
class StepState:
    """What a rank's model and optimizer hold between two steps, for a restart that keeps them: ``step`` is the
    last step whose optimizer step ended (-1: not known whole, e.g. from the moment the next one's optimizer step
    begins until the step after it starts), ``batches`` the microbatches the step after it has drawn so far, which
    that step trains again after the restart."""

    step: int = -1
    batches: list = field(default_factory=list)

    def begin(self, last_whole_step: int, again: bool = False) -> None:
        """A step begins: the state is that of ``last_whole_step``; no microbatch is drawn yet, unless the step
        begins ``again`` after a restart that kept the state (its microbatches are the ones it trains again)."""
        self.step = last_whole_step
        if not again:
            self.batches = []

    def spoil(self, *_args: Any) -> None:
        """The state is no longer a whole step's (an optimizer step began; a step pre-hook's signature)."""
        self.step = -1

    def token(self) -> str:
        return f"step {self.step}" if self.step >= 0 else ""


# --------------------------------------------------------------------------------------------------- injection
_fired: set[str] = set()


def inject(rank: int, step: int, loss: Any = None) -> Any:
    """Test-only: the fault ``KUBETITAN_TEST_FAULT`` asks for at (``rank``, ``step``), else nothing (several faults:
    comma-separated). Returns ``loss`` (NaN for ``nan``)."""
    for spec, kind in _faults(rank, step):
        if kind != "raise-in-backward" and (spec not in _fired or kind == "raise-always"):  # that one: below
            _fired.add(spec)
            return _fire(kind, rank, step, loss)
    return loss


def _faults(rank: int, step: int) -> list[tuple[str, str]]:
    """The faults ``KUBETITAN_TEST_FAULT`` asks for at (``rank``, ``step``): (spec, kind) each."""
    out = []
    for spec in [x for x in os.environ.get(ENV_TEST_FAULT, "").split(",") if x]:
        r, s, kind = spec.split(":", 2)
        if (int(r), int(s)) == (rank, step):
            out.append((spec, kind))
    return out


def inject_into_backward(model: Any, rank: int, step: int) -> Any:
    """Test-only: for ``<rank>:<step>:raise-in-backward`` (once per process), a backward pre-hook on the middle
    block of ``model.layers`` that raises; the hook's handle (the caller removes it after the step), else None."""
    for spec, kind in _faults(rank, step):
        if kind == "raise-in-backward" and spec not in _fired:
            _fired.add(spec)
            blocks = list(model.layers.values() if hasattr(model.layers, "values") else model.layers)

            def fault(*_args: Any) -> None:
                _fire("raise", rank, step, None)

            return blocks[len(blocks) // 2].register_full_backward_pre_hook(fault)
    return None


def _fire(kind: str, rank: int, step: int, loss: Any) -> Any:
    log.warning("Injected fault %r at rank %d step %d (%s)", kind, rank, step, ENV_TEST_FAULT)
    if kind in ("raise", "raise-always"):
        raise RuntimeError(f"injected fault at rank {rank} step {step}")
    if kind == "config":
        raise errors.ConfigError(ENV_TEST_FAULT, f"injected configuration error at rank {rank} step {step}",
                                 "unset it")
    if kind == "hang":
        time.sleep(3600)  # interruptible: the monitor's signal ends it
    if kind == "nan":
        return loss * float("nan")
    return loss


def launcher_store_factory(timeout: float = 60.0) -> Callable[[], Any]:
    """New clients of the store the worker's process group was made with (``MASTER_ADDR``/``MASTER_PORT``: the
    launcher's agent store, or rank 0's), under a prefix of this worker generation (the launcher's in-place restarts,
    ``ENV_RESTART_GENERATION``): keys of an earlier generation's processes are never read."""
    import torch.distributed as dist

    from kubetitan_core import contract

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    prefix = f"kubetitan/inprocess/{os.environ.get(contract.ENV_RESTART_GENERATION, '0') or '0'}"

    def connect() -> Any:
        return dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False,
                                                      timeout=timedelta(seconds=timeout)))

    return connect


def _first_line(e: BaseException) -> str:
    """An exception's type and first line (gloo's and the store's messages run to several lines)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


# --------------------------------------------------------------------------------------------------- the restarter
class InProcessRestart:
    """Runs ``body(iteration)`` and restarts it in this process after a restartable fault on any rank (see the
    module docstring). ``store_factory`` returns a new client of the store the ranks share (one for the main
    thread, one for the monitor)."""

    def __init__(self, store_factory: Callable[[], Any], rank: int, world_size: int, *, backend: str = "gloo",
                 collective_timeout: float = 60.0, barrier_timeout: float = 60.0, max_restarts: int = 3,
                 poll_seconds: float = 0.02, progress_timeout: float | None = None,
                 before_teardown: Callable[[], None] | None = None, state_token: Callable[[], str] | None = None):
        self.store_factory = store_factory
        self.store = store_factory()
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.collective_timeout, self.barrier_timeout = collective_timeout, barrier_timeout
        self.max_restarts, self.poll_seconds = max_restarts, poll_seconds
        self.progress_timeout = progress_timeout
        """Seconds without a new ``step`` after which this rank's monitor reports a ``Hang`` itself (None: off; the
        collective timeout is then the hang detector). NCCL needs it: a host waiting on a stuck kernel never sees
        the collective's timeout unless the communicator is aborted, which the report does. Armed once the first
        step of an iteration has ended: that step compiles (minutes for a large model with a cold cache) and sets
        up the NCCL communicators, and only the collective timeout bounds it."""
        self.before_teardown = before_teardown
        """Called on each rank after a fault, before its process groups are torn down (the trainer lets an
        in-flight checkpoint write, whose collectives run on a group of their own, end first)."""
        self.state_token = state_token
        """The body's word for the state this rank holds, read after a fault (see :func:`kept_state`; None: never
        kept)."""
        self.kept: str | None = None
        """The state every rank kept through the last fault (:func:`kept_state`), for the iteration it restarts;
        None: the body loads a saved state."""
        self.generation = 0
        self.restarts = 0
        self.step = -1
        """The step the body is in (it sets it: the fault's step)."""
        self.previous: Fault | None = None
        self.recoveries: list[dict[str, float | int | str]] = []
        """One record per in-process restart: wall-clock times of the fault and of each phase on this rank."""
        self._in_body = False
        self._lock = threading.Lock()
        self._untimed = 0
        """Phases inside :meth:`untimed` now (the progress timeout waits while it is above 0)."""

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """A phase of a step the progress timeout does not time (a checkpoint save, the wait for its staging):
        bounded by its own timeouts, and seconds to minutes long on large models. The step's clock starts again
        when the phase ends."""
        with self._lock:
            self._untimed += 1
        try:
            yield
        finally:
            with self._lock:
                self._untimed -= 1

    # --- process group
    def init_process_group(self) -> None:
        """This iteration's process group: same ranks, store prefix ``pg/<iteration>``."""
        import torch.distributed as dist

        prefixed = dist.PrefixStore(f"pg/{self.generation}", self.store)
        dist.init_process_group(self.backend, store=prefixed, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.collective_timeout))

    def _abort_process_group(self) -> None:
        """Tear the process group down: NCCL's communicators aborted first (a hung kernel returns), then destroyed."""
        import torch.distributed as dist

        from kubetitan_trainer import compat

        if not dist.is_initialized():
            return
        if self.backend == "nccl":
            compat.abort_process_group()  # aborts and clears the world: destroy would wait for a stuck collective
        else:
            dist.destroy_process_group()

    # --- the loop
    def run(self, body: Callable[[int], T], *, process_group_ready: bool = False) -> T:
        """``body(iteration)`` until it returns on every rank; raises :class:`GangGaveUp` when the gang stops
        restarting. ``process_group_ready``: iteration 0's default process group exists already."""
        old = signal.signal(INTERRUPT_SIGNAL, self._on_signal)
        try:
            while True:
                if not (process_group_ready and self.generation == 0):
                    try:
                        self.init_process_group()
                    except RuntimeError as e:  # gloo's connectFullMesh, the store: a peer gone or going
                        raise GangGaveUp(ExitCode.FAILED, f"in-process restart: making iteration {self.generation}'s "
                                         f"process group failed ({_first_line(e)}); exiting for the launcher's "
                                         "restart") from e
                    self._mark("pg_ready")
                try:
                    result = self._run_once(body)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:  # noqa: BLE001 - every fault of the body, RestartInterrupt included
                    self._recover(e)
                    continue
                return result
        finally:
            signal.signal(INTERRUPT_SIGNAL, old)

    def _run_once(self, body: Callable[[int], T]) -> T:
        stop = threading.Event()
        monitor = threading.Thread(target=self._monitor, args=(self.generation, stop), daemon=True,
                                   name=f"kubetitan-inprocess-monitor-{self.generation}")
        with self._lock:
            self._in_body = True
        self.step = -1  # the body sets it at each step; the fault's step is recorded already
        monitor.start()
        try:
            result = body(self.generation)
            self._completion_barrier()
            return result
        finally:
            with self._lock:
                self._in_body = False
            stop.set()
            monitor.join()

    def _completion_barrier(self) -> None:
        """Wait until every rank finished the body, or another one faulted (then: RestartInterrupt)."""
        g = self.generation
        self.store.add(f"done/{g}", 1)
        deadline = time.monotonic() + self.barrier_timeout
        while int(self.store.add(f"done/{g}", 0)) < self.world_size:
            if self.store.check([f"fault/{g}"]):
                raise RestartInterrupt(f"another rank faulted in iteration {g} after this one finished")
            if time.monotonic() > deadline:
                raise GangGaveUp(ExitCode.HANG, f"not every rank finished within {self.barrier_timeout:.0f} s")
            time.sleep(self.poll_seconds)

    # --- fault → interrupt
    def _monitor(self, g: int, stop: threading.Event) -> None:
        store = self.store_factory()
        key = f"fault/{g}"
        seen, since, steps_begun = self.step, time.monotonic(), 0
        while not stop.wait(self.poll_seconds):
            if self.step != seen:
                seen, since, steps_begun = self.step, time.monotonic(), steps_begun + 1
            elif self._untimed:
                since = time.monotonic()
            elif (self.progress_timeout is not None and steps_begun >= 2  # the iteration's first step has ended
                  and time.monotonic() - since > self.progress_timeout):
                stalled = TimeoutError(f"step {seen} made no progress for {self.progress_timeout:.0f} s "
                                       "(in-process progress timeout)")
                f = classify(stalled, rank=self.rank, generation=g, step=seen)
                log.error("Rank %d: %s", self.rank, f.seen)
                store.set(f"fault/{g}/rank/{self.rank}", f.dumps())
                store.compare_set(key, "", f.dumps())
            if store.check([key]):
                self._interrupt(g)
                return

    def _interrupt(self, g: int) -> None:
        with self._lock:
            if not self._in_body or self.generation != g:
                return
            if self.backend == "nccl":  # a collective stuck on the GPU returns (with an error) once aborted
                from kubetitan_trainer import compat

                compat.abort_process_group(keep_bookkeeping=True)
            signal.pthread_kill(threading.main_thread().ident, INTERRUPT_SIGNAL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._in_body:  # the main thread reads it: no race with the body's end
            self._in_body = False  # one interrupt per iteration
            raise RestartInterrupt(f"another rank faulted in iteration {self.generation}")

    # --- recovery
    def _mark(self, phase: str) -> None:
        if self.recoveries and self.recoveries[-1].get("generation") == self.generation:
            self.recoveries[-1].setdefault(phase, time.time())

    def mark(self, phase: str) -> None:
        """The body's own phase of the current recovery (``state_loaded``, ``first_step``): its wall-clock time."""
        self._mark(phase)

    def _recover(self, exc: BaseException) -> None:
        g, caught = self.generation, time.time()
        token = self.state_token() if self.state_token is not None else ""
        own = None if isinstance(exc, (RestartInterrupt, GangGaveUp)) else classify(
            exc, rank=self.rank, generation=g, step=self.step)
        if own is not None:
            log.warning("Rank %d faulted in iteration %d at step %d: %s (cause %s)", self.rank, g, self.step,
                        own.seen, own.cause)
            self.store.set(f"fault/{g}/rank/{self.rank}", own.dumps())
            self.store.compare_set(f"fault/{g}", "", own.dumps())  # the first fault wins
        elif isinstance(exc, GangGaveUp):
            raise exc
        if self.before_teardown is not None:
            self.before_teardown()
        self._abort_process_group()
        torn = time.time()
        try:
            self.store.set(f"state/{g}/rank/{self.rank}", token)
            self._barrier(g)
            primary = Fault.loads(self.store.get(f"fault/{g}"))
            faults = [Fault.loads(self.store.get(f"fault/{g}/rank/{r}")) for r in range(self.world_size)
                      if self.store.check([f"fault/{g}/rank/{r}"])]
            tokens = [self.store.get(f"state/{g}/rank/{r}").decode() for r in range(self.world_size)]
        except RuntimeError as e:  # torch's store errors (DistNetworkError, DistStoreError) are RuntimeErrors
            raise GangGaveUp(ExitCode.FAILED, f"in-process restart: the ranks' store failed during the restart "
                             f"({_first_line(e)}): another rank has left; exiting for the launcher's restart") from e
        d = decide(primary, faults, self.previous, self.restarts, self.max_restarts)
        self.previous = primary
        if not d.retry:
            log.error("In-process restart given up: %s; exiting with code %d", d.reason, d.exit_code)
            raise GangGaveUp(own.exit_code if own is not None and not own.in_place else d.exit_code, d.reason) from exc
        self.kept = kept_state(tokens, self.world_size)
        log.warning("In-process restart %d: %s (%s)", self.restarts + 1, d.reason,
                    f"every rank kept the state of {self.kept}" if self.kept else
                    f"the state is loaded: the ranks hold {', '.join(t or 'no whole step' for t in tokens)}")
        self.restarts += 1
        self.generation = g + 1
        self.recoveries.append({"generation": self.generation, "fault_rank": primary.rank, "cause": primary.cause,
                                "fault_step": primary.step, "fault": primary.time, "caught": caught,
                                "torn_down": torn, "agreed": time.time(), "kept": self.kept or ""})

    def _barrier(self, g: int) -> None:
        """Every rank has torn iteration ``g`` down (and written its fault) before anyone reads the records."""
        key = f"barrier/{g}"
        self.store.add(key, 1)
        deadline = time.monotonic() + self.barrier_timeout
        while (n := int(self.store.add(key, 0))) < self.world_size:
            if time.monotonic() > deadline:
                raise GangGaveUp(ExitCode.HANG, f"only {n} of {self.world_size} ranks reached the in-process restart "
                                                f"barrier within {self.barrier_timeout:.0f} s (a rank is stuck where "
                                                "no interrupt reaches it): exiting for the launcher's restart")
            time.sleep(self.poll_seconds)
