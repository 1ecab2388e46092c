"""A torch.compile cache that outlives pods: Inductor/AOTAutograd (``TORCHINDUCTOR_CACHE_DIR``) and Triton
(``TRITON_CACHE_DIR``) kept under the run's dump folder (the checkpoint volume), one folder per key.

The key names everything a compiled artefact depends on that the caches' own keys may not see across
machines: the torch and triton versions, the GPU model (read from ``/proc/driver/nvidia``, which needs
no CUDA initialisation, so the launcher can call this before it forks workers), and the trainer config's
``[model]``, ``[parallelism]``, ``[compile]``, ``[training]`` and ``[quantize]`` tables. Inductor's FX graph
and AOTAutograd caches write each entry to a temporary file and rename it into place, and Triton does the
same, so concurrent ranks (and pods sharing the volume) may share one folder.

Pure of torch: reads the TOML with ``tomllib`` and versions with ``importlib.metadata``. Variables the
pod's env already sets win (a user may point the cache elsewhere).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tomllib
from importlib import metadata
from pathlib import Path

KEY_TABLES = ("model", "parallelism", "compile", "training", "quantize")
SUBDIR = "compile-cache"
KEY_ENV = "KUBETITAN_COMPILE_CACHE_KEY"
"""Set by :func:`configure` to the key (also when the pod's env chose the cache folders): artefacts kept beside the
caches put it in their names (:mod:`kubetitan_trainer.compile.aot_precompile`)."""


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def gpu_models(proc_root: str = "/proc/driver/nvidia/gpus") -> list[str]:
    """GPU model names from the NVIDIA driver's proc files (no CUDA initialisation); [] without GPUs."""
    out = []
    for info in sorted(glob.glob(os.path.join(proc_root, "*", "information"))):
        for line in Path(info).read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                out.append(line.split(":", 1)[1].strip())
    return out


def cache_key(config: dict, gpus: list[str], versions: dict[str, str]) -> str:
    """A short stable hash of what a compiled artefact depends on."""
    doc = {"versions": versions, "gpus": gpus, **{t: config.get(t) for t in KEY_TABLES}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def root(env: dict | None = None) -> Path | None:
    """The cache folder of this process (``TORCHINDUCTOR_CACHE_DIR``'s parent, as :func:`configure` lays it out;
    other artefacts kept beside the caches go in its subfolders); None when the variable is unset."""
    cache = (os.environ if env is None else env).get("TORCHINDUCTOR_CACHE_DIR")
    return Path(cache).parent if cache else None


def configure(config_path: str, env: dict | None = None, gpus: list[str] | None = None) -> str | None:
    """Set the cache variables in ``env`` (default ``os.environ``) for the run of ``config_path``.

    Returns the cache folder, or None when compile is off (nothing is set then)."""
    env = os.environ if env is None else env
    with open(config_path, "rb") as f:
        config = tomllib.load(f)
    if not (config.get("compile") or {}).get("enable"):
        return None
    versions = {d: _version(d) for d in ("torch", "triton", "torchtitan", "torchao")}
    key = cache_key(config, gpu_models() if gpus is None else gpus, versions)
    folder = Path((config.get("job") or {}).get("dump_folder") or ".") / SUBDIR / key
    env[KEY_ENV] = key
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(folder / "triton"))
    # Inductor's FX graph cache and the AOTAutograd cache are on by default in torch 2.11; say so explicitly.
    env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    return str(folder)
