"""Unit tests of the trainer's pure parts: config table, flavours, data sources, MFU, launcher logic."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kubetitan_core import contract, render
from kubetitan_core.api import LlamaPretrain
from kubetitan_core.catalog import ACCELERATORS, FLAVOURS

from kmockx.harness import free_port
from support.paths import EXAMPLES, load_example
from support.specs import tiny_lpt, write_config

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def parse(path: Path):
    from kubetitan_trainer.main import load_config

    return load_config(["--job.config_file", str(path)])


def test_job_config_module_is_torch_free():
    code = "import sys, kubetitan_trainer.job_config, kubetitan_core.render; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([PY, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_is_accepted_by_the_trainer_config_loader(example, tmp_path):
    """Contract: what the planner renders is what torchtitan's ConfigManager (with our table) accepts."""
    obj = LlamaPretrain.model_validate(load_example(example))
    path = tmp_path / contract.CONFIG_KEY
    path.write_text(render.trainer_toml(obj))
    cfg = parse(path)
    table = render.trainer_config(obj)["kubetitan"]
    assert cfg.model.name == render.TRAIN_SPEC_NAME
    assert cfg.kubetitan.job_name == obj.metadata.name
    assert cfg.kubetitan.data.source == table["data"]["source"] == obj.spec.data.source
    assert cfg.kubetitan.tokenizer.source == obj.spec.tokenizer.source
    assert cfg.kubetitan.metrics_port == obj.spec.monitoring.metrics_port
    assert cfg.kubetitan == render.kubetitan_table(obj)  # every key the renderer decided reaches the trainer
    from kubetitan_trainer.flavours import model_args_for

    assert model_args_for(cfg).dim > 0  # the flavour exists in the TrainSpec's table


@pytest.mark.parametrize("flavour", sorted(FLAVOURS), ids=sorted(FLAVOURS))
def test_catalog_dims_match_registered_model_args(flavour):
    from torchtitan.protocols.train_spec import get_train_spec

    import kubetitan_trainer.train_spec  # noqa: F401

    tt_name, dims = FLAVOURS[flavour]
    args = get_train_spec(render.TRAIN_SPEC_NAME).model_args[tt_name]
    got = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim_multiplier", "multiple_of", "rope_theta", "vocab_size")}
    want = dict(dims.__dict__)
    if got["n_kv_heads"] is None:
        got["n_kv_heads"] = got["n_heads"]
    assert got == want


def test_custom_flavour_takes_dims_from_the_kubetitan_table(tmp_path):
    obj = tiny_lpt({"model": {"flavor": "custom", "custom": {"dim": 128, "nLayers": 2, "nHeads": 4, "nKvHeads": 2, "vocabSize": 1024}}})
    cfg = parse(write_config(tmp_path / "t.toml", obj, tmp_path))
    from kubetitan_trainer.flavours import model_args_for

    a = model_args_for(cfg)
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size) == (128, 2, 4, 2, 1024)


# ----------------------------------------------------------------------------- data sources
def test_synthetic_windows_are_a_function_of_seed_and_index():
    from kubetitan_trainer.data.stream import SyntheticSource

    a, b = SyntheticSource(2048, 32, seed=1), SyntheticSource(2048, 32, seed=1)
    assert np.array_equal(a.window(5), b.window(5)) and a.window(5).shape == (33,)
    assert not np.array_equal(a.window(5), a.window(6))
    assert not np.array_equal(a.window(5), SyntheticSource(2048, 32, seed=2).window(5))
    assert int(a.window(5).max()) < 2048


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    src = out / "docs.jsonl"
    src.write_text("".join(json.dumps({"body": f"Doc {i}: Ada has a red fox near the river. " * 3}) + "\n" for i in range(200)))
    from kubetitan_trainer.data.prepare import main

    assert main([str(src), "-o", str(out / "s"), "--text-field", "body", "--shard-tokens", "1000"]) == 0
    return out / "s"


