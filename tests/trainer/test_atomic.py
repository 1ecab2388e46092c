"""Atomic writes, one way in the trainer (``kubetitan_trainer.atomic``): a reader sees the old file or the whole new
one, a failed write leaves neither a half file nor a temporary one, and no other trainer module renames a file it
wrote over another (a static scan: pure ``ast``, well under a second)."""

from __future__ import annotations

import ast
import errno
import json
import os
import threading

import pytest

from kubetitan_trainer import atomic
from support.paths import REPO
from support.pyparse import parse_file

TRAINER = REPO / "trainer" / "kubetitan_trainer"

STREAMED = {
    ("data/shards.py", "ShardWriter.close"): "a shard's three files, streamed to their temporary names while written",
    ("data/s3shards.py", "Stager._stage_locked.one"): "a file staged from S3 in ranged parts, then CRC-checked",
    ("data/downloads.py", "fetch_once"): "the files a hub download wrote, moved in one by one",
}
"""Renames of files that were streamed or fetched to a temporary name (not written from bytes in memory): these
keep their own rename. Everything written whole goes through ``atomic``."""


def test_a_write_replaces_the_file_whole_and_a_failed_one_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    atomic.write_json(path, {"step": 1})
    atomic.write_json(path, {"step": 2}, fsync=False)
    assert json.loads(path.read_text()) == {"step": 2}

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic.write_text(path, '{"step": 3}')
    assert json.loads(path.read_text()) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_concurrent_writers_of_one_file_never_share_a_temporary_file(tmp_path):
    path, names = tmp_path / "f", []
    t = threading.Thread(target=lambda: names.append(atomic.temporary(path)))
    t.start()
    t.join()
    names.append(atomic.temporary(path))
    assert len(set(names)) == 2 and all(n.parent == tmp_path and n.name.startswith(".f.") for n in names)


def _renames(path) -> list[tuple[str, int]]:
    """(qualified function, line) of every ``os.replace``/``os.rename`` call, and of every ``.replace``/``.rename``
    call with one argument (``Path.replace(target)``; not ``dataclasses.replace``), in the module."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and \
                    child.func.attr in ("replace", "rename"):
                owner = child.func.value.id if isinstance(child.func.value, ast.Name) else ""
                if owner == "os" or (owner != "dataclasses" and len(child.args) == 1 and not child.keywords):
                    found.append((".".join(scope), child.lineno))
            visit(child, scope)

    visit(parse_file(path), [])
    return found


def test_no_trainer_module_but_atomic_renames_a_file_it_wrote_over_another():
    found = {(p.relative_to(TRAINER).as_posix(), fn): line for p in sorted(TRAINER.rglob("*.py"))
             if p.name != "atomic.py" for fn, line in _renames(p)}
    unexpected = sorted(f"{m}:{line} ({fn})" for (m, fn), line in found.items() if (m, fn) not in STREAMED)
    assert not unexpected, ("write the file with kubetitan_trainer.atomic (write_bytes/write_text/write_json) "
                            "instead of a temporary file and a rename of your own:\n" + "\n".join(unexpected))
    gone = sorted(k for k in STREAMED if k not in found)
    assert not gone, f"no longer renamed there: remove them from STREAMED: {gone}"
