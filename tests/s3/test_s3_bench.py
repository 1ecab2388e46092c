"""bench/s3_bench.py goes on past a failed save: DCP's CheckpointException (a BaseException) is one line, not the end
of the bench with every rank's traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kmockx.harness import free_port  # the tests' one port allocator

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/s3_bench.py

pytestmark = [pytest.mark.timeout(300)]


def test_a_save_that_fails_is_one_line_and_the_bench_goes_on(s3_env):
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    import s3_bench
    from kubetitan_trainer import storage

    assert not issubclass(CheckpointException, Exception)  # what an `except Exception` let through
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every request is refused
    store = storage.S3Store(storage.S3Settings(uri="s3://bench/down", endpoint=down, force_path_style=True,
                                               max_attempts=1))
    target = s3_bench.Target("s3-down", store.root, store)
    lines: list[str] = []
    got = s3_bench.attempt("s3-down    save", lambda: s3_bench.timed_save(target, {"w": torch.ones(4)}, "x"),
                           lines.append)
    assert got is None and len(lines) == 1, lines
    assert lines[0].startswith("s3-down    save FAILED: S3Exception: ") and "\n" not in lines[0], lines
    assert s3_bench.attempt("fine", lambda: 1.5, lines.append) == 1.5 and len(lines) == 1
    with pytest.raises(KeyboardInterrupt):
        s3_bench.attempt("interrupted", lambda: (_ for _ in ()).throw(KeyboardInterrupt()), lines.append)
