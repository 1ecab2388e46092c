"""The three data sources of ``[kubetitan.data]`` and the TrainSpec's ``build_dataloader_fn``.

Every source is an ``IterableDataset`` that is also ``Stateful``; torchtitan's
``ParallelAwareDataloader`` (a torchdata ``StatefulDataLoader``) stores its state per DP rank in
the checkpoint, so a resumed attempt continues with exactly the batches an uninterrupted run
would have seen.

- ``synthetic``: random "phrases" (a fixed table of short token sequences chosen by the seed)
  strung together, generated from (seed, DP rank, sample index) alone. Deterministic, costs no I/O
  and about 0.1 ms a sample (vectorised: it must never show in a GPU step's time), and learnable
  (inside a phrase every token is predictable), so it doubles as a smoke test.
- ``shards``: flat token files written by ``kubetitan prepare-data`` (``index.json`` + ``*.bin``,
  uint16 or uint32), memory-mapped and read as one stream cut into windows of ``seq_len + 1``
  tokens; window ``k`` of DP rank ``r`` is global window ``k * dp_world_size + r``. Loops forever.
- ``huggingface``: torchtitan's ``HuggingFaceTextDataset`` machinery (as for c4), with the dataset,
  subset, split, streaming and text column taken from the config; local files and ``builtin``
  (the shipped corpus) work offline.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import JobConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset
from torchtitan.tools.logging import logger

from kubetitan_trainer import compat
from kubetitan_trainer.errors import ConfigError

ASSETS = Path(__file__).resolve().parent / "assets"
BUILTIN_CORPUS = ASSETS / "corpus.jsonl"
INDEX_FILE = "index.json"
PHRASES = 1024
PHRASE_LEN = 16
_MASK64 = (1 << 64) - 1


def _mix(*xs: int) -> int:
    """A stable 64-bit hash of integers (splitmix64), independent of PYTHONHASHSEED."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h


class _IndexedSamples(IterableDataset, Stateful):
    """A source whose sample ``i`` of a DP rank is a pure function of ``i``: the position is its whole
    state, so a resumed attempt yields exactly the batches an uninterrupted run would have.
    Subclasses define ``sample(idx) -> ndarray`` of ``seq_len + 1`` tokens."""

    _sample_idx = 0

    def _before_sample(self, idx: int) -> None:
        """Hook run before sample ``idx`` is yielded (shards warn when they loop)."""

    def __iter__(self):
        while True:
            self._before_sample(self._sample_idx)
            x = torch.from_numpy(self.sample(self._sample_idx))
            self._sample_idx += 1
            yield {"input": x[:-1]}, x[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self._sample_idx}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._sample_idx = int(state_dict["sample_idx"])


class SyntheticTokens(_IndexedSamples):
    """Deterministic learnable tokens (random phrases); sample i of DP rank r never changes."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, dp_rank: int = 0, dp_world_size: int = 1) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        rng = np.random.default_rng(_mix(seed, 0xC0FFEE))
        self._phrases = rng.integers(0, vocab_size, size=(PHRASES, PHRASE_LEN), dtype=np.int64)
        self._sample_idx = 0

    def sample(self, idx: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of this rank's sample ``idx``."""
        rng = np.random.default_rng(_mix(self.seed, self.dp_rank, idx))
        n = (self.seq_len + 1) // PHRASE_LEN + 2
        picks = rng.integers(0, PHRASES, size=n)
        offset = int(rng.integers(0, PHRASE_LEN))  # samples do not all start at a phrase boundary
        return self._phrases[picks].reshape(-1)[offset : offset + self.seq_len + 1].copy()


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """``index.json`` of a shards directory, checked; raises ConfigError naming what is wrong."""
    d = Path(path)
    idx = d / INDEX_FILE
    if not idx.is_file():
        raise ConfigError(
            "kubetitan.data.shards_path (spec.data.shards.path)",
            f"no {INDEX_FILE} in {d}",
            "point it at a directory written by `kubetitan prepare-data` (it holds index.json and *.bin)",
        )
    index = json.loads(idx.read_text())
    for f in index.get("files", []):
        if not (d / f["name"]).is_file():
            raise ConfigError(
                "kubetitan.data.shards_path (spec.data.shards.path)",
                f"{INDEX_FILE} lists {f['name']}, which is missing from {d}",
                "copy the whole directory written by `kubetitan prepare-data`",
            )
    return index


