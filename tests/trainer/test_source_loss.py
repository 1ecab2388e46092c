"""Per-source losses and document masking, in process on a tiny model (no process group, no training loop): the
per-sample loss and its sums by source, the document boundaries a window reads from the ``.idx``, the loader's tags,
the block-causal masks built from them (and their CPU path, which trains), the metrics, and the validator's clock.
The real trainer's use of them is shown by test_ledger.py (a two-source mixture at DP 2 -> 1 -> 3)."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kubetitan_core import contract
from kubetitan_trainer import doc_mask, source_loss
from kubetitan_trainer.data import loaders as data
from kubetitan_trainer.data.stream import GlobalStream
from kubetitan_trainer.flavours import KubetitanModelArgs
from kubetitan_trainer.metrics import Exporter


def _job(compile_loss: bool = False) -> SimpleNamespace:
    return SimpleNamespace(compile=SimpleNamespace(enable=compile_loss, components=["loss"], backend="inductor"))


def test_the_loss_by_source_is_the_loss_split_by_each_samples_source():
    """Tagged, the loss is the sum of per-sample cross entropies (torchtitan's loss to float rounding), and each
    source's stats are its samples' sums and valid tokens; untagged, it is torchtitan's loss unchanged."""
    torch.manual_seed(0)
    pred, labels = torch.randn(4, 9, 50), torch.randint(0, 50, (4, 9))
    labels[3, :4] = -100  # ignored tokens count for no source
    loss = source_loss.SourceLoss(_job())
    plain = loss(pred, labels)
    assert plain.item() == pytest.approx(F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1), reduction="sum",
                                                         ignore_index=-100).item(), rel=1e-6)
    stats = source_loss.SourceStats(["web", "code"])
    loss.tag(torch.tensor([0, 1, 1, 0]), stats)
    tagged = loss(pred, labels)
    assert tagged.item() == pytest.approx(plain.item(), rel=1e-5)
    per_token = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1), reduction="none", ignore_index=-100).view(4, 9)
    got = stats.losses()
    assert got["web"]["loss_tokens"] == 9 + 5 and got["code"]["loss_tokens"] == 18
    assert got["web"]["loss"] == pytest.approx((per_token[0].sum() + per_token[3].sum()).item() / 14, rel=1e-6)
    assert got["code"]["loss"] == pytest.approx(per_token[1:3].sum().item() / 18, rel=1e-6)
    assert loss(pred, labels).item() == plain.item()  # a tag holds for one batch only
    stats.reset()
    assert stats.losses() == {"web": {"loss_tokens": 0}, "code": {"loss_tokens": 0}}  # no loss for no tokens


def test_a_window_reads_its_document_boundaries_from_the_idx(tmp_path):
    """ShardSet.segments: the document of each token of any span, across shards, from the .idx files."""
    from kubetitan_trainer.data import prepare
    from kubetitan_trainer.data.shards import ShardSet

    src = tmp_path / "in.txt"
    src.write_text("".join(f"document {i} " + "word " * (i % 13) + "\n" for i in range(120)))
    assert prepare.main([str(src), "-o", str(tmp_path / "s"), "--shard-tokens", "200", "--workers", "1",
                         "--no-progress"]) == 0
    ss = ShardSet.open(tmp_path / "s", verify="lazy")
    assert len(ss.shards) > 3
    starts = np.unique(np.concatenate([ss.document_offsets(i) for i in range(len(ss.shards))]))
    for offset, n in ((0, 50), (190, 40), (3, ss.total_tokens - 3), (ss.total_tokens - 7, 7)):
        want = np.searchsorted(starts, np.arange(offset, offset + n), side="right") - np.searchsorted(
            starts, offset, side="right")
        assert ss.segments(offset, n).tolist() == want.tolist(), (offset, n)


class _Docs:
    """A source whose windows hold a document boundary at a fixed place: tokens 0..8, segments 0,0,0,1,1,1,1,1,1."""

    seq_len, windows, name = 8, 10, "docs"

    def window(self, k: int) -> np.ndarray:
        return np.arange(9) + 10 * k

    def segments(self, k: int) -> np.ndarray:
        return np.array([0, 0, 0, 1, 1, 1, 1, 1, 1], dtype=np.int32)


def test_the_loader_tags_samples_with_their_source_and_their_documents():
    other = _Docs()
    other.name = "other"
    stream = GlobalStream([_Docs(), other], [1.0, 1.0], seed=0, shuffled=False)
    ld = data.GlobalDataLoader(stream, dp_rank=1, dp_world_size=2, local_batch=2, tag_sources=True, segments=True)
    inputs, labels = next(iter(ld))
    assert inputs[data.SOURCE_KEY].tolist() == [0, 1]  # samples 2 and 3 of the stream: rank 1's two
    assert inputs[data.SEGMENT_KEY].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]] * 2  # the input tokens' documents
    assert stream.report() == {"docs": {"tokens": 18, "epochs": 0.2}, "other": {"tokens": 18, "epochs": 0.2}}
    plain = next(iter(data.GlobalDataLoader(GlobalStream([_Docs()], [1.0], 0, False), dp_rank=0,
                                            dp_world_size=1, local_batch=1)))[0]
    assert set(plain) == {"input"}  # one source, no masking: no tags