def test_prepare_data_writes_shards_and_index(shards):
    index = json.loads((shards / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["documents"] == 200
    assert len(index["files"]) >= 3  # 1000-token shards
    assert sum(f["tokens"] for f in index["files"]) == index["total_tokens"]
    for f in index["files"]:
        assert (shards / f["name"]).stat().st_size == 2 * f["tokens"]
    tokens = np.concatenate([np.fromfile(shards / f["name"], dtype=np.uint16) for f in index["files"]])
    assert (tokens == index["eos_id"]).sum() == 200  # one EOS per document


def test_shard_windows_read_the_concatenated_stream_across_files(shards):
    from kubetitan_trainer.data.loaders import open_shards
    from kubetitan_trainer.data.stream import WindowSource

    index = json.loads((shards / "index.json").read_text())
    stream = np.concatenate([np.fromfile(shards / f["name"], dtype=np.uint16) for f in index["files"]]).astype(np.int64)
    src = WindowSource("s", open_shards(str(shards), "kubetitan.data.shards_path"), 16)
    assert src.windows == len(stream) // 17 and src.held_out_windows == 0
    for k in range(src.windows):  # windows 58.., 117.. span two 1000-token files
        assert np.array_equal(src.window(k), stream[k * 17:(k + 1) * 17])


def test_shards_dtype_mismatch_is_a_config_error(shards):
    from kubetitan_trainer.data.loaders import open_shards
    from kubetitan_trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="uint16"):
        open_shards(str(shards), "kubetitan.data.shards_path (spec.data.shards.path)", dtype="uint32")


def test_huggingface_source_reads_a_local_jsonl_and_resumes(tmp_path):
    from kubetitan_trainer.data.loaders import KubetitanHFTextDataset
    from kubetitan_trainer.data.tokenizer import BUILTIN_TOKENIZER
    from kubetitan_trainer.job_config import KubetitanData
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"content": f"Milo has {i} green owls in the garden."}) + "\n" for i in range(40)))
    tok = HuggingFaceTokenizer(str(BUILTIN_TOKENIZER))
    cfg = KubetitanData(source="huggingface", hf_dataset=str(src), hf_streaming=False, hf_text_field="content")
    r0 = KubetitanHFTextDataset(cfg, tok, 16, 0, 2)
    r1 = KubetitanHFTextDataset(cfg, tok, 16, 1, 2)
    assert len(r0._data) == len(r1._data) == 20  # split by DP rank
    it = iter(r0)
    [next(it) for _ in range(3)]
    state = r0.state_dict()
    want = next(it)
    again = KubetitanHFTextDataset(cfg, tok, 16, 0, 2)
    again.load_state_dict(state)
    got = next(iter(again))
    assert got[0]["input"].tolist() == want[0]["input"].tolist()


# ----------------------------------------------------------------------------- metrics
@pytest.mark.parametrize(
    ("flops_per_token", "tps", "peak", "want"),
    [(6e9, 8000.0, 989.4e12, 6e9 * 8000 / 989.4e12), (1e6, 0.0, 312e12, 0.0), (1e6, 10.0, None, None)],
    ids=["8B-class-on-H100", "idle", "cpu-no-peak"],
)
def test_mfu_formula(flops_per_token, tps, peak, want):
    from kubetitan_trainer.metrics import mfu_ratio

    got = mfu_ratio(flops_per_token, tps, peak)
    assert got == pytest.approx(want) if want is not None else got is None


@pytest.mark.parametrize(
    ("device", "product", "want"),
    [("NVIDIA H100 80GB HBM3", "", "H100"), ("NVIDIA H200", "", "H200"), ("NVIDIA A100-SXM4-80GB", "", "A100"),
     (None, "L40S", "L40S"), (None, "", None), ("Some Other GPU", "", None)],
    ids=["h100", "h200", "a100", "spec-product", "cpu", "unknown"],
)
def test_peak_flops_by_device_name(device, product, want):
    from kubetitan_trainer.metrics import peak_flops_for

    got = peak_flops_for(device, product)
    assert got == (ACCELERATORS[want].peak_bf16_tflops * 1e12 if want else None)


