"""The TrainSpec's ``build_tokenizer_fn``: builtin, a local path, or a hub repository.

A hub repository is downloaded once per pod, with retries (:mod:`kubetitan_trainer.data.downloads`)."""

from __future__ import annotations

import os
from pathlib import Path

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

from kubetitan_trainer import BUILTIN_TOKENIZER
from kubetitan_trainer.checks import vocab_error
from kubetitan_trainer.data.shards import TokenizerIdentity, tokenizer_identity
from kubetitan_trainer.errors import ConfigError

_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def tokenizer_dir(job_config: JobConfig) -> str:
    """The directory holding ``tokenizer.json`` for the configured source (downloads for `huggingface`)."""
    t = job_config.kubetitan.tokenizer
    if t.source == "builtin":
        return str(BUILTIN_TOKENIZER)
    if t.source == "path":
        if not t.path or not (Path(t.path) / "tokenizer.json").is_file():
            raise ConfigError(
                "kubetitan.tokenizer.path (spec.tokenizer.path)",
                f"no tokenizer.json in {t.path or '(unset)'}",
                "point it at a directory holding tokenizer.json inside the image or a mounted volume",
            )
        return t.path
    if t.source == "huggingface":
        if not t.repo:
            raise ConfigError("kubetitan.tokenizer.repo (spec.tokenizer.repo)", "is empty",
                              "set it to a hub repository such as meta-llama/Meta-Llama-3.1-8B")
        from kubetitan_trainer.data import downloads

        dest = hub_tokenizer_dir(job_config)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        what = f"Downloading the tokenizer of {t.repo} to {dest}"
        if local_rank == 0:
            logger.info(what)
        fetch = downloads.hub_snapshot(t.repo, _FILES, os.environ.get("HF_TOKEN"), log=logger.warning)
        downloads.fetch_once(dest, fetch, local_rank=local_rank, what=what, log=logger.info)
        if not (Path(dest) / "tokenizer.json").is_file():
            raise ConfigError("kubetitan.tokenizer.repo (spec.tokenizer.repo)", f"{t.repo} has no tokenizer.json",
                              "use a repository that ships a tokenizer.json (a Hugging Face fast tokenizer)")
        return dest
    raise ConfigError("kubetitan.tokenizer.source (spec.tokenizer.source)", f"unknown source {t.source!r}",
                      "use builtin, path or huggingface")


def hub_tokenizer_dir(job_config: JobConfig) -> str:
    """Where a ``huggingface`` tokenizer is downloaded to (``<dump_folder>/tokenizer/<org>--<name>``)."""
    return os.path.join(job_config.job.dump_folder, "tokenizer", job_config.kubetitan.tokenizer.repo.replace("/", "--"))


def run_tokenizer_identity(job_config: JobConfig) -> TokenizerIdentity | None:
    """The run's tokenizer (spec.tokenizer) as a shards index records one (``shards.TokenizerIdentity``: the sha256
    of its tokenizer.json); None while it is not on disk (a hub tokenizer before ``build_tokenizer`` downloaded it)."""
    t = job_config.kubetitan.tokenizer
    if t.source == "builtin":
        return tokenizer_identity(BUILTIN_TOKENIZER, "builtin")
    if t.source == "path" and t.path:
        return tokenizer_identity(t.path, str(Path(t.path).resolve()))
    if t.source == "huggingface" and t.repo:
        return tokenizer_identity(hub_tokenizer_dir(job_config), t.repo)
    return None


def build_tokenizer(job_config: JobConfig) -> HuggingFaceTokenizer:
    """TrainSpec ``build_tokenizer_fn``; checks the model's vocabulary can hold every token id (rule
    tokenizer.vocab, the same check ``checks`` runs before training for a tokenizer already in the pod)."""
    tok = HuggingFaceTokenizer(tokenizer_dir(job_config))
    if (e := vocab_error(job_config, tok.get_vocab_size())) is not None:
        raise e
    return tok
