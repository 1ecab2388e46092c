"""kubetitan_core.contract's typed definitions, pure: the launcher's arguments (defaults from the API, argv round
trip, filled from the spec) and the in-place failure report (JSON round trip, tolerant reading)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kubetitan_core import render
from kubetitan_core.api import LlamaPretrain, LlamaPretrainSpec
from kubetitan_core.contract import ENV_RESTART_FAILURE, ExitCode
from kubetitan_core.contract.failure import FailureReport
from kubetitan_core.contract.launcher import LauncherArgs, launcher_args, parser, spec_value
from kubetitan_core.contract.trainer_toml import Kubetitan, KubetitanData, from_table, to_table

from support.paths import EXAMPLES, load_example
from support.specs import make_lpt

MIRRORED = {f.name: f.metadata["spec"] for f in dataclasses.fields(LauncherArgs) if f.metadata.get("spec")}

NON_DEFAULT = {  # a valid value other than the API default, per mirrored spec path
    "run_policy.max_in_place_restarts": ("runPolicy", "maxInPlaceRestarts", 0),
    "run_policy.hang_timeout_seconds": ("runPolicy", "hangTimeoutSeconds", 123),
    "run_policy.hang_timeout_policy": ("runPolicy", "hangTimeoutPolicy", "Fixed"),
    "checkpoint.save_timeout_seconds": ("checkpoint", "saveTimeoutSeconds", 1200),
}


def test_the_run_policy_flags_mirror_their_spec_fields():
    assert MIRRORED == {"max_restarts": "run_policy.max_in_place_restarts",
                        "hang_timeout_seconds": "run_policy.hang_timeout_seconds",
                        "hang_timeout_policy": "run_policy.hang_timeout_policy",
                        "save_timeout_seconds": "checkpoint.save_timeout_seconds"}


@pytest.mark.parametrize("name", sorted(MIRRORED))
def test_every_mirrored_launcher_default_is_the_api_default(name):
    """The launcher run by hand behaves as a pod of a default spec: the dataclass default and the parser's default
    are the API's (the launcher's save timeout was 600 s where the API's is 300 s; its in-place restarts 0 where
    the API's maxInPlaceRestarts is 3)."""
    want = spec_value(LlamaPretrainSpec(), MIRRORED[name])
    assert getattr(LauncherArgs(config="c"), name) == want
    assert getattr(LauncherArgs.from_argv(["--config=c"]), name) == want


def test_the_parser_is_the_dataclass():
    """One flag per field, no other; the parser's defaults are the dataclass's; --config is required."""
    flags = {a.dest for a in parser()._actions if a.dest != "help"}
    assert flags == {f.name for f in dataclasses.fields(LauncherArgs)}
    assert LauncherArgs.from_argv(["--config=c"]) == LauncherArgs(config="c")
    with pytest.raises(SystemExit):
        LauncherArgs.from_argv([])
    with pytest.raises(SystemExit):
        LauncherArgs.from_argv(["--config=c", "--hang-timeout-policy=Sometimes"])


@pytest.mark.parametrize("path", sorted(NON_DEFAULT))
def test_launcher_args_take_each_mirrored_field_from_the_spec(path):
    section, key, value = NON_DEFAULT[path]
    spec = LlamaPretrain.model_validate(make_lpt({section: {key: value}})).spec
    a = launcher_args(spec, config="/c", node_rank=0, master_addr="m", rdzv_id="r")
    name = next(n for n, p in MIRRORED.items() if p == path)
    assert getattr(a, name) == value != getattr(LauncherArgs(config="c"), name)
    assert LauncherArgs.from_argv(a.to_argv()) == a


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_rendered_kubetitan_table_reads_back_as_the_typed_one(example):
    """render writes the typed [kubetitan] table; read as torchtitan reads it, it is the same object, and it says
    what the run is (identity, platform, each table's source) whatever the values."""
    obj = LlamaPretrain.model_validate(load_example(example))
    typed = render.kubetitan_table(obj)
    table = render.trainer_config(obj)["kubetitan"]
    assert from_table(Kubetitan, table) == typed
    assert {"job_name", "namespace", "metrics_port", "platform", "efa_per_node", "network_fallback"} <= set(table)
    assert table["data"]["source"] == obj.spec.data.source and table["tokenizer"]["source"] == obj.spec.tokenizer.source


