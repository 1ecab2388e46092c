"""The runtime tuning in the typed contract: ``spec.runtime`` is validated, rendered into the pod's ``trainer.toml`` as
``[kubetitan.runtime]``, and read by each worker as it starts (``kubetitan_trainer.runtime``), where the recovery and
compile modules ask for it. Pure (no torch, no process): well under a second."""

from __future__ import annotations

import logging
import tomllib

import pytest

from kubetitan.plan import attempt_children
from kubetitan_core import contract
from kubetitan_core.contract.trainer_toml import KubetitanRuntime
from kubetitan_core.validation import parse
from kubetitan_trainer import runtime
from support.specs import cpu_spec, make_lpt


def _children(runtime_spec: dict) -> list[dict]:
    lpt, errors = parse(make_lpt(spec={**cpu_spec(), "runtime": runtime_spec}))
    assert errors == []
    return attempt_children(lpt, 0)


def test_the_aot_opt_in_through_the_api_reaches_the_rendered_pods_toml_and_the_worker(tmp_path, monkeypatch):
    children = _children({"aotCompile": True, "restoreTierRead": "map", "deferThreads": 2})
    (config_map,) = [c for c in children if c["kind"] == "ConfigMap"]
    pods = [c for c in children if c["kind"] == "Pod"]
    assert pods and all(any(v.get("configMap", {}).get("name") == config_map["metadata"]["name"]
                            for v in p["spec"]["volumes"]) for p in pods)  # every pod mounts that trainer.toml
    text = config_map["data"][contract.CONFIG_KEY]
    assert tomllib.loads(text)["kubetitan"]["runtime"] == {"restore_tier_read": "map", "defer_threads": 2,
                                                           "aot_compile": True}  # only what differs from the default
    path = tmp_path / "trainer.toml"
    path.write_text(text)
    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime())
    got = runtime.load(["--job.config_file", str(path)])  # what each worker does first
    assert runtime.settings() is got and (got.aot_compile, got.restore_tier_read, got.defer_threads) == (True, "map", 2)
    from kubetitan_trainer.compile import aot_precompile

    assert aot_precompile.enabled()


def test_a_default_spec_renders_no_runtime_keys_and_the_worker_keeps_the_defaults(tmp_path, monkeypatch):
    (config_map,) = [c for c in _children({}) if c["kind"] == "ConfigMap"]
    text = config_map["data"][contract.CONFIG_KEY]
    assert "runtime" not in tomllib.loads(text)["kubetitan"]
    (tmp_path / "t.toml").write_text(text)
    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(aot_compile=True))
    assert runtime.load([f"--job.config_file={tmp_path / 't.toml'}"]) == KubetitanRuntime()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("restoreTierRead", "mmap", "'mmap' is not allowed: use 'pread' or 'map'"),
    ("deferThreads", 0, "must be greater than or equal to 1"),
    ("aotCompile", "yes", "must be a valid boolean (got 'yes')"),
])
def test_the_api_refuses_a_runtime_value_the_table_does_not_allow(field, value, message):
    _, errors = parse(make_lpt(spec={**cpu_spec(), "runtime": {field: value}}))
    assert [e.path for e in errors] == [f"spec.runtime.{field}"] and message in errors[0].message, errors


def test_a_hand_written_table_with_a_bad_value_warns_and_keeps_that_default(tmp_path, caplog):
    path = tmp_path / "t.toml"
    path.write_text('[kubetitan.runtime]\nrestore_tier_read = "mmap"\ndefer_threads = -1\nearly_cuda_context = 1\n'
                    'staging_write = "map"\n')
    with caplog.at_level(logging.WARNING, logger="kubetitan.runtime"):
        got = runtime.read(str(path))
    assert got == KubetitanRuntime(staging_write="map")
    assert "restore_tier_read = 'mmap' is not one of 'pread', 'map'; using 'pread'" in caplog.text
    assert "defer_threads = -1 is not a whole number, 0 or more; using 4" in caplog.text
    assert "early_cuda_context = 1 is not true or false; using False" in caplog.text


def test_an_unreadable_config_leaves_the_defaults_for_the_config_check_to_report(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(aot_compile=True))
    (tmp_path / "bad.toml").write_text("[kubetitan.runtime]\nno_such_key = 1\n")
    assert runtime.load(["--job.config_file", str(tmp_path / "bad.toml")]) == KubetitanRuntime()
    assert runtime.load(["--job.config_file", str(tmp_path / "missing.toml")]) == KubetitanRuntime()
    assert runtime.load([]) == KubetitanRuntime()
