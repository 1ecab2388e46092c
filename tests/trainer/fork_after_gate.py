"""A CPU pod's pre-flight gate as its launcher runs it (in the process whose workers are forked after it), then a
fork whose child runs torch's parallel CPU ops, as a forked worker does: exits 0 once the child finished them (a
child hung in OpenMP after a fork is what the gate must not cause). ``no-fix`` runs the gate without its one-thread
guard. Run by tests/trainer/test_preflight.py as ``python -m tests.trainer.fork_after_gate [no-fix]``."""

import contextlib
import os
import sys

import torch

from kubetitan_trainer import preflight as pf

if sys.argv[1:] == ["no-fix"]:
    pf.TorchProbe._one_thread = lambda self: contextlib.nullcontext()
torch.set_num_threads(max(2, torch.get_num_threads()))  # several threads, as a pod's launcher has
result = pf.run(pf.Settings(), pf.TorchProbe(cuda=False), node="n")
assert not result.failed, result
pid = os.fork()
if pid == 0:
    a = torch.rand(512, 512)
    (a @ a).sum()
    (torch.rand(4_000_000) * 2).sum()
    os._exit(0)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
