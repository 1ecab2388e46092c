"""The global sample stream, torch-free: its sources, the mixture schedule and the position arithmetic of a
resume (imports neither torch nor torchtitan; ``loaders`` wraps it in torchtitan's dataloader).

**The global stream.** ``synthetic``, ``shards`` and ``mixture`` runs read one *global* stream of samples,
each a fixed window of ``seq_len + 1`` tokens. Global sample ``g`` is a pure function of the data config,
the seed and ``g``:

1. a mixture schedule picks the source of ``g`` (:class:`MixSchedule`: smooth weighted round robin, so after
   any ``n`` samples source ``i`` has had ``weight_i * n`` of them, give or take less than one);
2. that source's ``j``-th draw, ``j`` being how many samples the source gave before ``g``, is window
   ``perm_e[j mod n]`` of epoch ``e = j // n``, where ``perm_e`` is a seeded permutation of the source's ``n``
   training windows (:func:`epoch_permutation`: numpy's PCG64, seeded with (seed, source, epoch)); with
   ``order = "sequential"`` it is window ``j mod n`` (corpus order, the old behaviour).

**Who reads what.** Rank ``r`` of ``W`` data-parallel ranks with local batch ``b`` reads, for its ``k``-th
micro-batch since the position ``p`` it resumed from, the global samples ``[p + k*W*b + r*b, p + k*W*b + (r+1)*b)``.
A step of global batch ``B = A*W*b`` (``A`` micro-batches of gradient accumulation) therefore trains exactly
the samples ``[s*B, (s+1)*B)`` whatever ``W``, ``b`` and ``A`` are (:func:`rank_slice`).

**Resume at any world size.** The dataloader's checkpoint state is the global position (samples consumed and
each source's draws), the same on every rank (``loaders.GlobalDataLoader``), so a run saved at DP 2 and resumed
at DP 1 or 3 continues the same global stream: no sample skipped, none repeated. torchtitan 0.2.2's
``ParallelAwareDataloader`` keeps a state per DP rank and refuses another DP degree.

Memory: a shuffled source holds its current epoch's permutation, 4 bytes per window (8 above 2**31 windows):
1 T tokens at ``seq_len`` 8192 are 122 M windows, 0.5 GB per rank.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from kubetitan_core.weights import WeightSchedule, step_of
from kubetitan_trainer.data.shards import ShardSet
from kubetitan_trainer.errors import ConfigError

logger = logging.getLogger()
"""The root logger, as torchtitan's own (``torchtitan.tools.logging.logger``), without importing torchtitan."""
PHRASES = 1024
PHRASE_LEN = 16
SYNTHETIC_WINDOWS = 1 << 40
"""Windows of the synthetic source (it generates any of them; it never starts a second epoch in practice)."""
_MASK64 = (1 << 64) - 1