def test_exported_metrics_pass_promtool():
    from prometheus_client import generate_latest

    from kubetitan_trainer.metrics import Exporter

    ex = Exporter(peak_flops=989.4e12, total_steps=10, attempt=2, job_start=1.7e9)
    ex.step_done(3, 0.5)
    ex.set_loss(2.5)  # the loss appears with the first logged step
    ex.tokens_seen(1000)
    ex.checkpoint_saved(3, 1.2)
    from types import SimpleNamespace  # a failing save's counts (storage.SaveBudget's fields): the info series appears

    ex.checkpoint_saves(SimpleNamespace(budget=3, total_failed=1, in_a_row=1, last_error_class="ENOSPC",
                                        failed_steps=[4]))
    ex.inprocess_restart("NonFiniteLoss")  # the series appears with the first in-process restart
    ex.data_loading.observe(0.001)
    ex.data_tokens({"code": 4096, "web": 1024})  # per-source series appear with the first micro-batch
    ex.data_weights({"code": 0.75, "web": 0.25})
    ex.data_epochs({"code": 1.5, "web": 0.25})
    ex.source_losses({"code": 2.25, "web": 2.75})  # a mixture's per-source losses with the first logged step
    ex.source_eval_losses({"code": 2.5, "web": 3.0})
    ex.eval_done(3, 2.7)  # the eval series with the first evaluation
    from kubetitan_trainer.recovery.anatomy import Recorder

    ex.startup(Recorder({"restarts": 0, "failures": [], "started": 1.0}, now=2.0).first_step_ends(4, 2, t=3.0))
    text = generate_latest(ex.registry).decode()
    for name in [v for k, v in vars(contract).items() if k.startswith("M_")]:
        assert f"\n{name}" in "\n" + text, name
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr



def test_the_first_step_timestamp_is_set_once_by_the_first_step():
    from kubetitan_trainer.metrics import Exporter

    ex = Exporter(peak_flops=None, total_steps=10, attempt=0, job_start=1.7e9)
    first = ex.registry.get_sample_value
    assert first(contract.M_FIRST_STEP_TIMESTAMP) == 0.0  # before any step
    ex.step_done(5, 0.5)
    t1 = first(contract.M_FIRST_STEP_TIMESTAMP)
    assert t1 > 0 and t1 == first(contract.M_LAST_STEP_TIMESTAMP)
    ex.step_done(6, 0.5)
    assert first(contract.M_FIRST_STEP_TIMESTAMP) == t1 <= first(contract.M_LAST_STEP_TIMESTAMP)


def test_async_checkpoint_is_published_when_its_background_write_ends():
    """The newest-checkpoint gauges name only complete checkpoints: an async save's step shows once
    its write future ends, and a failed write never shows (resume would skip that step too)."""
    from concurrent.futures import Future

    from kubetitan_trainer.metrics import Exporter

    ex = Exporter(peak_flops=None, total_steps=10, attempt=0, job_start=1.7e9)
    ex.checkpoint_saved(2, 0.3)  # synchronous: complete on return
    assert (ex.ckpt_step._value.get(), ex.ckpt_duration._sum.get()) == (2, pytest.approx(0.3))
    ok, bad = Future(), Future()
    ex.checkpoint_saved(4, 0.05, ok)
    assert ex.ckpt_step._value.get() == 2 and ex.ckpt_duration._sum.get() == pytest.approx(0.35)
    ok.set_result(None)
    assert ex.ckpt_step._value.get() == 4 and ex.ckpt_ts._value.get() > 1.7e9
    ex.checkpoint_saved(6, 0.05, bad)
    bad.set_exception(OSError("disk full"))
    assert ex.ckpt_step._value.get() == 4


# CPU staging options (pinned memory and non-blocking copies need an accelerator): the code path that
# torch 2.11 breaks, DefaultStager._stage closing its StateDictStager, is the same.
def _cpu_staging():
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                          use_non_blocking_copy=False)


