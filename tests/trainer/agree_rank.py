"""One rank of tests/trainer/test_edge.py::test_free_space_is_agreed_across_ranks, run as ``python -m
tests.trainer.agree_rank TMP`` with ``RANK`` 0 or 1 (forked from the tests' warm parent, :func:`support.warm.popen`):
the two ranks (gloo) check the free space of their checkpoint volumes, of which only rank 1's is short, and agree
(one MAX all-reduce); each prints what it was told and exits with the error's code, or prints "saving"."""

import os
import shutil
import sys
from collections import namedtuple
from datetime import timedelta

import torch.distributed as dist

from kubetitan_trainer import trainer as T
from kubetitan_trainer.errors import StorageFullError

# A file rendezvous: no TCP port chosen in advance that another process on the machine could take meanwhile
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/rendezvous", rank=int(os.environ["RANK"]),
                        world_size=2, timeout=timedelta(seconds=120))
free = 1000 if dist.get_rank() == 1 else 10**9  # only rank 1's volume is short of the 5,500 B the save needs
shutil.disk_usage = lambda p: namedtuple("usage", "total used free")(10**9, 0, free)
try:
    T.check_free_space(sys.argv[1], 5000, T.max_across_ranks)
except StorageFullError as e:
    print(f"other_rank={e.other_rank}: {e}", flush=True)
    sys.exit(e.exit_code)
print("saving", flush=True)