def seed_hash(*xs: int) -> int:
    """A stable 64-bit hash of integers (splitmix64), independent of PYTHONHASHSEED."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h


# ---------------------------------------------------------------------------------------------------- sources
class SyntheticSource:
    """Deterministic learnable tokens: random "phrases" (a fixed table of short token sequences chosen by the seed)
    strung together. Window ``k`` is a function of (seed, k) alone; about 0.1 ms a window, no I/O."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, name: str = "synthetic") -> None:
        self.name, self.vocab_size, self.seq_len, self.seed = name, vocab_size, seq_len, seed
        rng = np.random.default_rng(seed_hash(seed, 0xC0FFEE))
        self._phrases = rng.integers(0, vocab_size, size=(PHRASES, PHRASE_LEN), dtype=np.int64)
        self.windows = SYNTHETIC_WINDOWS
        self.shuffle = False  # its windows are random already; a permutation of 2**40 of them would not fit

    def window(self, k: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of window ``k``."""
        rng = np.random.default_rng(seed_hash(self.seed, k))
        n = (self.seq_len + 1) // PHRASE_LEN + 2
        picks = rng.integers(0, PHRASES, size=n)
        offset = int(rng.integers(0, PHRASE_LEN))  # windows do not all start at a phrase boundary
        return self._phrases[picks].reshape(-1)[offset : offset + self.seq_len + 1].copy()


class WindowSource:
    """Windows of ``seq_len + 1`` tokens over a :class:`ShardSet`'s concatenated stream (documents in corpus order,
    each BOS + text + EOS): window ``k`` is tokens
    ``[k*(seq_len+1), (k+1)*(seq_len+1))``; the tail shorter than a window is never read.

    ``held_out_percent`` keeps the last that many percent of the windows (at least one) out of training:
    :meth:`window` reads windows ``[0, windows)``, :meth:`held_out` the rest."""

    def __init__(self, name: str, shards: ShardSet, seq_len: int, held_out_percent: float = 0.0, *, path: str = "",
                 field: str = "kubetitan.data.shards_path (spec.data.shards.path)") -> None:
        self.name, self.shards, self.seq_len, self.size = name, shards, seq_len, seq_len + 1
        total = shards.total_tokens // self.size
        held = math.ceil(total * held_out_percent / 100) if held_out_percent > 0 else 0
        self.windows, self.held_out_windows = total - held, held
        if self.windows < 1:
            raise ConfigError(field, f"{path or name} holds {shards.total_tokens} tokens: {total} window(s) of "
                              f"{self.size} tokens, {held} of them held out, none left to train on",
                              "prepare more data, lower spec.training.seqLen or spec.data.eval.heldOutPercent")

    def window(self, k: int) -> np.ndarray:
        return self.shards.read(k * self.size, self.size)

    def held_out(self, k: int) -> np.ndarray:
        return self.window(self.windows + k)

    def segments(self, k: int) -> np.ndarray:
        """Which document of window ``k`` each of its tokens belongs to (from the ``.idx``: document masking)."""
        try:
            return self.shards.segments(k * self.size, self.size)
        except ValueError as e:  # a version-1 directory records no boundaries
            raise ConfigError("kubetitan.data.attention_mask (spec.data.attentionMask)", str(e),
                              "re-run kubetitan prepare-data (format version 2 stores the boundaries), or set "
                              "attentionMask to causal") from None


def epoch_permutation(n: int, seed: int, source: int, epoch: int) -> np.ndarray:
    """A seeded permutation of ``range(n)`` for one source's epoch: numpy's ``Generator(PCG64)`` seeded with
    (seed, source, epoch) through ``SeedSequence`` (stable across numpy versions and machines). int32 when ``n``
    fits (4 bytes a window), else int64."""
    perm = np.random.Generator(np.random.PCG64([seed, source, epoch])).permutation(n)
    return perm.astype(np.int32) if n < 2**31 else perm


class _Order:
    """Window of a source's ``j``-th draw: shuffled (a permutation per epoch, the current one cached) or sequential."""

    def __init__(self, n: int, seed: int, source: int, shuffled: bool) -> None:
        self.n, self.seed, self.source, self.shuffled = n, seed, source, shuffled
        self._epoch, self._perm = -1, None

    def __call__(self, j: int) -> tuple[int, int]:
        epoch, i = divmod(j, self.n)
        if not self.shuffled:
            return i, epoch
        if epoch != self._epoch:
            self._perm, self._epoch = epoch_permutation(self.n, self.seed, self.source, epoch), epoch
        return int(self._perm[i]), epoch


