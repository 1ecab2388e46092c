"""Every example validates, and every object the planner renders from it passes the Kubernetes schemas."""

from __future__ import annotations

import kubernetes_validate
import pytest

from support.paths import EXAMPLES, load_example
from kubetitan.plan import attempt_children
from kubetitan_core.validation import parse

# Oldest and newest Kubernetes minor versions kubetitan supports.
K8S_VERSIONS = ["1.27", "1.35", "1.37"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_children_pass_kubernetes_schemas(path, version):
    obj = load_example(path)
    obj["metadata"].setdefault("namespace", "default")
    obj["metadata"]["uid"] = "6f1c2d1e-0000-4000-8000-000000000001"
    lpt, errors = parse(obj)
    assert not errors
    children = attempt_children(lpt, attempt=2, job_start_time=1767225600.0, avoid_nodes=["ip-10-0-0-1"])
    for child in children:
        # Raises ValidationError naming the field on any schema violation, unknown fields included.
        kubernetes_validate.validate(child, version, strict=True)


def test_schema_check_is_real():
    """The same call rejects a pod with an unknown field, so the test above can fail."""
    lpt, _ = parse(load_example(EXAMPLES[0]))
    pod = attempt_children(lpt, 0)[2]
    pod["spec"]["containers"][0]["gpuCount"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSIONS[0], strict=True)


def test_examples_cover_the_documented_recipes():
    names = {p.stem for p in EXAMPLES}
    assert {"debug-cpu", "llama3-8b-p5-1node", "llama3-8b-p5-4node", "llama3-70b-p5", "llama3-8b-hyperpod"} <= names
    rec = parse(load_example(next(p for p in EXAMPLES if p.stem == "llama3-8b-p5-4node")))[0].spec
    f8 = rec.precision.float8
    assert rec.resources.nodes == 4 and rec.resources.instance_type == "p5.48xlarge"
    assert rec.precision.compile and f8.enabled and f8.fsdp_float8_all_gather and f8.precompute_dynamic_scale
    assert (rec.training.seq_len, rec.training.learning_rate, rec.training.warmup_steps) == (8192, 3e-4, 200)


def _bench():
    """bench/gpu_bench.py and bench/gpu_kubetitan.py (bench/ is no package)."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    sys.path.insert(0, bench)
    try:
        import gpu_bench
        import gpu_kubetitan
    finally:
        sys.path.remove(bench)
    return gpu_bench, gpu_kubetitan


@pytest.mark.parametrize("stem, case_name, gpu", [("llama3-3b-h200", "RECIPE_CASE", "H200"),
                                                  ("llama3-3b-h100", "RECIPE_CASE_H100", "H100")])
def test_3b_recipes_are_the_benchmarked_configurations(stem, case_name, gpu):
    """examples/llama3-3b-h200.yaml and examples/llama3-3b-h100.yaml are the shapes measured on their cards (bench cases
    ``RECIPE_CASE`` / ``RECIPE_CASE_H100`` through the kubetitan path, docs/benchmarks.md): the same model, batch,
    sequence, precision (activation checkpointing included), parallelism, GPU and env."""
    gpu_bench, gpu_kubetitan = _bench()
    measured = parse(gpu_kubetitan.lpt_for(gpu_bench.parse_case(getattr(gpu_kubetitan, case_name)), "bench"))[0].spec
    recipe = parse(load_example(next(p for p in EXAMPLES if p.stem == stem)))[0].spec
    for part in ("model", "precision", "parallelism"):
        assert getattr(recipe, part) == getattr(measured, part), part
    keys = ("seq_len", "local_batch_size", "global_batch_size", "learning_rate")
    assert [getattr(recipe.training, k) for k in keys] == [getattr(measured.training, k) for k in keys]
    assert (recipe.resources.nodes, recipe.resources.gpus_per_node) == (1, 1)
    assert recipe.resources.gpu_product == measured.resources.gpu_product == gpu
    assert recipe.resources.env == measured.resources.env
    assert recipe.checkpoint.async_mode == "async_with_pinned_mem" and recipe.checkpoint.interval_steps == 100


def test_h100_recipe_fits_80gb_by_checkpointing_every_7th_block_with_the_fp8_head():
    """What the H100 recipe's speed rests on, each a spec option: batch 2 at seq 8192 with every 7th block
    recomputed (``selectiveActivationCheckpointing: "7"``, rendered as torchtitan's ``selective_ac_option``), the
    output projection in FP8 (compiled with the final norm by kubetitan's TrainSpec), expandable segments."""
    from kubetitan_core.render import trainer_config

    lpt = parse(load_example(next(p for p in EXAMPLES if p.stem == "llama3-3b-h100")))[0]
    cfg = trainer_config(lpt)
    assert cfg["activation_checkpoint"]["mode"] == "selective"
    assert cfg["activation_checkpoint"]["selective_ac_option"] == "7"
    assert (cfg["training"]["seq_len"], cfg["training"]["local_batch_size"]) == (8192, 2)
    assert cfg["quantize"]["linear"]["float8"]["filter_fqns"] == []
    assert {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"} in lpt.spec.resources.env


def test_parity_cases_feed_both_paths_the_same_shards_seed_and_schedule():
    """bench/device/loss_parity_real_text.sh's loss parity: the recipe through ``kubetitan run`` and plain torchtitan read the same
    shards in the same shuffled order (``[kubetitan.data]``), with the same seed (initial weights and data order),
    batch, sequence, steps, learning rate and warm-up; the recipe's precision differs only in its output projection."""
    from kubetitan_core.render import trainer_config

    gpu_bench, gpu_kubetitan = _bench()
    opts = "2:steps=300:lrwarm=20:alloc=exp:data=shards:shards=/tmp/c18/shards:seed=42"
    recipe = gpu_bench.parse_case(f"3B:fp8tw:{opts}:fp8out=1:path=kubetitan")
    plain = gpu_bench.toml_for(gpu_bench.parse_case(f"3B:fp8tw:{opts}:path=plain"), "/tmp/dump")
    kt = trainer_config(parse(gpu_kubetitan.lpt_for(recipe, "bench"))[0])
    data = {k: kt["kubetitan"]["data"].get(k) for k in plain["kubetitan"]["data"]}
    assert data == plain["kubetitan"]["data"] == {"source": "shards", "shards_path": "/tmp/c18/shards",
                                                  "order": "shuffled"}
    assert kt["debug"]["seed"] == plain["debug"]["seed"] == 42
    for table, keys in {"training": ("local_batch_size", "seq_len", "steps", "max_norm"),
                        "optimizer": ("lr", "weight_decay"), "lr_scheduler": ("warmup_steps",)}.items():
        assert {k: kt[table][k] for k in keys} == {k: plain[table][k] for k in keys}, table
    assert kt["quantize"]["linear"]["float8"]["filter_fqns"] == []  # the recipe: the output projection in FP8 too
    assert plain["quantize"]["linear"]["float8"]["filter_fqns"] == ["output"]  # torchtitan's default: bf16 head
    with pytest.raises(SystemExit, match="data=shards and shards=DIR"):
        gpu_bench.parse_case("3B:fp8tw:2:data=shards")
    with pytest.raises(SystemExit, match="bad data="):
        gpu_bench.parse_case("3B:fp8tw:2:data=c4")


def test_bench_layouts_render_alike_on_both_paths_and_compare_divides_by_the_best_plain_run(tmp_path):
    """bench/device/h100_recipe_vs_torchtitan.sh's layouts: every N-th block checkpointed and gradient accumulation
    reach plain torchtitan's TOML and kubetitan's rendered config alike; torchtitan's memory_budget mode exists on the
    plain path only; ``gpu_bench.py compare`` divides by the fastest plain configuration that ran (rounds pooled)."""
    import json

    from kubetitan_core.render import trainer_config

    gpu_bench, gpu_kubetitan = _bench()
    opts = "3B:fp8tw:1:ac=selective:sac=7:gb=4"
    plain = gpu_bench.toml_for(gpu_bench.parse_case(f"{opts}:path=plain"), "/tmp/dump")
    kt = trainer_config(parse(gpu_kubetitan.lpt_for(gpu_bench.parse_case(f"{opts}:gpu=H100"), "bench"))[0])
    for cfg in (plain, kt):
        assert (cfg["activation_checkpoint"]["mode"], cfg["activation_checkpoint"]["selective_ac_option"]) == (
            "selective", "7")
        assert (cfg["training"]["local_batch_size"], cfg["training"]["global_batch_size"]) == (1, 4)
    mb = gpu_bench.parse_case("3B:fp8tw:2:ac=memory_budget:budget=0.6")
    assert gpu_bench.toml_for(mb, "/tmp/dump")["activation_checkpoint"]["memory_budget"] == 0.6
    with pytest.raises(SystemExit, match="no memory_budget"):
        gpu_kubetitan.lpt_for(mb, "bench")
    with pytest.raises(SystemExit, match="not a multiple of the batch"):
        gpu_bench.parse_case("3B:fp8tw:2:gb=3")

    rows = [("plain", "3B:fp8tw:2:ac=selective:sac=op:path=plain", 100.0),
            ("plain", "3B:fp8tw:2:ac=selective:sac=op:path=plain:round=2", 110.0),
            ("plain", "3B:fp8tw:2:ac=selective:sac=7:path=plain", 120.0),
            ("kubetitan", "3B:fp8tw:2:fp8out=1:path=kubetitan:round=1", 130.0),
            ("kubetitan", "3B:fp8tw:2:fp8out=1:path=kubetitan:round=2", 126.0)]
    lines = [{"path": p, "case": c, "tps_median": t, "mfu_median": 50.0, "mem_reserved_gib": 70.0, "rc": 0}
             for p, c, t in rows]
    lines.append({"path": "plain", "case": "3B:fp8tw:2:path=plain", "rc": 1, "steps_logged": 2})  # out of memory
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    table = gpu_bench.compare([str(tmp_path)])
    assert "best plain torchtitan: 3B:fp8tw:2:ac=selective:sac=7 (120 tok/s)" in table
    recipe = next(x for x in table.splitlines() if x.startswith("kubetitan"))
    assert "130 / 126" in recipe and recipe.rstrip().endswith("1.067")  # median 128 / 120
    assert "did not run: rc=1 steps=2" in table
