"""A small real training gang for the in-process restart tests and bench (``kubetitan_trainer.recovery.inprocess``).

``python -m support.gang --rank R --world W --port P --out DIR`` is one rank: a two-layer model and Adam, data fixed
by (step, rank), gradients all-reduced over the iteration's gloo process group, the state saved into the restore
tier (``kubetitan_trainer.recovery.restore_tier``) every ``--save-every`` steps and reloaded from it after a restart. Rank 0
hosts the TCPStore the ranks share (the launcher's store in a real run). The model and optimizer are built once per
process: a restart reloads their state in place. Each rank writes ``DIR/rank-R.json``: its pid per iteration, the
loss of every step it trained, its final parameters and its recoveries (``InProcessRestart.recoveries``); the
exit code is 0, or :class:`~kubetitan_trainer.recovery.inprocess.GangGaveUp`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path


class TrainState:
    """The step, as a ``Stateful`` the restore tier saves and loads."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def batch(step: int, rank: int, dim: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, dim, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def flat_params(model, limit: int = 100_000) -> list[float]:
    """The first ``limit`` parameters, flattened (all of them for the tests' model)."""
    import torch

    return torch.cat([q.detach().reshape(-1)[:limit] for q in model.parameters()])[:limit].cpu().tolist()


def main(argv: list[str] | None = None) -> int:  # long: one rank's whole life, read top to bottom
    p = argparse.ArgumentParser()
    for name, kind, default in (("rank", int, 0), ("world", int, 2), ("port", int, 0), ("out", str, ""),
                                ("steps", int, 8), ("save-every", int, 2), ("dim", int, 64),
                                ("timeout", float, 3.0), ("max-restarts", int, 3), ("backend", str, "gloo"),
                                ("progress-timeout", float, 0.0)):
        p.add_argument(f"--{name}", type=kind, default=default)
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    from kubetitan_trainer.recovery import inprocess, restore_tier

    torch.manual_seed(0)
    torch.set_num_threads(1)
    device = torch.device("cuda", a.rank) if a.backend == "nccl" else torch.device("cpu")  # one node
    out = Path(a.out)
    tier = out / "tier"

    def store_factory():
        return dist.PrefixStore("kubetitan/inprocess/0", dist.TCPStore(
            "127.0.0.1", a.port, a.world, is_master=False, timeout=timedelta(seconds=30)))

    host = dist.TCPStore("127.0.0.1", a.port, a.world, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30)) if a.rank == 0 else None
    model = torch.nn.Sequential(torch.nn.Linear(a.dim, a.dim), torch.nn.Tanh(), torch.nn.Linear(a.dim, 1)).to(device)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    train = TrainState()
    states = {"model": model, "optimizer": optim, "train_state": train}
    ip = inprocess.InProcessRestart(store_factory, a.rank, a.world, backend=a.backend, collective_timeout=a.timeout,
                                    barrier_timeout=max(10.0, 3 * a.timeout), max_restarts=a.max_restarts,
                                    progress_timeout=a.progress_timeout or None)
    report: dict = {"pid": os.getpid(), "iterations": [], "losses": {}}

    def step_once() -> float:
        s = train.step + 1
        ip.step = s
        x, y = (t.to(device) for t in batch(s, a.rank, a.dim))
        optim.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss = inprocess.inject(a.rank, s, loss)
        loss.backward()
        flat = torch.cat([q.grad.reshape(-1) for q in model.parameters()] + [loss.detach().reshape(1)])
        dist.all_reduce(flat)
        if not torch.isfinite(flat[-1]):
            from kubetitan_trainer.errors import NonFiniteLossError

            raise NonFiniteLossError(s)
        off = 0
        for q in model.parameters():
            q.grad.copy_(flat[off:off + q.numel()].view_as(q) / a.world)
            off += q.numel()
        optim.step()
        train.step = s
        return float(flat[-1]) / a.world

    def body(iteration: int) -> None:
        report["iterations"].append({"iteration": iteration, "pid": os.getpid()})
        if iteration > 0:  # the state of the newest save, in place: the model and optimizer are not rebuilt
            restore_tier.load(states, tier, rank=a.rank)
            ip.mark("state_loaded")
        elif train.step == 0:
            step_once()  # Adam's state exists after a step: the tier then holds everything a restart needs
            restore_tier.save(states, tier, step=train.step, rank=a.rank, world_size=a.world, checkpoint_folder=a.out)
        first = True
        while train.step < a.steps:
            loss = step_once()
            report["losses"][str(train.step)] = loss
            if first and iteration > 0:
                ip.mark("first_step")
            first = False
            if train.step % a.save_every == 0:
                restore_tier.save(states, tier, step=train.step, rank=a.rank, world_size=a.world,
                                  checkpoint_folder=a.out)

    code = 0
    try:
        ip.run(body)
    except inprocess.GangGaveUp as e:
        code = e.exit_code
        report["gave_up"] = str(e)
    report.update(exit_code=code, restarts=ip.restarts, recoveries=ip.recoveries, final_step=train.step,
                  params=flat_params(model))
    (out / f"rank-{a.rank}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.destroy_process_group()
    left = store_factory()
    left.add("left", 1)
    while host is not None and int(left.add("left", 0)) < a.world:  # the store outlives every rank's last read
        time.sleep(0.01)
    return code


def launch(out: Path, world: int = 2, env: dict[str, str] | None = None, wait_seconds: float = 120,
           **args: object) -> list[tuple[int, int, dict]]:
    """Run a gang of ``world`` ranks (``--name value`` from ``args``) and wait: per rank (its pid, its exit code,
    its report). Each rank is ``python -m tests.support.gang`` in the repository, forked from the tests' warm parent
    (:func:`support.warm.popen`: torch imported once per test process; cold with ``KUBETITAN_TEST_COLD_LAUNCH=1``)."""
    from kmockx.harness import free_port
    from support import warm

    out.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[2]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    port = free_port()
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in args.items()]
    procs = [warm.popen("tests.support.gang", [f"--rank={r}", f"--world={world}", f"--port={port}", f"--out={out}",
                                               *extra], full_env, out / f"rank-{r}.log", cwd=root)
             for r in range(world)]
    results = []
    try:
        for r, proc in enumerate(procs):
            code = proc.wait(timeout=wait_seconds)
            report = out / f"rank-{r}.json"
            log = out / f"rank-{r}.log"
            # no report: the rank died of something its in-process restart did not catch; its log says what
            results.append((proc.pid, code, json.loads(report.read_text()) if report.exists() else {
                "no_report": log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"}))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    return results


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())
