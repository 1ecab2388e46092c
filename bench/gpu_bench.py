"""GPU bench: Llama 3 1B/3B-class training on one GPU, plain torchtitan 0.2.2 vs kubetitan's launch path.

One entry, runnable on the device in one call (see ``bench/device/*.sh``)::

    python bench/gpu_bench.py matmul --out DIR                 # bf16 8192^3 matmul ceiling
    python bench/gpu_bench.py run --out DIR --cases 3B:compile:2,1B:fp8tw:4 [--path plain|kubetitan]
    python bench/gpu_bench.py table DIR [DIR...]               # the summary table of results.jsonl

A case is ``FLAVOUR:MODE:BATCH[:key=value...]``. MODE is ``eager`` (bf16 autocast, no compile),
``compile``, ``fp8tw`` (compile + FP8 tensorwise) or ``fp8rw`` (compile + FP8 rowwise); the output
projection stays in bf16 (``filter_fqns = ["output"]``, torchtitan's and kubetitan's default). Options:
``spec=fast`` (bench/fast_components.py) or ``spec=rope`` (its real-valued RoPE alone),
``fp8out=1`` (the output projection in FP8 too), ``cdt=1`` (Inductor's coordinate-descent tuning:
``TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1``, through ``spec.resources.env`` on the kubetitan path),
``alloc=exp`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: the caching allocator grows
segments instead of keeping fixed blocks, less fragmentation; through ``spec.resources.env`` on the kubetitan
path), ``data=kt`` (plain path: torchtitan's TrainSpec fed kubetitan's synthetic source, for loss parity),
``data=shards:shards=DIR`` (both paths: kubetitan's shards source over ``DIR``, a ``kubetitan prepare-data`` output,
in its shuffled order seeded by ``seed``; on the plain path through torchtitan's TrainSpec, as ``data=kt``; ``DIR``
holds no ``:`` or ``,``), ``tok=DIR`` (both paths: the run's tokenizer is the ``tokenizer.json`` in ``DIR``, as
``spec.tokenizer`` ``source: path``; shards prepared with another tokenizer than the run's are refused), ``mask=document`` (with ``data=shards``, kubetitan path: ``spec.data.attentionMask``,
block-causal attention at the documents' boundaries through flex attention; default ``causal``),
``lrwarm=`` (warm-up steps, default 4), ``round=`` (a label: repeats of one case get their own log), ``kill=N`` (kill the run once step N is logged: no final save), ``ac=selective|full|memory_budget``
(``sac=op|N``: selective per op, the default, or every N-th block; ``budget=F``: torchtitan's ``memory_budget`` mode,
the compiler's activation-memory budget 0-1, plain path only: kubetitan's spec has no such mode), ``gb=N`` (global
batch: gradient accumulation over ``N / BATCH`` micro-batches), ``chunks=N`` (kubetitan path: ``spec.precision.lossChunks``, the
output projection and the loss in N chunks), ``gpu=H100|H200`` (the kubetitan path's
``spec.resources.gpuProduct``, default the machine's card), ``ckpt=sync|async|pinned``
(checkpoint every ``ckint`` steps; pinned = ``async_with_pinned_mem``), ``profile=N`` (profile steps
N+1..N+2), ``steps=``, ``warmup=``, ``seed=``.

Every run: seq_len 8192 (``GPUBENCH_SEQ_LEN``), synthetic tokens unless ``data=shards``, no activation
checkpointing unless asked, AdamW (torchtitan defaults: fused, lr 8e-4 warm-up 2 steps... see ``toml_for``),
``log_freq = 1``; the
bench parses torchtitan's per-step log line (tokens/s, TFLOP/s, MFU, reserved memory, loss) and
reports median and spread over the steps after ``warmup``.

FLOPs per token (torchtitan's formula, also kubetitan's): 6 * (params - embedding params)
+ 12 * n_layers * n_heads * head_dim * seq_len (attention counted without causal halving);
MFU = tokens/s * FLOPs/token / peak, with peak = 989 TFLOP/s (dense bf16, H100/H200 SXM) and
also against the bf16 matmul ceiling measured in the same call.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SEQ_LEN = int(os.environ.get("GPUBENCH_SEQ_LEN", "8192"))  # smaller only in CPU tests
PEAK_BF16_TFLOPS = 989.0

STEP_RE = re.compile(
    r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)\s+memory:\s*([\d.]+)GiB\(([\d.]+)%\)\s+"
    r"tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+mfu:\s*([\d.]+%|n/a)"  # n/a: kubetitan on a device without a known peak (CPU)
)
PEAK_RE = re.compile(r"GPUBENCH peak_allocated_gib=([\d.]+) peak_reserved_gib=([\d.]+)")
PARAMS_RE = re.compile(r"size:\s*([\d,]+) total parameters")
SAVE_RE = re.compile(r"Finished saving the checkpoint .*?in ([\d.]+) seconds")

CKPT_ASYNC_MODE = {"none": "disabled", "sync": "disabled", "async": "async", "pinned": "async_with_pinned_mem"}
MODES = {
    "eager": dict(compile=False, fp8=None),
    "compile": dict(compile=True, fp8=None),
    "fp8tw": dict(compile=True, fp8="tensorwise"),
    "fp8rw": dict(compile=True, fp8="rowwise"),
}


DATA = {"bench": "the spec's own synthetic phrases (plain path) or kubetitan's synthetic source (kubetitan path)",
        "kt": "kubetitan's synthetic source on both paths",
        "shards": "kubetitan's shards source over shards=DIR on both paths, shuffled (seeded by seed=)"}


def kubetitan_data(case: dict) -> dict:
    """The ``[kubetitan.data]`` table of a case's data (``data=kt`` or ``data=shards``): what the plain path's
    ``llama3_gpubench_ktdata`` spec reads; the kubetitan path renders the same from its spec.data."""
    if case["data"] == "shards":
        return {"source": "shards", "shards_path": case["shards"], "order": "shuffled"}
    return {"source": "synthetic"}


def parse_case(text: str) -> dict:
    parts = text.split(":")
    if len(parts) < 3 or parts[1] not in MODES:
        raise SystemExit(f"bad case {text!r}: write FLAVOUR:MODE:BATCH[:key=value...], MODE one of {sorted(MODES)}")
    case = {"flavor": parts[0], "mode": parts[1], "batch": int(parts[2]), "spec": "plain", "ac": "none",
            "ckpt": "none", "ckint": 10, "profile": 0, "scrape": 0, "resume": 0, "path": "", "round": 0, "fp8out": 0, "cdt": 0, "alloc": "", "data": "bench", "shards": "", "mask": "causal", "tok": "", "lrwarm": 4, "kill": 0, "steps": 28, "warmup": 8, "seed": 42, "sac": "op", "budget": 0.0, "gb": 0, "chunks": 0,
            "gpu": "", "id": text}
    for kv in parts[3:]:
        k, _, v = kv.partition("=")
        if k not in case:
            raise SystemExit(f"bad option {k!r} in case {text!r}")
        case[k] = type(case[k])(v) if not isinstance(case[k], str) else v
    if case["data"] not in DATA:
        raise SystemExit(f"bad data={case['data']!r} in case {text!r}: use one of {sorted(DATA)}")
    if case["ac"] not in ("none", "selective", "full", "memory_budget"):
        raise SystemExit(f"bad ac={case['ac']!r} in case {text!r}: use none, selective, full or memory_budget")
    if (case["ac"] == "memory_budget") != (case["budget"] > 0):
        raise SystemExit(f"case {text!r}: ac=memory_budget and budget=F (0 < F <= 1) go together")
    if case["gb"] and case["gb"] % case["batch"]:
        raise SystemExit(f"case {text!r}: gb={case['gb']} is not a multiple of the batch {case['batch']}")
    if case["mask"] not in ("causal", "document"):
        raise SystemExit(f"bad mask={case['mask']!r} in case {text!r}: use causal or document")
    if case["mask"] == "document" and (case["data"] != "shards" or case["path"] == "plain"):
        raise SystemExit(f"case {text!r}: mask=document (spec.data.attentionMask) needs data=shards on the kubetitan path")
    if (case["data"] == "shards") != bool(case["shards"]):
        raise SystemExit(f"case {text!r}: data=shards and shards=DIR (a `kubetitan prepare-data` output) go together")
    return case


def case_id(case: dict, path: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{path}-{case['id']}")


def _toml(d: dict, prefix: str = "") -> str:
    """A minimal TOML writer (tables of scalars/lists); tomli_w may be missing on the device."""

    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        raise TypeError(v)

    out, sub = [], []
    for k, v in d.items():
        (sub if isinstance(v, dict) else out).append((k, v))
    text = "".join(f"{k} = {val(v)}\n" for k, v in out)
    for k, v in sub:
        name = f"{prefix}.{k}" if prefix else k
        text += f"\n[{name}]\n" + _toml(v, name)
    return text


def toml_for(case: dict, dump_folder: str) -> dict:
    """The plain torchtitan 0.2.2 job config of a case (what ``--job.config_file`` gets)."""
    mode = MODES[case["mode"]]
    spec = {"plain": "llama3_gpubench", "fast": "llama3_gpubench_fast", "rope": "llama3_gpubench_rope"}[case["spec"]]
    if case["data"] in ("kt", "shards"):
        assert case["spec"] == "plain", f"data={case['data']} is for torchtitan's own model and loss"
        spec = "llama3_gpubench_ktdata"
    cfg = {
        "job": {"dump_folder": dump_folder, "description": case["id"]},
        "experimental": {"custom_import": "gpu_plain_spec"},
        "model": {"name": spec, "flavor": case["flavor"],
                  "converters": ["quantize.linear.float8"] if mode["fp8"] else []},
        "optimizer": {"name": "AdamW", "lr": 3e-4, "eps": 1e-8, "weight_decay": 0.1},
        "lr_scheduler": {"warmup_steps": case["lrwarm"]},
        "training": {"local_batch_size": case["batch"], "seq_len": SEQ_LEN, "max_norm": 1.0,
                     "steps": case["steps"], "dataset": "gpubench_synthetic", "mixed_precision_param": "bfloat16",
                     "global_batch_size": case["gb"] or -1},
        "parallelism": {"data_parallel_shard_degree": -1},
        "checkpoint": {"enable": case["ckpt"] != "none", "folder": "checkpoint", "interval": case["ckint"],
                       "async_mode": CKPT_ASYNC_MODE[case["ckpt"]],
                       "keep_latest_k": 2, "last_save_model_only": True},  # 3B: 43 GB a full save, 64 GB disk
        "activation_checkpoint": {"mode": case["ac"], "selective_ac_option": case["sac"],
                                  **({"memory_budget": case["budget"]} if case["ac"] == "memory_budget" else {})},
        "compile": {"enable": mode["compile"], "components": ["model", "loss"]},
        "metrics": {"log_freq": 1, "disable_color_printing": True, "enable_tensorboard": False},
        "debug": {"seed": case["seed"]},
    }
    if case["data"] in ("kt", "shards"):  # kubetitan's data sources read the [kubetitan] table
        cfg["job"]["custom_config_module"] = "kubetitan_trainer.job_config"
        cfg["kubetitan"] = {"data": kubetitan_data(case)}
        if case["tok"]:
            cfg["kubetitan"]["tokenizer"] = {"source": "path", "path": case["tok"]}
    if mode["fp8"]:
        # tensorwise = torchao's default Float8LinearConfig (recipe_name unset), as kubetitan renders it;
        # the plain reference run (bench/results/gpu/plain_torchtitan_reference) used recipe_name = "tensorwise", the same config.
        f8 = {"filter_fqns": [] if case["fp8out"] else ["output"]}
        if mode["fp8"] != "tensorwise":
            f8["recipe_name"] = mode["fp8"]
        cfg["quantize"] = {"linear": {"float8": f8}}
    return cfg


def parse_log(text: str, warmup: int, profile_after: int = 0) -> dict:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # kubetitan's log keeps torchtitan's colours
    steps = [m.groups() for m in STEP_RE.finditer(text)]
    rows = [dict(step=int(s), loss=float(lo), grad_norm=float(g), mem_reserved_gib=float(mr), mem_pct=float(mp),
                 tps=float(t.replace(",", "")), tflops=float(tf.replace(",", "")), mfu=float(mf.rstrip("%").replace("n/a", "nan")))
            for s, lo, g, mr, mp, t, tf, mf in steps]
    res: dict = {"steps_logged": len(rows)}
    if not rows:
        return res
    timed = [r for r in rows if r["step"] > warmup and (not profile_after or r["step"] <= profile_after)]
    res["loss_first"], res["loss_last"] = rows[0]["loss"], rows[-1]["loss"]
    res["loss_finite"] = all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in rows)
    res["losses"] = [r["loss"] for r in rows]
    res["mem_reserved_gib"] = max(r["mem_reserved_gib"] for r in rows)
    if timed:
        tps = sorted(r["tps"] for r in timed)
        q = statistics.quantiles(tps, n=4) if len(tps) >= 2 else [tps[0]] * 3
        res.update(
            timed_steps=len(timed), tps_median=statistics.median(tps), tps_min=tps[0], tps_max=tps[-1],
            tps_q1=q[0], tps_q3=q[2], spread_pct=100 * (q[2] - q[0]) / statistics.median(tps),
            tflops_median=statistics.median(r["tflops"] for r in timed),
            mfu_median=statistics.median(r["mfu"] for r in timed),
            step_tps=[r["tps"] for r in rows],
        )
    if m := PEAK_RE.search(text):
        res["peak_allocated_gib"], res["peak_reserved_gib"] = float(m.group(1)), float(m.group(2))
    if m := PARAMS_RE.search(text):
        res["params"] = int(m.group(1).replace(",", ""))
    res["ckpt_save_s"] = [float(x) for x in SAVE_RE.findall(text)]
    return res


def _descendants(pid: int) -> list[int]:
    """All descendant pids of ``pid`` (from /proc; ``kubetitan run`` starts its launcher in a new session)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    import signal

    for pid in reversed(_descendants(proc.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()
    time.sleep(3)  # let the driver release the killed workers' GPU memory


def run_tree(cmd: list[str], log, env: dict, cwd: Path, timeout: float, kill_at: tuple[Path, int] | None = None):
    """``subprocess.run`` whose timeout kills the whole process tree (torchrun's workers hold the GPU).

    ``kill_at = (log file, N)``: kill the tree once the log shows step N (returns ``"killed"``)."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    end = time.monotonic() + timeout
    while True:
        try:
            return proc.wait(timeout=min(1.0, max(0.01, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            pass
        if kill_at is not None and kill_at[0].exists():
            text = kill_at[0].read_text(errors="replace")
            if any(int(m.group(1)) >= kill_at[1] for m in STEP_RE.finditer(re.sub(r"\x1b\[[0-9;]*m", "", text))):
                _kill_tree(proc)
                return "killed"
        if time.monotonic() >= end:
            _kill_tree(proc)
            return "timeout"


def run_case(case: dict, path: str, out: Path, timeout: float, env_extra: dict | None = None) -> dict:
    cid = case_id(case, path)
    work = Path(os.environ.get("GPUBENCH_WORK", "/tmp/gpubench")) / cid
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH), str(REPO / "trainer"), str(REPO / "operator"),
                                         env.get("PYTHONPATH", "")])
    env.setdefault("LOG_RANK", "0")
    env["PYTHONUNBUFFERED"] = "1"
    if case["profile"]:
        env["GPUBENCH_PROFILE_AFTER"] = str(case["profile"])
    if case["cdt"] and path == "plain":  # the kubetitan path gets it from the spec (spec.resources.env)
        env["TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"] = "1"
    if case["alloc"] and path == "plain":  # likewise
        from gpu_kubetitan import alloc_env

        env[alloc_env(case)["name"]] = alloc_env(case)["value"]
    env.update(env_extra or {})
    if path == "plain":
        cfg_file = work / "job.toml"
        cfg_file.write_text(_toml(toml_for(case, str(work / "dump"))))
        port = str(29500 + (os.getpid() % 1000))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--nnodes=1",
               f"--rdzv_endpoint=localhost:{port}", "--rdzv_backend=c10d", "--local-ranks-filter=0",
               "--role=rank", "--tee=3", "-m", "torchtitan.train", "--job.config_file", str(cfg_file)]
    elif path == "kubetitan":
        from gpu_kubetitan import kubetitan_command  # bench/gpu_kubetitan.py

        cmd = kubetitan_command(case, work)
        if case["resume"]:
            assert case["ckpt"] != "none", "resume=N needs ckpt=sync|async"
    else:
        raise SystemExit(f"unknown path {path!r}")
    t0 = time.monotonic()
    log_path = out / f"{cid}.log"
    stop = threading.Event()
    if path == "kubetitan" and case["scrape"]:
        from gpu_kubetitan import metrics_scraper

        metrics_scraper(work, out / f"{cid}.metrics.txt", stop)
    extra = {}
    with open(log_path, "w") as log:
        log.write("# " + " ".join(cmd) + "\n")
        log.flush()
        watch = (log_path if path == "plain" else work / "out" / "train.log", case["kill"]) if case["kill"] else None
        rc = run_tree(cmd, log, env, work, timeout, kill_at=watch)
        wall = time.monotonic() - t0
        stop.set()
        if path == "kubetitan":
            from gpu_kubetitan import train_log

            first = train_log(work)
            log.write("\n# ---- train.log (kubetitan run) ----\n" + first)
            if case["resume"] and rc == 0:  # the same run again with more steps: resumes from its checkpoint
                t1 = time.monotonic()
                cmd2 = cmd + ["--steps", str(case["resume"])]
                log.write("\n# ---- resume: " + " ".join(cmd2) + "\n")
                log.flush()
                rc2 = run_tree(cmd2, log, env, work, max(30.0, timeout - wall))
                second = re.sub(r"\x1b\[[0-9;]*m", "", train_log(work)[len(first):])
                log.write("\n# ---- train.log (resumed run) ----\n" + second)
                m = re.search(r"Training starts at step (\d+)", second)
                resumed_rows = [g for g in STEP_RE.findall(second)]
                extra = {"resume_rc": rc2, "resume_wall_s": round(time.monotonic() - t1, 1),
                         "resume_starts_at_step": int(m.group(1)) if m else None,
                         "resume_steps": [int(g[0]) for g in resumed_rows],
                         "resume_losses": [float(g[1]) for g in resumed_rows]}
            text_for_parse = first
    text = log_path.read_text(errors="replace") if path == "plain" else text_for_parse
    res = {"case": case["id"], "path": path, "flavor": case["flavor"], "mode": case["mode"], "batch": case["batch"],
           "spec": case["spec"], "ac": case["ac"], "ckpt": case["ckpt"], "rc": rc, "wall_s": round(wall, 1),
           **parse_log(text, case["warmup"], case["profile"]), **extra}
    shutil.rmtree(work / "dump", ignore_errors=True)  # checkpoints: disk space for the next case
    shutil.rmtree(work / "out" / "checkpoint", ignore_errors=True)
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    print(fmt_row(res), flush=True)
    return res


def matmul_ceiling(out: Path) -> dict:
    import torch

    n, dev = 8192, "cuda"
    sets = [(torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16))
            for _ in range(3)]
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    for i in range(10):
        torch.matmul(*sets[i % 3], out=c)
    times = []
    for i in range(60):
        a, b = sets[i % 3]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.matmul(a, b, out=c)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    med = statistics.median(times)
    assert torch.isfinite(c.float()).all()
    res = {"case": "matmul_bf16_8192", "tflops_median": 2 * n**3 / med / 1e12,
           "tflops_min": 2 * n**3 / max(times) / 1e12, "tflops_max": 2 * n**3 / min(times) / 1e12,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    print(json.dumps(res), flush=True)
    return res


def fmt_row(r: dict, ceiling: float | None = None) -> str:
    if r.get("case", "").startswith("matmul"):
        return f"{'matmul bf16 8192^3':44s} {r['tflops_median']:8.1f} TFLOP/s (min {r['tflops_min']:.1f}, max {r['tflops_max']:.1f})"
    if "tps_median" not in r:
        return f"{r['path']:9s} {r['case']:34s} rc={r['rc']} FAILED (steps logged {r.get('steps_logged', 0)}, wall {r['wall_s']} s)"
    vs = f" {100 * r['tflops_median'] / ceiling:5.1f}%c" if ceiling else ""
    return (f"{r['path']:9s} {r['case']:34s} tok/s {r['tps_median']:9,.0f} [{r['tps_q1']:,.0f}-{r['tps_q3']:,.0f}] "
            f"TF {r['tflops_median']:6.1f} MFU {r['mfu_median']:5.1f}%{vs} mem {r.get('peak_allocated_gib', float('nan')):6.1f}/"
            f"{r['mem_reserved_gib']:6.1f}GiB loss {r['loss_first']:.3f}->{r['loss_last']:.3f} n={r['timed_steps']} "
            f"wall {r['wall_s']}s rc={r['rc']}")


def table(dirs: list[str]) -> None:
    rows = []
    for d in dirs:
        p = Path(d) / "results.jsonl"
        if p.exists():
            rows += [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    ceiling = next((r["tflops_median"] for r in rows if r.get("case", "").startswith("matmul")), None)
    for r in rows:
        print(fmt_row(r, ceiling))


def compare_key(case_id: str) -> str:
    """A case without its ``round=``/``path=`` labels: the repeats of one configuration share it."""
    return ":".join(p for p in case_id.split(":") if not p.startswith(("round=", "path=")))


def compare(dirs: list[str]) -> str:
    """Per configuration and path: tok/s of each round (their median is the figure), MFU, reserved memory, and the
    ratio to the best plain-torchtitan configuration that ran (failed runs: listed, never a denominator)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for d in dirs:
        p = Path(d) / "results.jsonl"
        for r in ([json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []):
            if "path" in r:
                groups.setdefault((r["path"], compare_key(r["case"])), []).append(r)
    med = {k: statistics.median(r["tps_median"] for r in rs if "tps_median" in r)
           for k, rs in groups.items() if any("tps_median" in r for r in rs)}
    plain = {k: v for k, v in med.items() if k[0] == "plain"}
    best = max(plain, key=plain.get) if plain else None
    lines = [f"{'path':9s} {'configuration':44s} {'tok/s (median of rounds)':>24s} {'rounds':>28s} {'MFU':>6s} "
             f"{'reserved':>9s} {'vs best plain':>13s}"]
    for k in sorted(groups, key=lambda k: (k[0] != "plain", -med.get(k, 0))):
        rs = groups[k]
        ok = [r for r in rs if "tps_median" in r]
        if not ok:
            why = ", ".join(f"rc={r['rc']} steps={r.get('steps_logged', 0)}" for r in rs)
            lines.append(f"{k[0]:9s} {k[1]:44s} {'did not run: ' + why:>24s}")
            continue
        rounds = " / ".join(f"{r['tps_median']:,.0f}" for r in ok)
        mfu = statistics.median(r["mfu_median"] for r in ok)
        ratio = f"{med[k] / plain[best]:.3f}" if best else "-"
        lines.append(f"{k[0]:9s} {k[1]:44s} {med[k]:>24,.0f} {rounds:>28s} {mfu:5.1f}% "
                     f"{max(r['mem_reserved_gib'] for r in ok):6.1f}GiB {ratio:>13s}")
    if best:
        lines.append(f"best plain torchtitan: {best[1]} ({plain[best]:,.0f} tok/s)")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--cases", required=True)
    r.add_argument("--path", default="plain", help="plain, kubetitan, or alt (each case kubetitan then plain, alternating)")
    r.add_argument("--out", required=True)
    r.add_argument("--case-timeout", type=float, default=240)
    r.add_argument("--deadline", type=float, default=0, help="stop starting cases this many seconds from now")
    m = sub.add_parser("matmul")
    m.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("dirs", nargs="+")
    c = sub.add_parser("compare", help="each configuration's rounds, MFU and its ratio to the best plain one")
    c.add_argument("dirs", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "table":
        return table(a.dirs)
    if a.cmd == "compare":
        print(compare(a.dirs))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.cmd == "matmul":
        matmul_ceiling(out)
        return
    t0 = time.monotonic()
    cases = [parse_case(c) for c in a.cases.split(",") if c]
    plan = []
    for i, c in enumerate(cases):
        path = c["path"] or a.path
        if path == "alt":  # alternate which path goes first, so that drift hits both alike
            plan += [(c, "kubetitan"), (c, "plain")] if i % 2 == 0 else [(c, "plain"), (c, "kubetitan")]
        else:
            plan.append((c, path))
    for c, path in plan:
        left = a.deadline - (time.monotonic() - t0) if a.deadline else a.case_timeout
        if left < 45:
            print(f"SKIPPED {path} {c['id']}: deadline", flush=True)
            continue
        run_case(c, path, out, timeout=min(a.case_timeout, left))


if __name__ == "__main__":
    main()