# ---------------------------------------------------------------------------------------------------- mixture
def integer_weights(weights: list[float]) -> list[int]:
    """The weights as integers with the same ratios (each to 1e-9 relative), so the schedule is exact arithmetic."""
    if not weights or any(not (w > 0) for w in weights):
        raise ConfigError("kubetitan.data.mixture_weights (spec.data.mixture[].weight)", f"{weights} are not all above 0",
                          "give every source a positive weight")
    fr = [Fraction(w).limit_denominator(10**9) for w in weights]
    den = math.lcm(*(f.denominator for f in fr))
    ints = [int(f * den) for f in fr]
    g = math.gcd(*ints)
    return [i // g for i in ints]


class MixSchedule:
    """Smooth weighted round robin over sources: global sample ``g`` goes to the source with the largest deficit
    ``w_i*(g+1-g0) - (c_i-b_i)*S`` (``c_i``: its samples so far, ``S``: the sum of the integer weights; ties to the
    lower index), counted from the *base* ``(g0, b)``: the start, or the position where the weights last changed
    (:meth:`rebase`). After any ``n`` samples from the base ``|c_i - b_i - n*w_i/S| < 1``: the weights hold over
    every window of the stream, not just on average, and new weights hold from the sample they start at (no
    catching up on the old weights' cumulative shares). The state is (g, counts, base): it travels in the
    checkpoint."""

    def __init__(self, weights: list[float]) -> None:
        self.w = integer_weights(weights)
        self.total = sum(self.w)
        self.g = 0
        self.counts = [0] * len(self.w)
        self.base_g, self.base_counts = 0, [0] * len(self.w)

    def rebase(self) -> None:
        """Count the weights from the current position on (they changed here)."""
        self.base_g, self.base_counts = self.g, list(self.counts)

    def seek(self, g: int, counts: list[int], base_g: int | None = None, base_counts: list[int] | None = None) -> None:
        """Continue at position ``g`` with ``counts`` samples per source, the weights counted from the base."""
        self.g, self.counts = g, list(counts)
        if base_g is not None and base_counts is not None:
            self.base_g, self.base_counts = base_g, list(base_counts)

    def fresh(self) -> MixSchedule:
        """The same schedule at position 0."""
        return MixSchedule(self.w)

    def identity(self) -> Any:
        """What a checkpoint keeps to tell whether a resumed run has the same weights (the integer weights)."""
        return list(self.w)

    def shares_at(self, step: int) -> list[float]:  # noqa: ARG002 - constant weights
        """Each source's share of the samples of ``step`` (0-1)."""
        return [w / self.total for w in self.w]

    def announce(self, step: int, names: list[str], first: bool) -> str | None:  # noqa: ARG002 - nothing changes
        """A line to log at the first micro-batch of ``step`` when the weights change there (None: they do not)."""
        return None

    def next(self) -> int:
        n = self.g + 1 - self.base_g
        best, best_deficit = 0, None
        for i, w in enumerate(self.w):
            d = w * n - (self.counts[i] - self.base_counts[i]) * self.total
            if best_deficit is None or d > best_deficit:
                best, best_deficit = i, d
        self.counts[best] += 1
        self.g += 1
        return best


SHARE_UNITS = 1 << 40
"""A scheduled mixture's shares of a step are integers that sum to this: exact arithmetic, whose rounding moves a
source's expected count by less than one sample in 2**40 samples."""


class ScheduledMix(MixSchedule):
    """Weights that change with the step (:class:`kubetitan_core.weights.WeightSchedule`, one per source): the samples
    of step ``s`` (``[(s-1)*B, s*B)``, ``B`` the global batch in samples) are shared by the weights at ``s``. Global
    sample ``g`` goes to the source with the largest deficit ``T_i(g+1) - (c_i - b_i) * D``, where ``T_i(n)`` sums
    source ``i``'s share of each sample from the base to ``n`` (in units of ``D`` = :data:`SHARE_UNITS`; ties to the
    lower index): the same rule as :class:`MixSchedule`, whose shares are constant. The deficit of every source stays
    within one sample of its cumulative share (two sources: within half a sample), with no catching up when a
    share changes: what a step's weights say is what that step gets. The position is a function of ``g`` alone, so
    a resume at any world size continues it; :meth:`seek` recomputes ``T`` from the base, step by step."""

    def __init__(self, schedules: list[WeightSchedule], samples_per_step: int) -> None:
        self.schedules, self.samples_per_step = list(schedules), samples_per_step
        n = len(self.schedules)
        self.w = [0] * n  # no fixed weights; kept for the attribute's readers
        self.total = SHARE_UNITS
        self.g, self.counts = 0, [0] * n
        self.base_g, self.base_counts = 0, [0] * n
        self._acc = [0] * n
        self._step, self._shares = -1, [0] * n

    def shares(self, step: int) -> list[int]:
        """The sources' shares of one sample of ``step``, integers summing to SHARE_UNITS (largest remainders)."""
        if step != self._step:
            ws = [sch.at(step) for sch in self.schedules]
            tot = sum(ws)
            if tot <= 0:
                raise ConfigError("kubetitan.data.mixture_schedule_* (spec.data.mixture[].schedule)",
                                  f"every source's weight is 0 at step {step}", "give some source a positive weight there")
            exact = [w * SHARE_UNITS / tot for w in ws]
            q = [math.floor(e) for e in exact]
            for i in sorted(range(len(q)), key=lambda i: (q[i] - exact[i], i))[:SHARE_UNITS - sum(q)]:
                q[i] += 1
            self._step, self._shares = step, q
        return self._shares

    def shares_at(self, step: int) -> list[float]:
        return [q / SHARE_UNITS for q in self.shares(step)]

    def targets(self, start: int, end: int) -> list[int]:
        """``T_i`` over samples ``[start, end)``: each step's share times its samples in the range."""
        acc, g, b = [0] * len(self.schedules), start, self.samples_per_step
        while g < end:
            s = step_of(g, b)
            upto = min(end, s * b)
            acc = [a + (upto - g) * q for a, q in zip(acc, self.shares(s))]
            g = upto
        return acc

    def rebase(self) -> None:
        super().rebase()
        self._acc = [0] * len(self.schedules)

    def seek(self, g: int, counts: list[int], base_g: int | None = None, base_counts: list[int] | None = None) -> None:
        super().seek(g, counts, base_g, base_counts)
        self._acc = self.targets(self.base_g, self.g)

    def fresh(self) -> ScheduledMix:
        return ScheduledMix(self.schedules, self.samples_per_step)

    def identity(self) -> Any:
        return {"schedules": [[sch.start, sch.interpolation, [list(p) for p in sch.points]] for sch in self.schedules],
                "samples_per_step": self.samples_per_step}

    def announce(self, step: int, names: list[str], first: bool) -> str | None:
        if not first and all(step != s for sch in self.schedules for s, _ in sch.points):
            return None
        later = [s for sch in self.schedules for s, _ in sch.points if s > step]
        shares = ", ".join(f"{n} {100 * x:.1f}%" for n, x in zip(names, self.shares_at(step)))
        return (f"The mixture's weights at step {step}: {shares}; "
                + (f"the next schedule point is at step {min(later)}" if later else "no schedule point after it"))

    def next(self) -> int:
        q = self.shares(step_of(self.g, self.samples_per_step))
        best, best_deficit = 0, None
        for i in range(len(q)):
            self._acc[i] += q[i]
            d = self._acc[i] - (self.counts[i] - self.base_counts[i]) * SHARE_UNITS
            if best_deficit is None or d > best_deficit:
                best, best_deficit = i, d
        self.counts[best] += 1
        self.g += 1
        return best


def mix_for(weights_: list[float], schedules: list[WeightSchedule] | None, samples_per_step: int) -> MixSchedule:
    """The mixture schedule: constant weights (:class:`MixSchedule`), or by step when a source has schedule points."""
    if schedules and any(sch.points for sch in schedules):
        return ScheduledMix(schedules, samples_per_step)
    return MixSchedule(weights_)


def describeseed_hash(identity: Any, names: list[str]) -> str:
    """A checkpoint's mixture (:meth:`MixSchedule.identity`) in words."""
    if isinstance(identity, dict):
        return "scheduled (" + "; ".join(f"{n} {WeightSchedule(s, i, tuple(map(tuple, p))).describe()}"
                                         for n, (s, i, p) in zip(names, identity["schedules"])) + ")"
    total = sum(identity)
    return ", ".join(f"{n} {100 * w / total:.1f}%" for n, w in zip(names, identity))


@dataclass(frozen=True)
class Sample:
    """One global sample: its position in the global stream and where its tokens come from."""

    position: int
    source: int
    window: int
    epoch: int


class GlobalStream:
    """The global sample stream of a list of sources (see the module docstring); its state is the position."""

    def __init__(self, sources: list[Any], weights: list[float], seed: int, shuffled: bool,
                 mix: MixSchedule | None = None) -> None:
        self.sources = sources
        self.schedule = mix if mix is not None else MixSchedule(weights)
        self._orders = [_Order(s.windows, seed, i, shuffled and getattr(s, "shuffle", True))
                        for i, s in enumerate(sources)]

    @property
    def position(self) -> int:
        return self.schedule.g

    def take(self, n: int) -> list[Sample]:
        out = []
        for _ in range(n):
            g = self.schedule.g
            i = self.schedule.next()
            window, epoch = self._orders[i](self.schedule.counts[i] - 1)
            out.append(Sample(g, i, window, epoch))
        return out

    def tokens(self, s: Sample) -> np.ndarray:
        src = self.sources[s.source]
        return src.next_window() if getattr(src, "per_rank", False) else src.window(s.window)

    def segments(self, s: Sample) -> np.ndarray:
        """The document of each token of sample ``s`` (a source without boundaries: one document)."""
        src = self.sources[s.source]
        seg = getattr(src, "segments", None)
        return seg(s.window) if seg is not None else np.zeros(src.seq_len + 1, dtype=np.int32)

    def report(self) -> dict[str, dict[str, float]]:
        """Per source: the tokens it has given the job and its epochs (draws over its training windows: 1.5 is half
        way through its second pass; a small source repeats long before a large one)."""
        size = self.sources[0].seq_len + 1
        return {s.name: {"tokens": c * size, "epochs": c / s.windows}
                for s, c in zip(self.sources, self.schedule.counts)}

    def per_rank_sources(self) -> list[Any]:
        """The sources whose position is one per rank (streamed datasets, :class:`HubSource`)."""
        return [s for s in self.sources if getattr(s, "per_rank", False)]

    def state(self) -> dict[str, Any]:
        sch = self.schedule
        return {"consumed_samples": sch.g, "source_draws": list(sch.counts), "sources": [s.name for s in self.sources],
                "weights": sch.identity(), "base_position": sch.base_g, "base_draws": list(sch.base_counts)}

    def restore(self, state: dict[str, Any]) -> str | None:
        """Continue at the checkpoint's position; a line to log when the mixture's weights changed there (they
        apply from this position on), else None."""
        g = int(state["consumed_samples"])
        draws = [int(c) for c in state.get("source_draws", [])]
        names = [s.name for s in self.sources]
        if state.get("sources") == names and len(draws) == len(self.sources) and sum(draws) == g:
            sch = self.schedule
            saved_w = state.get("weights")  # absent in checkpoints written before it: the same weights assumed
            if saved_w is None or saved_w == sch.identity():
                base = [int(c) for c in state.get("base_draws", [])]
                if len(base) == len(draws):
                    sch.seek(g, draws, int(state.get("base_position", 0)), base)
                else:
                    sch.seek(g, draws)
                return None
            sch.seek(g, draws)
            sch.rebase()
            return (f"The mixture's weights changed at global sample {g}: {describeseed_hash(saved_w, names)} before, "
                    f"{describeseed_hash(sch.identity(), names)} from here on (each source's draws continue where they "
                    "were)")
        # The sources changed between the save and this run: replay the new schedule to the saved position.
        logger.warning(f"The data sources changed since the checkpoint ({state.get('sources')} -> "
                       f"{[s.name for s in self.sources]}): continuing at global sample {g} of the new mixture")
        self.schedule = self.schedule.fresh()
        for _ in range(g):
            self.schedule.next()


def rank_slice(consumed: int, micro_batch: int, dp_rank: int, dp_world_size: int, local_batch: int) -> range:
    """Global positions rank ``dp_rank`` trains in its ``micro_batch``-th micro-batch after position ``consumed``."""
    start = consumed + micro_batch * dp_world_size * local_batch + dp_rank * local_batch
    return range(start, start + local_batch)
