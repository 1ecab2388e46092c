"""Atomic file writes, the one way the trainer does them: a reader sees the old file or the whole new one.

The bytes go to a hidden temporary file beside the target (``.NAME.PID.THREAD.tmp``: concurrent writers of one
file never share it), are fsynced unless the caller says the file need not survive a crash of the node (``fsync=
False``: heartbeats, state in memory-backed folders), and the temporary file is renamed over the target. A write
that fails (a full disk) leaves the old file and no temporary file behind. Torch-free, no kubetitan imports."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def temporary(path: Path) -> Path:
    """The temporary file a write of ``path`` goes through."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def write_bytes(path: str | Path, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring)."""
    path = Path(path)
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str, *, fsync: bool = True) -> None:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    write_bytes(path, text.encode(), fsync=fsync)


def write_json(path: str | Path, obj: Any, *, fsync: bool = True, **dumps: Any) -> None:
    """:func:`write_bytes` of ``obj`` as JSON (``dumps``: :func:`json.dumps`'s options)."""
    write_bytes(path, json.dumps(obj, **dumps).encode(), fsync=fsync)