def test_the_kubetitan_table_leaves_out_defaults_and_refuses_unknown_keys():
    assert set(to_table(Kubetitan())) == {  # the always-written keys; metrics_host and the unused tables are not
        "job_name", "namespace", "metrics_port", "gpu_product", "instance_type", "platform", "efa_per_node",
        "network_fallback", "requested_fsdp_float8_all_gather", "requested_precompute_float8_scale", "data", "tokenizer"}
    assert to_table(KubetitanData(source="shards", shards_path="/d")) == \
        {"source": "shards", "order": "shuffled", "shards_path": "/d"}
    with pytest.raises(ValueError, match="hf_datset"):
        from_table(Kubetitan, {"data": {"hf_datset": "c4"}})


def _kubetitan(spec: dict) -> dict:
    return render.trainer_config(LlamaPretrain.model_validate(make_lpt(spec)))["kubetitan"]


def test_the_preflight_table_carries_the_pod_s_gpus_and_the_spec_s_opt_out():
    """[kubetitan.preflight] (kubetitan_trainer.preflight): the GPUs each pod requests, and `enabled = false` only
    when runPolicy.preflight is Disabled; the tests-only `inject` key is never rendered from a spec."""
    p5 = _kubetitan({"resources": {"gpusPerNode": 8, "instanceType": "p5.48xlarge", "platform": "eks"}})
    assert p5["preflight"] == {"gpus": 8} and (p5["instance_type"], p5["efa_per_node"]) == ("p5.48xlarge", 32)
    off = _kubetitan({"resources": {"gpusPerNode": 8}, "runPolicy": {"preflight": "Disabled"}})
    assert off["preflight"] == {"enabled": False, "gpus": 8}
    assert "preflight" not in _kubetitan({"resources": {"gpusPerNode": 0}})  # a CPU pod's gate: the defaults
    assert LlamaPretrainSpec().run_policy.preflight == "Enabled"
    with pytest.raises(ValueError, match="Enabled"):
        LlamaPretrain.model_validate(make_lpt({"runPolicy": {"preflight": "Off"}}))


def test_in_process_restarts_reach_the_trainer_only_with_checkpoints():
    """runPolicy.inProcessRestarts / inProcessHangSeconds -> [kubetitan] inprocess_restarts /
    inprocess_progress_timeout_seconds (kubetitan_trainer.recovery.inprocess); off by default (nothing rendered). With
    checkpoints off the spec is refused (rule in-process-restarts.need-checkpoint, tests/api/invalid_specs.yaml)."""
    on = _kubetitan({"runPolicy": {"inProcessRestarts": 3, "inProcessHangSeconds": 120}})
    assert (on["inprocess_restarts"], on["inprocess_progress_timeout_seconds"]) == (3, 120)
    default = _kubetitan({})
    assert "inprocess_restarts" not in default and "inprocess_progress_timeout_seconds" not in default
    with pytest.raises(ValueError, match="inProcessHangSeconds|in_process_hang_seconds"):
        LlamaPretrain.model_validate(make_lpt({"runPolicy": {"inProcessRestarts": 1, "inProcessHangSeconds": 5}}))


def test_launcher_args_wait_out_the_scheduling_wait_and_round_trip():
    spec = LlamaPretrain.model_validate(make_lpt({
        "resources": {"nodes": 8, "gpusPerNode": 8},
        "runPolicy": {"unschedulableTimeoutSeconds": 600, "startupTimeoutSeconds": 900}})).spec
    a = launcher_args(spec, config="/c", node_rank=3, master_addr="run-a1-0.run.ml.svc", rdzv_id="ml-run-a1")
    assert (a.nnodes, a.nproc_per_node, a.node_rank, a.dns_timeout, a.rdzv_timeout, a.monitor_interval) == \
        (8, 8, 3, 1500.0, 1500, 0.4)
    assert LauncherArgs.from_argv(a.to_argv()) == a
    local = launcher_args(spec, config="/c", node_rank=0, master_addr="127.0.0.1", rdzv_id="l", dns_timeout=5)
    assert (local.dns_timeout, local.rdzv_timeout) == (5.0, 1500)


REPORT = FailureReport(exit_code=137, node_rank=1, time=1700000000.5, local_rank=0)