def _model(attn: str) -> doc_mask.DocumentMaskedTransformer:
    args = KubetitanModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, multiple_of=16)
    if attn == "document":
        args.attn_type, args.attn_mask_type = "flex", "block_causal"
    torch.manual_seed(0)
    m = doc_mask.DocumentMaskedTransformer(args)
    with torch.no_grad():
        m.init_weights(buffer_device=None)
    return m


def test_document_masking_keeps_each_document_from_seeing_the_one_before_and_trains_on_cpu():
    """With the block-causal mask from the segments, the outputs of the second document do not depend on the first
    document's tokens (they do with plain causal attention); on CPU the masked model has a backward; the loader's tags
    pass through forward."""
    tokens = torch.randint(2, 64, (2, 12))
    segments = torch.tensor([[0] * 5 + [1] * 7, [0] * 12], dtype=torch.int32)
    changed = tokens.clone()
    changed[0, :5] = (changed[0, :5] + 7) % 62 + 2  # another first document
    for attn in ("document", "causal"):
        m = _model(attn)
        extra = {data.SEGMENT_KEY: segments}
        masks = m.get_attention_masks(tokens, None, extra) if attn == "document" else None
        out = m(tokens, masks, **extra)
        out2 = m(changed, m.get_attention_masks(changed, None, extra) if attn == "document" else None, **extra)
        same = torch.allclose(out[0, 5:], out2[0, 5:], atol=1e-6)
        assert same is (attn == "document"), attn
        assert torch.equal(out[1], out2[1])
        if attn == "document":
            assert isinstance(m.layers["0"].attention.inner_attention, doc_mask.DenseMaskAttention)
            out.sum().backward()  # FlexAttention has no backward on CPU; the dense path does
            assert m.layers["0"].attention.wq.weight.grad is not None
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        _model("causal")(tokens, None, labels=tokens)


def test_document_masking_is_torchtitans_flex_switch_in_the_model_args():
    job = SimpleNamespace(training=SimpleNamespace(seq_len=16), parallelism=SimpleNamespace(context_parallel_degree=1),
                          kubetitan=SimpleNamespace(data=SimpleNamespace(attention_mask="document")))
    args = KubetitanModelArgs()
    args.update_from_config(job)
    assert (args.attn_type, args.attn_mask_type, args.max_seq_len) == ("flex", "block_causal", 16)
    job.kubetitan.data.attention_mask = "causal"
    args = KubetitanModelArgs()
    args.update_from_config(job)
    assert (args.attn_type, args.attn_mask_type) == ("sdpa", "causal")


def test_per_source_metrics_appear_with_their_first_values():
    ex = Exporter(peak_flops=None, total_steps=10, attempt=0, job_start=time.time())
    from prometheus_client import generate_latest

    text = generate_latest(ex.registry).decode()
    assert contract.M_SOURCE_LOSS not in text and contract.M_SOURCE_EVAL_LOSS not in text
    ex.source_losses({"web": 2.5, "code": 1.25})
    ex.source_eval_losses({"web": 2.75})
    ex.data_epochs({"web": 0.5, "code": 3.0})
    text = generate_latest(ex.registry).decode()
    for line in (f'{contract.M_SOURCE_LOSS}{{source="web"}} 2.5', f'{contract.M_SOURCE_LOSS}{{source="code"}} 1.25',
                 f'{contract.M_SOURCE_EVAL_LOSS}{{source="web"}} 2.75', f'{contract.M_DATA_EPOCHS}{{source="code"}} 3.0'):
        assert line in text, text


def test_an_evaluation_leaves_the_next_steps_throughput_interval_without_its_own_time(monkeypatch):
    """torchtitan's log_validation restarts the processor's token counter and clock; the validator puts the
    interval back, minus the evaluation's time (it used to add that time to the restarted clock: the next step's
    tokens/s came out negative)."""
    from torchtitan.components.validate import Validator

    from kubetitan_trainer.evaluation import KubetitanValidator

    mp = SimpleNamespace(ntokens_since_last_log=512, time_last_log=time.perf_counter() - 2.0)

    def torchtitans_validate(self, model_parts, step):  # what its loop and log_validation do to the processor
        time.sleep(0.05)
        mp.ntokens_since_last_log, mp.time_last_log = 0, time.perf_counter()

    monkeypatch.setattr(Validator, "validate", torchtitans_validate)
    v = object.__new__(KubetitanValidator)
    v.metrics_processor, v.source_stats = mp, None
    before = mp.time_last_log
    v.validate([], 1)
    assert mp.ntokens_since_last_log == 512
    assert 0.05 <= mp.time_last_log - before < 1.0 and mp.time_last_log < time.perf_counter()
    assert not math.isnan(json.loads(json.dumps(mp.time_last_log)))
