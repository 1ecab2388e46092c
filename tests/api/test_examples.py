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


def test_h200_3b_recipe_is_the_benchmarked_configuration():
    """examples/llama3-3b-h200.yaml is the shape measured on the H200 (bench case ``RECIPE_CASE`` through the
    kubetitan path, docs/benchmarks.md): the same model, batch, sequence, precision, parallelism and env."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    sys.path.insert(0, bench)
    try:
        from gpu_bench import parse_case
        from gpu_kubetitan import RECIPE_CASE, lpt_for
    finally:
        sys.path.remove(bench)
    measured = parse(lpt_for(parse_case(RECIPE_CASE), "bench"))[0].spec
    recipe = parse(load_example(next(p for p in EXAMPLES if p.stem == "llama3-3b-h200")))[0].spec
    for part in ("model", "precision", "parallelism"):
        assert getattr(recipe, part) == getattr(measured, part), part
    keys = ("seq_len", "local_batch_size", "learning_rate")
    assert [getattr(recipe.training, k) for k in keys] == [getattr(measured.training, k) for k in keys]
    assert (recipe.resources.nodes, recipe.resources.gpus_per_node) == (1, 1)
    assert recipe.resources.env == measured.resources.env
    assert recipe.checkpoint.async_mode == "async_with_pinned_mem" and recipe.checkpoint.interval_steps == 100