class TokenShards(_IndexedSamples):
    """Memory-mapped token shards split by DP rank; the position is saved in the checkpoint."""

    def __init__(self, path: str, seq_len: int, dp_rank: int = 0, dp_world_size: int = 1, dtype: str = "auto") -> None:
        index = read_index(path)
        file_dtype = index.get("dtype", "uint16")
        if dtype not in ("auto", file_dtype):
            raise ConfigError(
                "kubetitan.data.shards_dtype (spec.data.shards.dtype)",
                f"is {dtype} but {path}/{INDEX_FILE} says the shards hold {file_dtype}",
                f"set it to auto or {file_dtype}",
            )
        self.path, self.seq_len = path, seq_len
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self._arrays = [np.memmap(Path(path) / f["name"], dtype=np.dtype(file_dtype), mode="r") for f in index["files"]]
        self._starts = np.cumsum([0] + [len(a) for a in self._arrays])
        self.total_tokens = int(self._starts[-1])
        self.window = seq_len + 1
        self.n_windows = self.total_tokens // self.window
        self.windows_per_rank = self.n_windows // dp_world_size
        if self.windows_per_rank < 1:
            raise ConfigError(
                "kubetitan.data.shards_path (spec.data.shards.path)",
                f"{path} holds {self.total_tokens} tokens, fewer than one sequence of {self.window} per DP rank "
                f"({dp_world_size} ranks)",
                "prepare more data or lower spec.training.seqLen",
            )
        self._sample_idx = 0

    def _tokens(self, start: int, n: int) -> np.ndarray:
        out, pos = [], start
        while n > 0:
            f = int(np.searchsorted(self._starts, pos, side="right") - 1)
            off = pos - int(self._starts[f])
            take = min(n, len(self._arrays[f]) - off)
            out.append(np.asarray(self._arrays[f][off : off + take], dtype=np.int64))
            pos, n = pos + take, n - take
        return np.concatenate(out)

    def window_of(self, idx: int) -> int:
        """Global window index of this rank's sample ``idx`` (loops over the data)."""
        return (idx % self.windows_per_rank) * self.dp_world_size + self.dp_rank

    def sample(self, idx: int) -> np.ndarray:
        return self._tokens(self.window_of(idx) * self.window, self.window)

    def _before_sample(self, idx: int) -> None:
        if idx and idx % self.windows_per_rank == 0:
            logger.warning(f"Shards in {self.path} are being re-looped")


_LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}


def load_hf_dataset(dataset: str, config: str, split: str, streaming: bool):
    """``datasets.load_dataset`` for a hub name, a local directory/file, or ``builtin``."""
    from datasets import load_dataset

    if dataset == "builtin":
        dataset = str(BUILTIN_CORPUS)
    p = Path(dataset)
    if p.is_file():
        builder = _LOCAL_BUILDERS.get(p.suffix)
        if builder is None:
            raise ConfigError(
                "kubetitan.data.hf_dataset (spec.data.huggingface.dataset)",
                f"{dataset} is a file of unknown type",
                f"use a {', '.join(_LOCAL_BUILDERS)} file, a directory, or a hub dataset name",
            )
        return load_dataset(builder, data_files={split: str(p)}, split=split, streaming=streaming)
    if dataset.startswith("/") and not p.exists():
        raise ConfigError(
            "kubetitan.data.hf_dataset (spec.data.huggingface.dataset)",
            f"the local path {dataset} does not exist",
            "mount the volume that holds it (spec.data.volume) or fix the path",
        )
    return load_dataset(dataset, name=config or None, split=split, streaming=streaming)


class KubetitanHFTextDataset(HuggingFaceTextDataset):
    """torchtitan's HuggingFaceTextDataset (iteration, packing, state) with a configurable source.

    The base ``__init__`` only accepts datasets from torchtitan's fixed registry, so this one sets
    the same attributes from ``[kubetitan.data]`` instead (``compat.init_hf_text_dataset``); everything else
    is inherited.
    """

    def __init__(self, cfg, tokenizer: BaseTokenizer, seq_len: int, dp_rank: int, dp_world_size: int, infinite: bool = True) -> None:
        from datasets.distributed import split_dataset_by_node

        ds = load_hf_dataset(cfg.hf_dataset, cfg.hf_config, cfg.hf_split, cfg.hf_streaming)
        field = cfg.hf_text_field
        compat.init_hf_text_dataset(self, dataset_name=cfg.hf_dataset, data=split_dataset_by_node(ds, dp_rank, dp_world_size),
                                    tokenizer=tokenizer, seq_len=seq_len, infinite=infinite,
                                    text_processor=lambda sample: sample[field])


def model_vocab_size(job_config: JobConfig) -> int:
    from kubetitan_trainer.train_spec import model_args_for

    return model_args_for(job_config).vocab_size


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer | None, job_config: JobConfig,
                     infinite: bool = True) -> ParallelAwareDataloader:
    """TrainSpec ``build_dataloader_fn``: the configured source in torchtitan's DP-aware loader."""
    cfg = job_config.kubetitan.data
    seq_len = job_config.training.seq_len
    if cfg.source == "synthetic":
        seed = job_config.debug.seed if job_config.debug.seed is not None else 0
        ds: IterableDataset = SyntheticTokens(model_vocab_size(job_config), seq_len, seed, dp_rank, dp_world_size)
    elif cfg.source == "shards":
        ds = TokenShards(cfg.shards_path, seq_len, dp_rank, dp_world_size, cfg.shards_dtype)
    elif cfg.source == "huggingface":
        assert tokenizer is not None
        ds = KubetitanHFTextDataset(cfg, tokenizer, seq_len, dp_rank, dp_world_size, infinite)
    else:
        raise ConfigError("kubetitan.data.source (spec.data.source)", f"unknown source {cfg.source!r}",
                          "use synthetic, shards or huggingface")
    kwargs = {**asdict(job_config.training.dataloader), "batch_size": job_config.training.local_batch_size}
    return ParallelAwareDataloader(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)