def test_torch_default_stager_still_stages_only_once():
    """Canary for kubetitan_trainer/recovery/staging.py: when the pinned torch can stage twice with one
    DefaultStager (pytorch PR 183424), this fails; then delete the shim and this test."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager

    stager = DefaultStager(_cpu_staging())
    state = {"w": torch.arange(4.0), "train_state": {"step": 1}}
    stager.stage(state).result()
    with pytest.raises(KeyError):
        stager.stage(state).result()
    stager.close()


def test_reusable_stager_stages_every_save_and_keeps_its_buffers(tmp_path):
    """Three async DCP saves through one ReusableStager (as torchtitan keeps one for the run): each is
    complete and holds that save's values, the staging buffer is reused, and close releases it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from kubetitan_trainer.recovery.staging import ReusableStager

    stager = ReusableStager(_cpu_staging())
    w = torch.zeros(1000)
    buffers = set()
    for step in (1, 2, 3):
        w.fill_(step)
        res = dcp.async_save({"w": w, "train_state": {"step": step}}, checkpoint_id=tmp_path / f"step-{step}",
                             async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=stager)
        res.upload_completion.result()
        buffers |= {s.data_ptr() for s in stager._state_dict_stager._cached_storage_mapping.values()}
    assert len(buffers) == 1, "each save allocated a new staging buffer"
    for step in (1, 2, 3):
        got = {"w": torch.empty(1000), "train_state": {"step": 0}}
        dcp.load(got, checkpoint_id=tmp_path / f"step-{step}")
        assert got["train_state"]["step"] == step and bool((got["w"] == step).all())
    stager.close()
    assert len(stager._state_dict_stager._cached_storage_mapping) == 0


def test_pinned_checkpoints_get_the_reusable_stager_once():
    from torch.distributed.checkpoint.staging import DefaultStager
    from torchtitan.components.checkpoint import AsyncMode

    from kubetitan_trainer.recovery.staging import ReusableStager, ensure_reusable_stager

    pinned = SimpleNamespace(async_mode=AsyncMode.ASYNC_WITH_PINNED_MEM, stager=None)
    ensure_reusable_stager(pinned, _cpu_staging())
    first = pinned.stager
    ensure_reusable_stager(pinned, _cpu_staging())
    assert isinstance(first, ReusableStager) and pinned.stager is first
    other = SimpleNamespace(async_mode=AsyncMode.ASYNC, stager=None)
    ensure_reusable_stager(other, _cpu_staging())
    assert other.stager is None
    assert issubclass(ReusableStager, DefaultStager)  # torchtitan calls its close() on shutdown
    first.close()


# ----------------------------------------------------------------------------- launcher
def _failure(code, ts):
    return SimpleNamespace(exitcode=code, timestamp=ts, message="")


@pytest.mark.parametrize(
    ("failures", "want"),
    [({0: _failure(3, 10), 1: _failure(-15, 10)}, 3), ({0: _failure(-15, 11), 1: _failure(2, 10)}, 2),
     ({0: _failure(75, 10), 1: _failure(75, 10)}, 75), ({0: _failure(-9, 10)}, 137), ({}, 1)],
    ids=["self-exit-beats-killed-on-tie", "earliest-wins", "all-checkpointed", "signal-to-shell-code", "none"],
)
def test_launcher_takes_the_failing_workers_exit_code(failures, want):
    from kubetitan_trainer.launch.failures import exit_code_of

    assert exit_code_of(failures) == want


