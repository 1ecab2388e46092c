"""Helpers for the chart tests: the real helm binary (PATH or the repo's .tools/bin)."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support import yamlio

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubetitan"
RELEASE, NAMESPACE = "kt", "kubetitan-system"

# The matrix the issue asks for: (id, values files, --set flags).
MATRIX = [
    ("defaults", [], []),
    ("namespaced", [], ["watch.mode=namespaced", "watch.namespaces={ml,research}"]),
    ("namespaced-release-ns", [], ["watch.mode=namespaced", "replicaCount=1"]),
    ("monitoring", [], ["monitoring.serviceMonitor.enabled=true", "monitoring.podMonitor.enabled=true",
                        "monitoring.rules.enabled=true", "monitoring.dashboards.enabled=true"]),
    ("eks-p5", ["values-eks-p5.yaml"], []),
    ("hyperpod", ["values-hyperpod.yaml"], []),
]
MATRIX_IDS = [m[0] for m in MATRIX]


def helm_binary() -> str:
    found = shutil.which("helm") or str(REPO / ".tools" / "bin" / "helm")
    if not os.access(found, os.X_OK):
        pytest.fail("helm not found on PATH or in .tools/bin: run `make tools`")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HELM_CACHE_HOME": "/tmp/kubetitan-helm-cache",
                               "HELM_CONFIG_HOME": "/tmp/kubetitan-helm-config"})
    if check and proc.returncode:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def values_args(files: list[str], sets: list[str]) -> list[str]:
    out: list[str] = []
    for f in files:
        out += ["-f", str(CHART / f)]
    for s in sets:  # "str:key=value" sets a string (helm --set-string)
        out += ["--set-string", s[4:]] if s.startswith("str:") else ["--set", s]
    return out


def render(files: list[str] = (), sets: list[str] = (), include_crds: bool = True) -> list[dict[str, Any]]:
    """Rendered objects (a fresh copy of a cached rendering: tests may modify it)."""
    return copy.deepcopy(_render(tuple(files), tuple(sets), include_crds))


@functools.lru_cache(maxsize=None)
def _render(files: tuple[str, ...], sets: tuple[str, ...], include_crds: bool) -> list[dict[str, Any]]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args(list(files), list(sets))]
    if include_crds:
        args.append("--include-crds")
    return [d for d in yamlio.load_all(helm(*args).stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]
