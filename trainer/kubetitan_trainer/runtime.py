"""The worker's ``[kubetitan.runtime]`` table: tuning of the recovery and compile internals (``spec.runtime``).

Every worker process reads it from its ``trainer.toml`` once, as it starts (:func:`load`, before the early CUDA
context and before torchtitan parses the file), and the recovery and compile modules ask :func:`settings`: the
restore tier's read mode and threads, the deferred optimizer load, the arena's writes, the early CUDA context, the
ahead-of-time compile. A value the table's type does not allow (a hand-written file; the operator's are validated)
is warned about, naming the key, and its default used. Torch-free."""

from __future__ import annotations

import dataclasses
import logging
import tomllib
import typing

from kubetitan_core.contract.trainer_toml import KubetitanRuntime, from_table

log = logging.getLogger("kubetitan.runtime")

CURRENT = KubetitanRuntime()
"""This process's settings (the defaults until :func:`load` or :func:`use`)."""


def settings() -> KubetitanRuntime:
    return CURRENT


def use(s: KubetitanRuntime) -> KubetitanRuntime:
    """Make ``s`` this process's settings; returns it."""
    global CURRENT
    CURRENT = s
    return s


def checked(s: KubetitanRuntime) -> KubetitanRuntime:
    """``s`` with every value its field's type does not allow (a choice not among the choices, a number below 0 or
    not a whole number, a flag not a boolean) replaced by the default, each warned about."""
    hints = typing.get_type_hints(KubetitanRuntime)
    fixes = {}
    for f in dataclasses.fields(KubetitanRuntime):
        value, kind, default = getattr(s, f.name), hints[f.name], f.default
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
        ok = (value in choices if choices else
              isinstance(value, bool) if kind is bool else
              isinstance(value, int) and not isinstance(value, bool) and value >= 0)
        if not ok:
            allowed = f"one of {', '.join(map(repr, choices))}" if choices else \
                "true or false" if kind is bool else "a whole number, 0 or more"
            log.warning("[kubetitan.runtime] %s = %r is not %s; using %r", f.name, value, allowed, default)
            fixes[f.name] = default
    return dataclasses.replace(s, **fixes) if fixes else s


def read(path: str) -> KubetitanRuntime:
    """The ``[kubetitan.runtime]`` table of the TOML file ``path`` (the defaults for a missing table or key); raises
    OSError, ``tomllib.TOMLDecodeError`` or ValueError (an unknown key) for a file that cannot be read."""
    with open(path, "rb") as f:
        table = tomllib.load(f).get("kubetitan", {}).get("runtime", {})
    return checked(from_table(KubetitanRuntime, table))


def config_file(argv: list[str]) -> str | None:
    """The ``--job.config_file`` of torchtitan's arguments (either spelling, ``--x v`` or ``--x=v``)."""
    for i, arg in enumerate(argv):
        for flag in ("--job.config_file", "--job.config-file"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1:]
    return None


def load(argv: list[str]) -> KubetitanRuntime:
    """Read the settings of the config file named in ``argv`` into this process (:func:`use`). A file that cannot be
    read leaves the defaults: the config check that follows reports it (exit code 2)."""
    path = config_file(argv)
    if path is None:
        return use(KubetitanRuntime())
    try:
        return use(read(path))
    except (OSError, tomllib.TOMLDecodeError, ValueError, TypeError) as e:
        log.debug("[kubetitan.runtime] not read from %s (%s); the config check reports it", path, e)
        return use(KubetitanRuntime())