@pytest.mark.parametrize(("message", "want"), [
    ({"message": "ConfigError: x. Fix: y", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n..."}},
     "ConfigError: x. Fix: y"),
    ("Signal 9 (SIGKILL) received by PID 12", "Signal 9 (SIGKILL) received by PID 12"),
], ids=["error-file-without-its-call-stack", "plain-message"])
def test_launcher_logs_a_failed_workers_message_without_the_call_stack(message, want):
    from kubetitan_trainer.launch.failures import failure_summary

    assert failure_summary(message) == want


def test_launcher_waits_for_dns_then_gives_up():
    from kubetitan_trainer.launch.launcher import wait_for_dns

    calls = []

    def resolve_after_three(host, port):
        calls.append(host)
        if len(calls) < 3:
            raise socket.gaierror("not yet")

    assert wait_for_dns("m.svc", 1, timeout=60, sleep=lambda s: None, resolve=resolve_after_three)
    assert len(calls) == 3

    def never(host, port):
        raise socket.gaierror("nope")

    assert not wait_for_dns("m.svc", 1, timeout=0, sleep=lambda s: None, resolve=never)


BAD = [
    ("unknown-flavour", {"model": {"flavor": "nope"}}, "model.flavor"),
    ("degrees-vs-world", {"parallelism": {"data_parallel_shard_degree": 4}}, "parallelism.data_parallel_shard_degree"),
    ("fp8-on-cpu-without-emulate", {"model": {"converters": ["quantize.linear.float8"]}}, "quantize.linear.float8.emulate"),
    ("fp8-emulate-with-compile", {"model": {"converters": ["quantize.linear.float8"]}, "compile": {"enable": True},
                                  "quantize.linear.float8": {"emulate": True}}, "compile.enable"),
    ("shards-missing", {"kubetitan.data": {"source": "shards", "shards_path": "/nonexistent"}}, "kubetitan.data.shards_path"),
    ("tokenizer-path-missing", {"kubetitan.tokenizer": {"source": "path", "path": "/nonexistent"}}, "kubetitan.tokenizer.path"),
    ("global-batch", {"training": {"global_batch_size": 5}}, "training.global_batch_size"),
    ("unknown-key", {"training": {"no_such_key": 1}}, "no_such_key"),
]


def _patched(tmp_path, patch):
    import tomllib

    import tomli_w

    path = write_config(tmp_path / "t.toml", tiny_lpt(), tmp_path / "dump")
    cfg = tomllib.loads(path.read_text())
    for section, values in patch.items():
        node = cfg
        for part in section.split("."):
            node = node.setdefault(part, {})
        node.update(values)
    path.write_text(tomli_w.dumps(cfg))
    return path


@pytest.mark.parametrize(("name", "patch", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_configs_are_config_errors_naming_the_field(name, patch, field, tmp_path, caplog):
    from kubetitan_trainer.main import check_config

    with caplog.at_level("ERROR"):
        assert check_config(["--job.config_file", str(_patched(tmp_path, patch))], 2) == contract.ExitCode.CONFIG_ERROR
    assert field in caplog.text and "Fix:" in caplog.text


# the launcher as a pod runs it, and once with CUDA reported initialised in it (NVML could not answer): then it
# starts the workers as new processes (spawn: cold interpreters, each importing torch) instead of forking them; the
# exit code is the workers' either way. The launcher itself is forked from the tests' warm parent (support.warm). The
# spawned case starts one worker, not two: each cold interpreter costs ~4 CPU s and a second adds nothing to check.
@pytest.mark.parametrize("start", ["forked", "spawned-when-cuda-is-initialised"])
def test_launcher_process_exits_2_on_a_bad_config(start, tmp_path):
    from support import warm

    path = _patched(tmp_path, {"model": {"flavor": "nope"}})
    module = "kubetitan_trainer.launch" if start == "forked" else "tests.trainer.launch_as_if_cuda"
    log = tmp_path / "launch.log"
    nproc = 2 if start == "forked" else 1
    proc = warm.popen(module, [f"--config={path}", "--nnodes=1", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
                               f"--master-port={free_port()}", "--max-restarts=0"],
                      {**os.environ, "OMP_NUM_THREADS": "1"}, log, cwd=REPO)
    code = warm.wait_all([proc], timeout=300)[0]
    out = log.read_text(errors="replace")  # the launcher's and the workers' stdout and stderr
    assert code == 2, out[-2000:]
    # the workers check the config (the launcher only checks the file exists) and log to stdout
    assert "model.flavor" in out and "Fix:" in out
    assert "Training starts" not in out  # stopped before any training
    assert ("starting the workers as new processes" in out) == (start != "forked")
    assert ("Warm workers: imported torch/torchtitan once" in out) == (start == "forked")


def test_launcher_exits_2_on_a_missing_config(tmp_path):
    r = subprocess.run(
        [PY, "-m", "kubetitan_trainer.launch", f"--config={tmp_path / 'absent.toml'}", "--nnodes=1", "--master-addr=127.0.0.1"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert r.returncode == 2 and "does not exist" in r.stderr and "Fix:" in r.stderr


@pytest.mark.parametrize(("recipe", "want"), [("tensorwise", None), ("rowwise", "rowwise")], ids=["tensorwise", "rowwise"])
def test_float8_recipe_rendering_matches_torchtitan_paths(recipe, want, tmp_path):
    """tensorwise must render without recipe_name: torchtitan's recipe path rejects FP8 all-gather."""
    obj = tiny_lpt({"precision": {"compile": False, "activationCheckpointing": "none", "mixedPrecisionParam": "float32",
                             "float8": {"enabled": True, "recipe": recipe, "emulate": True,
                                        "fsdpFloat8AllGather": recipe == "tensorwise"}}})
    cfg = parse(write_config(tmp_path / "t.toml", obj, tmp_path))
    assert cfg.quantize.linear.float8.recipe_name == want
    from kubetitan_trainer.checks import check

    check(cfg, 2, cuda=False)  # accepted


def test_local_run_gives_the_trainer_the_specs_plain_env_values():
    """`kubetitan run` passes spec.resources.env to the trainer as a pod would (the 3B H200 recipe's
    Inductor setting travels that way); valueFrom entries need a cluster and are left out."""
    from kubetitan_trainer.local import spec_env

    env = [{"name": "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "value": "1"},
           {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    assert spec_env(tiny_lpt({"resources": {"env": env}})) == {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}
    assert spec_env(tiny_lpt()) == {}


@pytest.mark.parametrize(
    ("codes", "stop", "want"),
    [({1: -9}, False, True), ({0: 1}, False, True), ({0: 2}, False, False), ({0: 75, 1: -15}, False, False),
     ({0: -9}, True, False)],
    ids=["killed-worker", "crashed-worker", "config-error", "stop-checkpointed", "sigterm-stop-requested"],
)
def test_in_place_restart_only_for_failures_a_restart_can_cure(codes, stop, want):
    from kubetitan_trainer.launch.failures import restartable

    assert restartable({r: _failure(c, 10) for r, c in codes.items()}, stop) is want


def test_in_place_launcher_uses_a_c10d_rendezvous_hosted_by_node_rank_0_and_forks_workers():
    from kubetitan_trainer.launch.launcher import parse_args, torchrun_argv

    base = ["--config=c.toml", "--nnodes=2", "--master-addr=m.svc", "--master-port=29500", "--rdzv-id=r"]
    static = torchrun_argv(parse_args([*base, "--max-restarts=0"]))
    assert "--rdzv-backend=static" in static and "--max-restarts=0" in static
    for rank, host in ((0, "true"), (1, "false")):
        argv = torchrun_argv(parse_args([*base, f"--node-rank={rank}", "--max-restarts=3"]))
        assert {"--rdzv-backend=c10d", "--rdzv-endpoint=m.svc:29500", f"--rdzv-conf=is_host={host}",
                "--max-restarts=3", "--start-method=fork"} <= set(argv)


def test_the_posted_worker_failure_that_is_not_collateral_begins_the_next_generation():
    """Each launcher whose worker failed posts it to the rendezvous store; rank 0 reads the one that began the
    generation: not the generic exit 1 of a peer whose collective broke, even when that was posted first."""
    from torch.distributed import HashStore

    from kubetitan_trainer.launch.store import earliest_failure, post_failure

    store = HashStore()
    assert earliest_failure(store, 0, 2) is None
    post_failure(store, 0, 0, {0: _failure(1, 100)})  # rank 0's worker failed on the broken collective, seen first
    post_failure(store, 0, 1, {0: _failure(-9, 100)})  # rank 1's worker was SIGKILLed: the cause
    got = earliest_failure(store, 0, 2)
    assert (got.exit_code, got.node_rank, got.local_rank) == (137, 1, 0)
    assert earliest_failure(store, 1, 2) is None  # generation 1 has failed nowhere yet
    post_failure(store, 1, 1, {0: _failure(1, 200)})  # two generic failures: the earlier one
    post_failure(store, 1, 0, {0: _failure(1, 200)})
    assert earliest_failure(store, 1, 2).node_rank == 1


def test_rendezvous_timeout_from_the_operator_reaches_torchrun():
    """The operator's --rdzv-timeout (its scheduling wait + start-up allowance) becomes torchrun's rendezvous
    timeout on both launcher paths, so rank 0 outwaits a partly scheduled gang; without it torch's default."""
    from kubetitan_trainer.launch.launcher import parse_args, torchrun_argv

    base = ["--config=c.toml", "--nnodes=2", "--master-addr=m.svc", "--max-restarts=0", "--rdzv-timeout=2700"]
    assert "--rdzv-conf=timeout=2700" in torchrun_argv(parse_args(base))
    assert "--rdzv-conf=is_host=true,join_timeout=2700" in torchrun_argv(parse_args([*base, "--max-restarts=2"]))
    assert not any(a.startswith("--rdzv-conf") for a in torchrun_argv(parse_args(base[:-1])))


def test_compile_cache_lives_under_the_dump_folder_keyed_by_versions_gpu_and_config(tmp_path):
    import tomli_w

    from kubetitan_trainer.compile import compile_cache

    def cfg(name, **tables):
        p = tmp_path / name
        p.write_text(tomli_w.dumps({"job": {"dump_folder": str(tmp_path / "ck")}, **tables}))
        return str(p)

    on = {"compile": {"enable": True}, "model": {"flavor": "3B"}, "parallelism": {"data_parallel_shard_degree": 1}}
    env: dict[str, str] = {}
    root = compile_cache.configure(cfg("a.toml", **on), env, gpus=["NVIDIA H200"])
    assert root is not None and root.startswith(str(tmp_path / "ck" / "compile-cache"))
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{root}/inductor" and env["TRITON_CACHE_DIR"] == f"{root}/triton"
    # the same config on the same GPU model finds the same folder (a re-created gang starts warm) ...
    assert compile_cache.configure(cfg("b.toml", **on), {}, gpus=["NVIDIA H200"]) == root
    # ... another GPU model or another parallelism does not
    assert compile_cache.configure(cfg("c.toml", **on), {}, gpus=["NVIDIA H100 80GB HBM3"]) != root
    other = {**on, "parallelism": {"data_parallel_shard_degree": 2}}
    assert compile_cache.configure(cfg("d.toml", **other), {}, gpus=["NVIDIA H200"]) != root
    # compile off: nothing set; a variable the pod's env sets wins
    assert compile_cache.configure(cfg("e.toml", compile={"enable": False}), env2 := {}, gpus=[]) is None and not env2
    mine = {"TORCHINDUCTOR_CACHE_DIR": "/mine"}
    compile_cache.configure(cfg("f.toml", **on), mine, gpus=[])
    assert mine["TORCHINDUCTOR_CACHE_DIR"] == "/mine"


def test_compile_cache_reads_gpu_models_from_the_driver_without_cuda(tmp_path):
    from kubetitan_trainer.compile.compile_cache import gpu_models

    (tmp_path / "0000:01:00.0").mkdir()
    (tmp_path / "0000:01:00.0" / "information").write_text("Model: \t\t NVIDIA H200\nIRQ: 1\n")
    assert gpu_models(str(tmp_path)) == ["NVIDIA H200"]
    assert gpu_models(str(tmp_path / "none")) == []