@pytest.mark.parametrize("report", [
    REPORT,
    FailureReport(exit_code=int(ExitCode.HANG), node_rank=-1, time=1.0, local_rank=2, stopped=False,
                  message="step 7 stood still for 40 s (limit 30 s)", seen_by=0, previous_step=7),
], ids=["crash", "hang"])
def test_failure_report_round_trips_through_json(report):
    assert FailureReport.from_json(report.to_json()) == report
    assert FailureReport.from_env({ENV_RESTART_FAILURE: report.to_json()}) == report


def test_failure_report_reads_nothing_from_no_report_and_ignores_unknown_keys():
    assert FailureReport.from_env({}) is None  # generation 0
    for bad in ("", "not json", "[1, 2]", json.dumps({"node_rank": 1})):
        assert FailureReport.from_json(bad) is None, bad
    newer = json.dumps({**json.loads(REPORT.to_json()), "xid": 79})  # a newer launcher's extra key
    assert FailureReport.from_json(newer) == REPORT
    assert "seen_by" not in json.loads(REPORT.to_json())  # unset optional fields are left out


def test_the_contracts_closed_choices_are_the_apis_own():
    """Every ``Literal`` field of the ``[kubetitan]`` table and of the launcher's arguments is a named choice of
    ``kubetitan_core.api`` (the spec field it is rendered from has the same one), and the contract modules write no
    ``Literal[...]`` of their own: a value added to the API is one the trainer reads."""
    import ast
    import inspect
    import typing

    from kubetitan_core import api
    from kubetitan_core.contract import launcher, trainer_toml

    named = {name: v for name, v in vars(api).items() if typing.get_origin(v) is typing.Literal}
    tables = [c for c in vars(trainer_toml).values() if dataclasses.is_dataclass(c)] + [LauncherArgs]
    used = {f"{cls.__name__}.{name}": next((n for n, v in named.items() if v is hint), None)
            for cls in tables for name, hint in typing.get_type_hints(cls).items()
            if typing.get_origin(hint) is typing.Literal}
    assert used and all(used.values()), {k: v for k, v in used.items() if not v}
    for module in (trainer_toml, launcher):
        written = [n.lineno for n in ast.walk(ast.parse(inspect.getsource(module)))
                   if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "Literal"]
        assert not written, f"{module.__name__} writes its own Literal[...] at lines {written}: import it from api"
    assert typing.get_type_hints(api.DataSpec)["source"] is api.DataSource
    assert typing.get_type_hints(api.ResourcesSpec)["platform"] is api.Platform


@pytest.mark.parametrize("uri, want", [
    ("s3://bucket/a/b/", ("bucket", "a/b")), ("s3://bucket", ("bucket", "")), ("s3://b/x", ("b", "x"))])
def test_split_s3_uri(uri, want):
    from kubetitan_core.contract import is_s3_uri, split_s3_uri

    assert is_s3_uri(uri) and split_s3_uri(uri) == want


@pytest.mark.parametrize("text", ["/ckpt", "s3:///x", "S3://b/x"])
def test_split_s3_uri_refuses_what_is_no_s3_uri(text):
    from kubetitan_core.contract import split_s3_uri

    with pytest.raises(ValueError):
        split_s3_uri(text)


SHARDS = {"path": "/data/a"}
SHARDS_CASES = [
    ("shards", {"source": "shards", "shards": SHARDS},
     [("data.shards.path", "kubetitan.data.shards_path", "/data/a", False)]),
    ("shards-and-eval-set", {"source": "shards", "shards": SHARDS, "eval": {"samples": 8, "shards": {"path": "s3://b/e"}}},
     [("data.shards.path", "kubetitan.data.shards_path", "/data/a", False),
      ("data.eval.shards.path", "kubetitan.data.eval_shards_path", "s3://b/e", True)]),
    ("mixture-with-a-hub-entry", {"source": "mixture", "mixture": [
        {"shards": SHARDS, "weight": 1}, {"huggingface": {"dataset": "allenai/c4"}, "weight": 1},
        {"shards": {"path": "s3://b/m"}, "weight": 2}]},
     [("data.mixture[0].shards.path", "kubetitan.data.mixture_paths[0]", "/data/a", False),
      ("data.mixture[2].shards.path", "kubetitan.data.mixture_paths[2]", "s3://b/m", False)]),
    ("synthetic-reads-no-shards", {"source": "synthetic", "shards": SHARDS}, []),
]


