"""``ast.parse`` for the static checks, safe from CPython 3.11's re-entry bug.

CPython 3.11 keeps ``ast.parse``'s recursion-depth counter in interpreter-wide state. When a cyclic garbage
collection runs in the middle of building the tree and collects something whose finaliser reports an error
(an unawaited coroutine of a closed event loop, say), pytest's unraisable-exception hook formats the traceback,
and 3.11's ``traceback`` module calls ``ast.parse`` to place its carets: the outer parse then fails with
``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905, pytest-dev/pytest#10763; CI
failed once on exactly this). Building the tree with the cyclic collector paused removes the re-entry; nothing
else changes. The collector is resumed afterwards, also when the source does not parse.
"""

from __future__ import annotations

import ast
import functools
import gc
from pathlib import Path


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)`` with the cyclic garbage collector paused while the tree is built."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename=filename)
    finally:
        if was_enabled:
            gc.enable()


@functools.cache
def parse_file(path: Path) -> ast.Module:
    """One file's tree, parsed once per test process (the checks that scan every module share it)."""
    return parse(path.read_text(), str(path))
