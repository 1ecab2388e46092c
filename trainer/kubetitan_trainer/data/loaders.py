"""The TrainSpec's dataloaders over the sources of ``[kubetitan.data]``: the torch-facing glue.

The global sample stream itself (sources, mixture schedule, which rank reads which samples, the position a
resume continues from) is torch-free in :mod:`kubetitan_trainer.data.stream`; here it becomes torchtitan's
dataloader (:class:`GlobalDataLoader`, whose checkpoint state is the global position), the held-out loader, the
hub-streamed sources, and the builders that read the ``[kubetitan.data]`` table.

**Held-out data.** With ``eval_samples > 0`` a held-out set is evaluated every ``[validation] freq`` steps
(:class:`KubetitanValidator`, torchtitan's own validation loop): ``eval_shards_path`` (a separate dataset), or
the last ``held_out_percent`` % of every training source's windows, which training then never reads.

``huggingface`` keeps torchtitan's ``HuggingFaceTextDataset`` machinery (tokenized on the fly, per-rank state in
``ParallelAwareDataloader``): it streams, so it has no random access to shuffle or to re-split; a resume at another
DP degree is a configuration error that says so (prepare the corpus into shards instead).
"""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader, ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import JobConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset
from torchtitan.tools.logging import logger

from kubetitan_core import contract
from kubetitan_core.weights import WeightSchedule, from_lists, step_of
from kubetitan_trainer import compat
from kubetitan_trainer.data import downloads
from kubetitan_trainer.data.shards import ShardSet
from kubetitan_trainer.errors import ConfigError, TransientError
from kubetitan_trainer.flavours import model_args_for
from kubetitan_trainer.data.stream import (SYNTHETIC_WINDOWS, seed_hash, SyntheticSource, WindowSource, MixSchedule,
                                           mix_for, Sample, GlobalStream, rank_slice)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUILTIN_CORPUS = ASSETS / "corpus.jsonl"
LEDGER_DIR = "ledger"
"""Under ``<dump_folder>/kubetitan/``: with ``[kubetitan.data] ledger = true`` each rank appends the global samples
it trains to ``rank-<r>.txt``, one line ``step position source window epoch`` per sample."""
SOURCE_KEY = "kubetitan_sources"
"""Input-dict key of each sample's source index (a mixture's per-source losses); popped before the model sees it."""
SEGMENT_KEY = "kubetitan_segments"
"""Input-dict key of each input token's document within its sample (``attention_mask = "document"``), read by the
model's attention masks (:mod:`kubetitan_trainer.doc_mask`)."""
_STATE_KEY = "kubetitan_global_position"
_RANK_STATE_KEY = "kubetitan_stream_position_dp_rank_{}"
"""A mixture's streamed sources' positions on one rank (pickled ``HuggingFaceTextDataset`` states, by source)."""
_RANK_DEGREE_KEY = "kubetitan_stream_dp_degree"