@pytest.mark.parametrize(("data", "want"), [c[1:] for c in SHARDS_CASES], ids=[c[0] for c in SHARDS_CASES])
def test_the_spec_and_its_rendered_table_read_the_same_shards_paths(data, want):
    """One rule (``api.shards_paths``) for the validator's side (the spec) and the trainer's (its rendered
    ``[kubetitan.data]`` table): the same paths under the same two names, a stray ``data.shards`` of another source
    read by neither."""
    from kubetitan_core.api import spec_shards_paths
    from kubetitan_core.contract.trainer_toml import table_shards_paths

    lpt = LlamaPretrain.model_validate(make_lpt({"data": data}))
    got = [(p.spec_field, p.table_field, p.path, p.held_out) for p in spec_shards_paths(lpt.spec)]
    assert got == want
    assert table_shards_paths(render.kubetitan_table(lpt).data) == spec_shards_paths(lpt.spec)
def test_a_weight_schedule_renders_as_flat_points_with_percentages_resolved():
    """Each source's schedule reaches the trainer as points (source, step, weight), a percentage of training.steps
    turned into the nearest step; the trainer reads the same schedules back (kubetitan_core.weights.from_lists)."""
    from kubetitan_core import weights
    from kubetitan_core.api import weight_schedules

    obj = LlamaPretrain.model_validate(make_lpt({"training": {"steps": 1000}, "data": {"source": "mixture", "mixture": [
        {"shards": {"path": "/data/web"}, "weight": 9},
        {"shards": {"path": "/data/math"}, "weight": 0,
         "schedule": {"points": [{"percent": 90, "weight": 0}, {"step": 1000, "weight": 3}]}}]}}))
    d = render.kubetitan_table(obj).data
    assert (d.mixture_weights, d.mixture_schedule_interpolations) == ([9, 0], ["", "linear"])
    assert (d.mixture_schedule_sources, d.mixture_schedule_steps, d.mixture_schedule_weights) == ([1, 1], [900, 1000], [0, 3])
    back = weights.from_lists(d.mixture_weights, d.mixture_schedule_interpolations, d.mixture_schedule_sources,
                              d.mixture_schedule_steps, d.mixture_schedule_weights)
    assert back == weight_schedules(obj.spec)
    assert [float(back[1].at(s)) for s in (1, 900, 950, 1000)] == [0.0, 0.0, 1.5, 3.0]
    assert weights.percent_step(12.5, 10) == 1 and weights.percent_step(15, 10) == 2  # nearest, halves up


@pytest.mark.parametrize("spec_ledger, cli_ledger, want", [(False, False, False), (True, False, True),
                                                           (False, True, True)], ids=["off", "spec", "cli"])
def test_the_sample_ledger_is_switched_on_from_the_spec_or_the_command_line(tmp_path, spec_ledger, cli_ledger, want):
    """spec.data.ledger renders [kubetitan.data] ledger (what the pods read); `kubetitan run --ledger` turns it on for
    a local run whatever the spec says."""
    import tomllib

    from kubetitan_trainer.local import write_config

    obj = LlamaPretrain.model_validate(make_lpt({"data": {"source": "synthetic", "ledger": spec_ledger}}))
    assert render.kubetitan_table(obj).data.ledger is spec_ledger
    cfg = tomllib.loads(write_config(obj, tmp_path, None, 9999, ledger=cli_ledger).read_text())
    assert cfg["kubetitan"]["data"].get("ledger", False) is want


@pytest.mark.parametrize("storage", [{"hostPath": "/ck"}, {"persistentVolumeClaim": {"claimName": "c"}},
                                     {"s3": {"uri": "s3://b/run"}}], ids=["hostPath", "claim", "s3"])
def test_the_failed_saves_budget_is_rendered_from_the_spec_for_any_storage(storage):
    """spec.checkpoint.maxFailedSaves is [kubetitan.checkpoint_storage] max_failed_saves (what storage.SaveBudget
    reads), whatever the storage; the default is the API's and is left out of the file."""
    table = _kubetitan({"checkpoint": {"storage": storage, "maxFailedSaves": 7}})
    assert table["checkpoint_storage"]["max_failed_saves"] == 7
    assert from_table(Kubetitan, table).checkpoint_storage.max_failed_saves == 7
    default = _kubetitan({"checkpoint": {"storage": storage}})
    assert "max_failed_saves" not in default.get("checkpoint_storage", {})
    assert Kubetitan().checkpoint_storage.max_failed_saves == LlamaPretrainSpec().checkpoint.max_failed_saves == 3