def open_shards(path: str, field: str, dtype: str = "auto", vocab_size: int | None = None,
                job_config: JobConfig | None = None) -> ShardSet:
    """The checked shards at ``path`` (:class:`~kubetitan_trainer.data.shards.ShardSet`: sizes at open; every read's bytes
    against their CRC-32s before use, each chunk once, and its ids against the model's vocabulary; with
    ``job_config``, the index's tokenizer against the run's); a bad directory is a ConfigError naming ``field``, the
    file and the fix.
    ``s3://bucket/prefix`` is first staged to node-local disk with every CRC-32 verified
    (:mod:`kubetitan_trainer.data.s3shards`, settings from ``job_config``'s ``[kubetitan.data_s3]``)."""
    tokenizer = None
    if job_config is not None:
        from kubetitan_trainer.data.s3shards import local_path
        from kubetitan_trainer.data.tokenizer import run_tokenizer_identity

        path = local_path(path, job_config, field)
        tokenizer = run_tokenizer_identity(job_config)
    return ShardSet.open(path, vocab_size=vocab_size, verify="lazy", dtype=dtype, field_name=field,
                         tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------------- dataloader
class GlobalDataLoader(BaseDataLoader):
    """A dataloader over a :class:`GlobalStream` whose checkpoint state is global (the same on every rank).

    Each micro-batch takes the next ``W*b`` samples of the stream on every rank (cheap: the schedule and the
    permutation lookups, no I/O) and reads the tokens of this rank's ``b`` of them. The state is the stream's
    position after the last micro-batch yielded; torchtitan saves it at step boundaries, where every rank has
    yielded the same micro-batches."""

    def __init__(self, stream: GlobalStream, *, dp_rank: int, dp_world_size: int, local_batch: int,
                 on_batch: Callable[[list[Sample]], None] | None = None, tag_sources: bool = False,
                 segments: bool = False) -> None:
        self.stream, self.dp_rank, self.dp_world_size, self.local_batch = stream, dp_rank, dp_world_size, local_batch
        self.on_batch = on_batch
        self.tag_sources, self.segments = tag_sources, segments
        """Also yield each sample's source (``SOURCE_KEY``: per-source losses) and its tokens' documents
        (``SEGMENT_KEY``: document masking)."""

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        b, r = self.local_batch, self.dp_rank
        names = [s.name for s in self.stream.sources]
        step = None
        while True:
            sch = self.stream.schedule
            if r == 0 and step != (now := step_of(sch.g, getattr(sch, "samples_per_step", 1))):
                if line := sch.announce(now, names, step is None):  # the weights change at this step
                    logger.info(line)
                step = now
            mine = self.stream.take(self.dp_world_size * b)[r * b : (r + 1) * b]
            x = torch.from_numpy(np.stack([self.stream.tokens(s) for s in mine]))
            if self.on_batch is not None:
                self.on_batch(mine)
            inputs = {"input": x[:, :-1]}
            if self.tag_sources:
                inputs[SOURCE_KEY] = torch.tensor([s.source for s in mine], dtype=torch.int64)
            if self.segments:
                inputs[SEGMENT_KEY] = torch.from_numpy(np.stack([self.stream.segments(s)[:-1] for s in mine]))
            yield inputs, x[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        # A string: DCP saves it once (every rank's is the same) and hands it back to every rank, any world size.
        state: dict[str, Any] = {_STATE_KEY: json.dumps(self.stream.state())}
        hub = self.stream.per_rank_sources()
        if hub:  # a streamed source's position is this rank's own: a key per rank, and the degree they belong to
            state[_RANK_STATE_KEY.format(self.dp_rank)] = pickle.dumps({s.name: s.state_dict() for s in hub})
            state[_RANK_DEGREE_KEY] = self.dp_world_size
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if _STATE_KEY not in state_dict:
            raise per_rank_checkpoint_error()
        changed = self.stream.restore(json.loads(state_dict[_STATE_KEY]))
        if changed and self.dp_rank == 0:
            logger.warning(changed)
        hub = self.stream.per_rank_sources()
        if not hub:
            return
        key = _RANK_STATE_KEY.format(self.dp_rank)
        saved = state_dict.get(_RANK_DEGREE_KEY)
        if saved != self.dp_world_size or key not in state_dict:
            raise stream_degree_error(saved, self.dp_world_size, [s.name for s in hub])
        positions = pickle.loads(state_dict[key])
        for s in hub:
            s.load_state_dict(positions.get(s.name, {}))

    def missing_state_error(self, saved: set[str]) -> ConfigError:
        """What a checkpoint lacking some of this loader's keys (``saved``: the keys it has) means."""
        if _STATE_KEY not in saved:
            return per_rank_checkpoint_error()
        return stream_degree_error(None, self.dp_world_size, [s.name for s in self.stream.per_rank_sources()])


def per_rank_checkpoint_error() -> ConfigError:
    """A checkpoint whose dataloader state is torchtitan's per-rank one (kubetitan before the global stream)."""
    return ConfigError("checkpoint (dataloader state)",
                       "the checkpoint's data position is not a global one: it was saved by an older kubetitan, whose "
                       "loader kept one position per data-parallel rank (torchtitan's), and the positions of the two "
                       "loaders do not translate into each other",
                       "start the run afresh (a new name, or an empty checkpoint folder), or finish it with the "
                       "kubetitan version that wrote the checkpoint (docs/data.md, Migrating)")


def stream_degree_error(saved: int | None, now: int, names: list[str]) -> ConfigError:
    """A run with a streamed dataset resumed at another data-parallel degree."""
    was = f"degree {saved}" if saved is not None else "another degree"
    return ConfigError("data.source huggingface (spec.data.source, spec.data.mixture[].huggingface)",
                       f"the checkpoint's position in the streamed dataset(s) {', '.join(names) or ''} was saved at "
                       f"data-parallel {was}, this run has {now}; a streamed dataset keeps one position per rank and "
                       "cannot be re-split",
                       "resume at the same degree, or prepare the corpus with `kubetitan prepare-data` and use "
                       "data.source shards or shards mixture sources (their position is global: any degree resumes)")


def resume_problem(saved_keys: set[str], loader: BaseDataLoader, prefix: str = "dataloader.") -> ConfigError | None:
    """Before a checkpoint is loaded: the ConfigError when it lacks a key ``loader`` will ask for (DCP would stop
    with a bare ``Missing key`` RuntimeError), None when it has them all. ``saved_keys``: the checkpoint's keys
    (its metadata's ``state_dict_metadata``)."""
    expected = {prefix + k for k in loader.state_dict()}
    if not expected or expected <= saved_keys:
        return None
    saved = {k[len(prefix):] for k in saved_keys if k.startswith(prefix)}
    if isinstance(loader, (GlobalDataLoader, LocalDataLoader)):
        return loader.missing_state_error(saved)
    return None


class EvalLoader(BaseDataLoader):
    """The held-out samples, the same ones at every evaluation: ``samples`` of them (rounded down to a multiple of
    ``W*b``), rank ``r`` reading its ``b`` of every ``W*b``. Finite, equal on every rank; no checkpoint state."""

    def __init__(self, read: Callable[[int], np.ndarray], samples: int, *, dp_rank: int, dp_world_size: int,
                 local_batch: int, source_of: Callable[[int], int] | None = None,
                 segments: Callable[[int], np.ndarray] | None = None) -> None:
        self.read, self.dp_rank, self.dp_world_size, self.local_batch = read, dp_rank, dp_world_size, local_batch
        self.batches = samples // (dp_world_size * local_batch)
        self.source_of, self.segments = source_of, segments
        """Tag each sample with its source (per-source eval loss) and its tokens' documents (document masking)."""

    def __iter__(self):
        b, w, r = self.local_batch, self.dp_world_size, self.dp_rank
        for k in range(self.batches):
            slots = rank_slice(0, k, r, w, b)
            x = torch.from_numpy(np.stack([self.read(p) for p in slots]))
            inputs = {"input": x[:, :-1]}
            if self.source_of is not None:
                inputs[SOURCE_KEY] = torch.tensor([self.source_of(p) for p in slots], dtype=torch.int64)
            if self.segments is not None:
                inputs[SEGMENT_KEY] = torch.from_numpy(np.stack([self.segments(p)[:-1] for p in slots]))
            yield inputs, x[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class LocalDataLoader(ParallelAwareDataloader):
    """torchtitan's per-rank loader (``huggingface``), with a resume at another DP degree as a configuration error."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict and state_dict.get("world_size", self.dp_world_size) != self.dp_world_size:
            raise stream_degree_error(state_dict["world_size"], self.dp_world_size, [getattr(self.dataset, 'dataset_name', '')])
        super().load_state_dict(state_dict)

    def missing_state_error(self, saved: set[str]) -> ConfigError:
        if _STATE_KEY in saved:
            return ConfigError("data.source huggingface (spec.data.source)", "the checkpoint's data position is a "
                               "global one (a shards or mixture run), this run streams a dataset",
                               "resume with the data source the checkpoint was written with, or start afresh")
        return stream_degree_error(None, self.dp_world_size, [getattr(self.dataset, 'dataset_name', '')])


# ---------------------------------------------------------------------------------------------------- huggingface
_LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
HF_FIELD = "kubetitan.data.hf_dataset (spec.data.huggingface.dataset)"
HUB_HINT = ("or keep the hub out of the run: tokenize the corpus once with `kubetitan prepare-data` and train on "
            "shards (data.source shards or mixture), or copy the dataset to a volume (spec.data.volume) and give its "
            "path as the dataset, or pre-fill the Hugging Face cache on a volume (HF_HOME) and set HF_HUB_OFFLINE=1")
"""The fix every hub-dataset network error names (the retries' last message, a failure mid-stream)."""


@dataclass(frozen=True)
class HubSpec:
    """One Hugging Face dataset source: ``data.source = "huggingface"`` or one ``huggingface`` mixture entry."""

    dataset: str
    config: str = ""
    split: str = "train"
    streaming: bool = True
    text_field: str = "text"
    field: str = HF_FIELD
    """The config key (and spec field) its errors name."""


def load_hf_dataset(dataset: str, config: str, split: str, streaming: bool, *, field: str = HF_FIELD,
                    **retry: Any):
    """``datasets.load_dataset`` for a hub name, a local directory/file, or ``builtin``.

    A hub dataset is opened with the hub retry policy (``downloads.with_retries``: capped exponential backoff
    with jitter around the ``datasets``/``huggingface_hub`` call, whose own retries of one request count as one
    try): a hub that stays unreachable is a :class:`TransientError` (exit 6) naming the dataset and the way to
    train without the hub; a dataset the hub does not have (or refuses) is a :class:`ConfigError` (exit 2) on
    ``field``. ``retry`` passes the policy's knobs (tests)."""
    from datasets import load_dataset

    if dataset == "builtin":
        dataset = str(BUILTIN_CORPUS)
    p = Path(dataset)
    if p.is_file():
        builder = _LOCAL_BUILDERS.get(p.suffix)
        if builder is None:
            raise ConfigError(field, f"{dataset} is a file of unknown type",
                              f"use a {', '.join(_LOCAL_BUILDERS)} file, a directory, or a hub dataset name")
        return load_dataset(builder, data_files={split: str(p)}, split=split, streaming=streaming)
    if dataset.startswith("/") and not p.exists():
        raise ConfigError(field, f"the local path {dataset} does not exist",
                          "mount the volume that holds it (spec.data.volume) or fix the path")
    if p.is_dir():
        return load_dataset(dataset, name=config or None, split=split, streaming=streaming)
    try:
        return downloads.with_retries(
            lambda: load_dataset(dataset, name=config or None, split=split, streaming=streaming),
            f"Opening the dataset {dataset} on the hub", kind=downloads.classify_dataset,
            hint=f"check the pod's network access to the hub (or HF_ENDPOINT), {HUB_HINT}", **retry)
    except TransientError:
        raise
    except Exception as e:  # noqa: BLE001 - only the config class becomes a ConfigError; the rest propagates
        if downloads.classify_dataset(e) != downloads.CONFIG:
            raise
        raise ConfigError(field, f"the hub cannot give {dataset} (config {config or 'default'}, split {split}): "
                          f"{type(e).__name__}: {downloads.first_line(e)}",
                          "check the dataset id (namespace/name on the hub), config and split; for a gated or "
                          "private dataset accept its terms and set spec.tokenizer.tokenSecretRef (its HF_TOKEN "
                          "reaches the dataset load too); with HF_HUB_OFFLINE=1 the dataset must be in the "
                          "Hugging Face cache (HF_HOME) already; or prepare it into shards with `kubetitan "
                          "prepare-data`") from None


class KubetitanHFTextDataset(HuggingFaceTextDataset):
    """torchtitan's HuggingFaceTextDataset (iteration, packing, state) with a configurable source.

    The base ``__init__`` only accepts datasets from torchtitan's fixed registry, so this one sets
    the same attributes from ``[kubetitan.data]`` instead (``compat.init_hf_text_dataset``); everything else
    is inherited, except that a failure while streaming is classified (:meth:`__iter__`).
    """

    def __init__(self, cfg, tokenizer: BaseTokenizer, seq_len: int, dp_rank: int, dp_world_size: int,
                 infinite: bool = True, *, hub: HubSpec | None = None) -> None:
        from datasets.distributed import split_dataset_by_node

        hub = hub or HubSpec(cfg.hf_dataset, cfg.hf_config, cfg.hf_split, cfg.hf_streaming, cfg.hf_text_field)
        self.hub = hub
        self.documents_read = 0
        """Documents this process has read (for error messages; the checkpointed position is the base class's)."""
        ds = load_hf_dataset(hub.dataset, hub.config, hub.split, hub.streaming, field=hub.field)
        compat.init_hf_text_dataset(self, dataset_name=hub.dataset, data=split_dataset_by_node(ds, dp_rank, dp_world_size),
                                    tokenizer=tokenizer, seq_len=seq_len, infinite=infinite,
                                    text_processor=self._text)

    def _text(self, sample: dict[str, Any]) -> str:
        self.documents_read += 1
        try:
            return sample[self.hub.text_field]
        except KeyError:
            raise ConfigError(self.hub.field, f"the rows of {self.hub.dataset} have no column {self.hub.text_field!r} "
                              f"(the text field; they have {sorted(sample)})",
                              "set this source's textField to the column that holds the text") from None

    def __iter__(self):
        try:
            yield from super().__iter__()
        except (ConfigError, TransientError):
            raise
        except Exception as e:  # noqa: BLE001 - classified: a network or hub failure is not a traceback
            kind = downloads.classify_dataset(e)
            if kind is None:
                raise
            where = f"Reading the dataset {self.hub.dataset} (after {self.documents_read} documents on this rank)"
            if kind == downloads.CONFIG:
                raise ConfigError(self.hub.field, f"{where} failed: {type(e).__name__}: {downloads.first_line(e)}",
                                  f"check that the dataset's files are readable with the pod's token; {HUB_HINT}") from None
            raise TransientError(f"{where} failed mid-stream after the library's own retries ({type(e).__name__}: "
                                 f"{downloads.first_line(e)}). The run is restarted from its newest checkpoint (exit "
                                 f"code 6); if it keeps failing, check the pod's network access to the hub (or "
                                 f"HF_ENDPOINT), {HUB_HINT}") from e


class HubSource:
    """A streamed Hugging Face dataset inside a mixture (``mixture_kinds`` entry ``huggingface``).

    The mixture schedule decides, for every global sample, which source gives it, on every rank alike; when this
    source is chosen, rank ``r`` takes the next ``seq_len + 1`` tokens of *its own* part of the stream
    (torchtitan's ``HuggingFaceTextDataset`` over ``split_dataset_by_node``: documents BOS + text + EOS, packed). So
    the per-source shares are exact (the schedule's guarantee) while the tokens are rank-local, in the dataset's
    order: no random access, no shuffle, no held-out split, and its position is one per rank, so a run with it
    resumes only at the same data-parallel degree (:meth:`GlobalDataLoader.load_state_dict` says so)."""

    per_rank = True
    shuffle = False
    held_out_windows = 0

    def __init__(self, name: str, hub: HubSpec, seq_len: int) -> None:
        self.name, self.hub, self.seq_len = name, hub, seq_len
        self.windows = SYNTHETIC_WINDOWS  # a stream: the schedule never wraps it into a second "epoch"
        self.dataset: KubetitanHFTextDataset | None = None
        self._it: Iterator | None = None

    def open(self, tokenizer: BaseTokenizer | None, dp_rank: int, dp_world_size: int) -> None:
        """Open this rank's part of the stream (the hub retry policy applies: :func:`load_hf_dataset`)."""
        if tokenizer is None:
            raise ConfigError(self.hub.field, "a huggingface mixture source needs a tokenizer", "set spec.tokenizer")
        self.dataset = KubetitanHFTextDataset(None, tokenizer, self.seq_len, dp_rank, dp_world_size, hub=self.hub)

    def next_window(self) -> np.ndarray:
        """The next ``seq_len + 1`` tokens of this rank's stream."""
        assert self.dataset is not None, "HubSource.open() first"
        if self._it is None:
            self._it = iter(self.dataset)
        inp, label = next(self._it)
        return torch.cat([inp["input"], label[-1:]]).numpy()

    def window(self, k: int) -> np.ndarray:  # noqa: ARG002 - a stream has no random access
        raise ConfigError(self.hub.field, "a streamed dataset has no random access (held-out or replayed windows)",
                          "evaluate on a separate held-out set (spec.data.eval.shards)")

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict() if self.dataset is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.dataset is not None and state:
            self.dataset.load_state_dict(state)


# ---------------------------------------------------------------------------------------------------- building
def model_vocab_size(job_config: JobConfig) -> int:
    return model_args_for(job_config).vocab_size


def data_seed(job_config: JobConfig) -> int:
    """The data-order seed: ``debug.seed`` (spec.training.seed), 0 when unset."""
    return job_config.debug.seed if job_config.debug.seed is not None else 0


def mixture_names(cfg) -> list[str]:
    """Metric label of each mixture source: its name, else its directory's (or dataset's) last path component, made
    unique with ``-<i>``."""
    names = list(cfg.mixture_names) + [""] * (len(cfg.mixture_paths) - len(cfg.mixture_names))
    out: list[str] = []
    for i, (n, p) in enumerate(zip(names, cfg.mixture_paths)):
        n = n or Path(p.rstrip("/")).name or f"source-{i}"
        out.append(n if n not in out else f"{n}-{i}")
    return out


def _pad(values: list, n: int, default: Any) -> list:
    return list(values) + [default] * (n - len(values))


def mixture_hub_spec(cfg, i: int) -> HubSpec | None:
    """Mixture source ``i`` as a :class:`HubSpec` when it is a ``huggingface`` one, else None."""
    n = len(cfg.mixture_paths)
    kinds = _pad(cfg.mixture_kinds, n, "shards")
    if kinds[i] not in ("shards", "huggingface"):
        raise ConfigError(f"kubetitan.data.mixture_kinds[{i}]", f"unknown kind {kinds[i]!r}", "use shards or huggingface")
    if kinds[i] != "huggingface":
        return None
    return HubSpec(cfg.mixture_paths[i], _pad(cfg.mixture_hf_configs, n, "")[i],
                   _pad(cfg.mixture_hf_splits, n, "")[i] or "train", _pad(cfg.mixture_hf_streaming, n, True)[i],
                   _pad(cfg.mixture_hf_text_fields, n, "")[i] or "text",
                   field=f"kubetitan.data.mixture_paths[{i}] (spec.data.mixture[{i}].huggingface.dataset)")


def build_sources(job_config: JobConfig, *, held_out_percent: float | None = None) -> tuple[list[Any], list[float]]:
    """The training sources and their weights from ``[kubetitan.data]`` (a mixture's streamed sources are not opened
    yet: :meth:`HubSource.open`)."""
    cfg = job_config.kubetitan.data
    seq_len = job_config.training.seq_len
    held = cfg.held_out_percent if held_out_percent is None else held_out_percent
    if cfg.eval_samples <= 0 or cfg.eval_shards_path:
        held = 0.0
    if cfg.source == "synthetic":
        return [SyntheticSource(model_vocab_size(job_config), seq_len, data_seed(job_config))], [1.0]
    vocab = model_vocab_size(job_config)
    if cfg.source == "shards":
        field = "kubetitan.data.shards_path (spec.data.shards.path)"
        shards = open_shards(cfg.shards_path, field, cfg.shards_dtype, vocab, job_config)
        return [WindowSource(Path(cfg.shards_path.rstrip("/")).name or "shards", shards, seq_len, held,
                             path=cfg.shards_path)], [1.0]
    if cfg.source == "mixture":
        if len(cfg.mixture_paths) < 1 or len(cfg.mixture_weights) != len(cfg.mixture_paths):
            raise ConfigError("kubetitan.data.mixture_paths (spec.data.mixture)",
                              f"{len(cfg.mixture_paths)} path(s) and {len(cfg.mixture_weights)} weight(s)",
                              "give every mixture source a shards path (or a dataset) and a weight")
        sources: list[Any] = []
        dtypes = _pad(cfg.mixture_dtypes, len(cfg.mixture_paths), "auto")
        for i, (name, path) in enumerate(zip(mixture_names(cfg), cfg.mixture_paths)):
            hub = mixture_hub_spec(cfg, i)
            if hub is not None:
                sources.append(HubSource(name, hub, seq_len))
                continue
            field = f"kubetitan.data.mixture_paths[{i}] (spec.data.mixture[{i}].shards.path)"
            sources.append(WindowSource(name, open_shards(path, field, dtypes[i], vocab, job_config), seq_len, held,
                                        path=path, field=field))
        return sources, list(cfg.mixture_weights)
    raise ConfigError("kubetitan.data.source (spec.data.source)", f"unknown source {cfg.source!r}",
                      "use synthetic, shards, mixture or huggingface")


def weight_schedules(job_config: JobConfig) -> list[WeightSchedule] | None:
    """A mixture's weight schedules (``mixture_schedule_*``), or None when no source has one."""
    cfg = job_config.kubetitan.data
    if cfg.source != "mixture" or not cfg.mixture_schedule_sources:
        return None
    try:
        return from_lists(cfg.mixture_weights, cfg.mixture_schedule_interpolations, cfg.mixture_schedule_sources,
                          cfg.mixture_schedule_steps, cfg.mixture_schedule_weights)
    except ValueError as e:
        raise ConfigError("kubetitan.data.mixture_schedule_* (spec.data.mixture[].schedule)", str(e),
                          "render trainer.toml from the spec (kubetitan render)") from None


def samples_per_step(job_config: JobConfig, dp_world_size: int) -> int:
    """The global batch in samples: what one optimizer step trains, whatever the world size."""
    t = job_config.training
    return t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp_world_size


def _ledger_writer(job_config: JobConfig, dp_rank: int, dp_world_size: int,
                   current_step: Callable[[], int]) -> Callable[[list[Sample]], None]:
    """Append each micro-batch's samples to this rank's ledger, with the step that trains them."""
    folder = Path(job_config.job.dump_folder) / "kubetitan" / LEDGER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{dp_rank}-of-{dp_world_size}.txt"

    def write(samples: list[Sample]) -> None:
        step = current_step()  # torchtitan counts the step before it fetches the step's micro-batches
        with open(path, "a") as f:
            f.writelines(f"{step} {s.position} {s.source} {s.window} {s.epoch}\n" for s in samples)

    return write


class _Counters:
    """After each micro-batch: the tokens every source gave the job so far (to the exporter) and the ledger."""

    def __init__(self, stream: GlobalStream) -> None:
        self.stream = stream
        self.exporter: Any = None
        self.ledger: Callable[[list[Sample]], None] | None = None

    def __call__(self, mine: list[Sample]) -> None:
        if self.exporter is not None:
            size = self.stream.sources[0].seq_len + 1
            sch = self.stream.schedule
            # The global stream's draws per source, carried across resumes by the checkpoint: the job's tokens.
            self.exporter.data_tokens({s.name: c * size for s, c in zip(self.stream.sources, sch.counts)})
            step = step_of(max(0, sch.g - 1), getattr(sch, "samples_per_step", 1))
            self.exporter.data_weights({s.name: x for s, x in zip(self.stream.sources, sch.shares_at(step))})
            self.exporter.data_epochs({name: r["epochs"] for name, r in self.stream.report().items()})
        if self.ledger is not None:
            self.ledger(mine)


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer | None, job_config: JobConfig,
                     infinite: bool = True) -> BaseDataLoader:
    """TrainSpec ``build_dataloader_fn``: the global-position loader (synthetic, shards, mixture), or torchtitan's
    per-rank loader for a streamed Hugging Face dataset (``contract.PER_RANK_DATA_SOURCES``: what the operator reads
    to refuse a mid-run edit of the data-parallel degree, ``contract.resumes_at_another_dp_degree``)."""
    cfg = job_config.kubetitan.data
    t = job_config.training
    if cfg.source in contract.PER_RANK_DATA_SOURCES:
        assert tokenizer is not None
        ds = KubetitanHFTextDataset(cfg, tokenizer, t.seq_len, dp_rank, dp_world_size, infinite)
        kwargs = {**asdict(t.dataloader), "batch_size": t.local_batch_size}
        return LocalDataLoader(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)
    sources, weights = build_sources(job_config)
    for s in sources:
        if getattr(s, "per_rank", False):
            s.open(tokenizer, dp_rank, dp_world_size)
    mix = mix_for(weights, weight_schedules(job_config), samples_per_step(job_config, dp_world_size))
    stream = GlobalStream(sources, weights, data_seed(job_config), shuffled=cfg.order == "shuffled", mix=mix)
    counters = _Counters(stream)
    loader = GlobalDataLoader(stream, dp_rank=dp_rank, dp_world_size=dp_world_size, local_batch=t.local_batch_size,
                              on_batch=counters, tag_sources=len(sources) > 1,
                              segments=cfg.attention_mask == "document")
    loader.counters = counters  # type: ignore[attr-defined]  # the trainer attaches the exporter and the ledger
    return loader


def attach(loader: BaseDataLoader, job_config: JobConfig, exporter: Any, current_step: Callable[[], int]) -> None:
    """Wire a :class:`GlobalDataLoader`'s per-source token counts to ``exporter`` and, with ``ledger = true``, its
    ledger (a no-op for other loaders)."""
    counters = getattr(loader, "counters", None)
    if counters is None:
        return
    counters.exporter = exporter
    if job_config.kubetitan.data.ledger:
        counters.ledger = _ledger_writer(job_config, loader.dp_rank, loader.dp_world_size, current_step)


def build_eval_loader(job_config: JobConfig, dp_world_size: int, dp_rank: int) -> EvalLoader:
    """The held-out loader: ``eval_shards_path``, else the held-out windows of the training sources mixed by the same
    weights (in corpus order: the set is what matters, and it is the same at every evaluation)."""
    cfg = job_config.kubetitan.data
    seq_len = job_config.training.seq_len
    if cfg.eval_shards_path:
        field = "kubetitan.data.eval_shards_path (spec.data.eval.shards.path)"
        src = WindowSource("eval", open_shards(cfg.eval_shards_path, field, "auto", model_vocab_size(job_config),
                                               job_config), seq_len, path=cfg.eval_shards_path, field=field)
        sources, weights, reads = [src], [1.0], [src.window]
        sizes, segs = [src.windows], [src.segments]
    else:
        sources, weights = build_sources(job_config)
        schedules = weight_schedules(job_config)
        if schedules:  # a scheduled source is evaluated at the largest weight it has in the run
            weights = [max([sch.start, *(w for _, w in sch.points)]) for sch in schedules]
        if cfg.source == "synthetic":
            evals = SyntheticSource(sources[0].vocab_size, seq_len, seed_hash(data_seed(job_config), 0xE7A1))
            reads, sizes = [evals.window], [SYNTHETIC_WINDOWS]
            segs = [lambda k: np.zeros(seq_len + 1, dtype=np.int32)]
        elif any(getattr(s, "per_rank", False) for s in sources):
            raise ConfigError("kubetitan.data.eval_shards_path (spec.data.eval.shards)",
                              "is required with a huggingface mixture source: a streamed dataset has no held-out split",
                              "prepare a held-out set with `kubetitan prepare-data` and set spec.data.eval.shards")
        else:
            reads, sizes = [s.held_out for s in sources], [s.held_out_windows for s in sources]
            segs = [lambda k, s=s: s.segments(s.windows + k) for s in sources]
    if not all(sizes):
        raise ConfigError("kubetitan.data.held_out_percent (spec.data.eval.heldOutPercent)",
                          "is 0, so there is no held-out data to evaluate",
                          "hold out a share of the training data (above 0) or set spec.data.eval.shards")
    schedule = MixSchedule(weights)
    plan: list[tuple[int, int]] = []
    for _ in range(cfg.eval_samples):
        i = schedule.next()
        plan.append((i, (schedule.counts[i] - 1) % max(sizes[i], 1)))
    if any(schedule.counts[i] > sizes[i] for i in range(len(sizes))):
        logger.warning(f"The held-out set has fewer windows than eval_samples ({cfg.eval_samples}) asks of it "
                       f"({sizes}); some are evaluated twice")
    per_source = len(sources) > 1 and not cfg.eval_shards_path
    loader = EvalLoader(lambda p: reads[plan[p][0]](plan[p][1]), cfg.eval_samples, dp_rank=dp_rank,
                        dp_world_size=dp_world_size, local_batch=job_config.training.local_batch_size,
                        source_of=(lambda p: plan[p][0]) if per_source else None,
                        segments=(lambda p: segs[plan[p][0]](plan[p][1])) if cfg.attention_mask == "document" else None)
    loader.source_names = [s.name for s in sources] if per_source else []  # type: ignore[attr-defined]
    if loader.batches < 1:
        raise ConfigError("kubetitan.data.eval_samples (spec.data.eval.samples)",
                          f"{cfg.eval_samples} is fewer than one batch of local batch x data-parallel degree "
                          f"({job_config.training.local_batch_size * dp_world_size})",
                          "raise spec.data.eval.samples")
    return loader
