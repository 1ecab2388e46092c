"""``kubetitan prepare-data`` (kubetitan_trainer.data.prepare): shards that do not depend on the worker count, one BOS/EOS
convention for every input type, resume by work unit, and bad input or bad shards ending with exit code 2 and a
message naming the file (and line) and the fix, never a traceback (each case run as a subprocess)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from kubetitan_trainer.data import prepare
from kubetitan_trainer.data.shards import INDEX_FILE, ShardSet

from support import forkrun

TOKENIZER = prepare.BUILTIN_TOKENIZER / "tokenizer.json"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*forkrun.python(), "-m", "kubetitan_trainer.data.prepare", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def docs(n: int, tag: str) -> list[str]:
    return [f"{tag} document {i}: Ada found a red fox by the river, and the fox ran {i % 7} miles." * (1 + i % 3)
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A mixed corpus: JSONL, gzip JSONL, text (one document per line), Parquet, in a directory tree."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("corpus")
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs(300, "A"))))
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in docs(50, "B")))
    (d / "sub").mkdir()
    (d / "sub" / "c.txt").write_text("\n".join(docs(120, "C")) + "\n\n")
    pq.write_table(pa.table({"text": docs(90, "D")}), d / "sub" / "d.parquet", row_group_size=20)
    (d / "sub" / "notes.md").write_text("not an input type: skipped inside a directory")
    return d


def test_output_is_the_same_for_any_worker_count_and_follows_the_convention(corpus: Path, tmp_path: Path) -> None:
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        r = run(str(corpus), "-o", str(out), "--workers", str(workers), "--unit-mb", "0.01", "--shard-tokens", "3000")
        assert r.returncode == 0, r.stderr
        outs.append(out)
    i1, i2 = (json.loads((o / INDEX_FILE).read_text()) for o in outs)
    assert i1 == i2 and i1["units"] > 5 and len(i1["files"]) > i1["units"]  # several units, some split in shards
    for f in i1["files"]:
        assert (outs[0] / f["name"]).read_bytes() == (outs[1] / f["name"]).read_bytes()
    assert i1["documents"] == 300 + 50 + 120 + 90 and i1["version"] == 2 and i1["dtype"] == "uint16"
    assert i1["tokenizer"]["name"] == "builtin" and len(i1["tokenizer"]["sha256"]) == 64

    # every document is BOS + the tokenizer's ids + EOS, in input order (files sorted by path)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    ss = ShardSet.open(outs[0], vocab_size=tok.get_vocab_size(), verify="checksum")
    want = docs(300, "A") + docs(50, "B") + docs(120, "C") + docs(90, "D")
    starts = np.concatenate([ss.document_offsets(i)[:-1] for i in range(len(ss.shards))] + [[ss.total_tokens]])
    assert len(starts) == len(want) + 1
    for k in (0, 1, 299, 300, 349, 350, 469, 470, len(want) - 1):
        got = ss.read(int(starts[k]), int(starts[k + 1] - starts[k])).tolist()
        assert got == [ss.bos_id, *tok.encode(want[k], add_special_tokens=False).ids, ss.eos_id], k


def test_the_convention_is_what_torchtitans_hf_path_feeds_the_model(tmp_path: Path) -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    src = tmp_path / "x.jsonl"
    text = "Ada found a red fox by the river."
    src.write_text(json.dumps({"text": text}) + "\n")
    assert prepare.main([str(src), "-o", str(tmp_path / "o"), "--workers", "1", "--no-progress"]) == 0
    ss = ShardSet.open(tmp_path / "o")
    hf = HuggingFaceTokenizer(str(prepare.BUILTIN_TOKENIZER)).encode(text, add_bos=True, add_eos=True)
    assert ss.read(0, ss.total_tokens).tolist() == hf


def test_a_rerun_skips_finished_units_and_redoes_only_what_is_missing(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    args = [str(corpus), "-o", str(out), "--unit-mb", "0.01", "--workers", "2", "--no-progress"]
    r = run(*args, "--parts", "3", "--part", "1")  # one third only: no index yet
    assert r.returncode == 0, r.stderr
    assert not (out / INDEX_FILE).exists() and "index.json is written by the part that finishes last" in r.stderr
    parts = sorted((out / "parts").iterdir())
    first = {p.name: p.stat().st_mtime_ns for p in parts}
    r = run(*args)
    assert r.returncode == 0, r.stderr
    n = json.loads((out / INDEX_FILE).read_text())["units"]
    assert f"{n} work unit(s) of {n}, {len(parts)} already done" in r.stderr
    assert all((out / "parts" / k).stat().st_mtime_ns == v for k, v in first.items())  # not redone
    fresh = tmp_path / "fresh"
    assert run(*args[:-5], "-o", str(fresh), "--unit-mb", "0.01", "--workers", "1").returncode == 0
    assert json.loads((out / INDEX_FILE).read_text()) == json.loads((fresh / INDEX_FILE).read_text())
    # a unit whose record is lost (killed before it was written) is done again, alone
    (out / "parts" / "unit-000002.json").unlink()
    r = run(*args)
    assert r.returncode == 0 and f"{n} work unit(s) of {n}, {n - 1} already done" in r.stderr, r.stderr
    assert json.loads((out / INDEX_FILE).read_text()) == json.loads((fresh / INDEX_FILE).read_text())
    # --merge alone rebuilds the same index from the parts
    (out / INDEX_FILE).unlink()
    assert run("--merge", "-o", str(out)).returncode == 0
    assert json.loads((out / INDEX_FILE).read_text()) == json.loads((fresh / INDEX_FILE).read_text())


def test_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom kubetitan_trainer.data import prepare\ntry:\n    prepare.main(['--help'])\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert 'torchtitan' not in sys.modules, 'torchtitan was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: kubetitan prepare-data" in r.stdout, r.stderr
    r = subprocess.run([*forkrun.python(), "-m", "kubetitan.cli", "prepare-data", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--render-job" in r.stdout, r.stderr


# ---------------------------------------------------------------------------------------------- bad input
def _bad_input(tmp: Path, case: str) -> tuple[list[str], str]:
    """(arguments, a fragment the error must hold) for one kind of bad input."""
    good = [json.dumps({"text": t}) for t in docs(5, "G")]
    f = tmp / "in.jsonl"
    if case == "malformed-json":
        f.write_text("\n".join(good[:3] + ['{"text": "cut off'] + good[3:]) + "\n")
        return [str(f)], f"{f}:4: malformed JSON"
    if case == "missing-field":
        f.write_text("\n".join(good + [json.dumps({"body": "x"})]) + "\n")
        return [str(f)], f"{f}:6: no key 'text' (has: body)"
    if case == "not-text":
        f.write_text("\n".join(good[:1] + [json.dumps({"text": 5})]) + "\n")
        return [str(f)], f"{f}:2: 'text' is int, not text"
    if case == "not-utf8":
        t = tmp / "in.txt"
        t.write_bytes(b"fine line\nsecond fine line\ncaf\xe9 au lait\n")
        return [str(t)], f"{t}:3: is not UTF-8 text (byte 0xe9 at column 4)"
    if case == "late-line-in-a-later-unit":  # the line number is right although the unit starts mid-file
        f.write_text("\n".join(good * 400 + ["{oops"]) + "\n")
        return [str(f), "--unit-mb", "0.05"], f"{f}:2001: malformed JSON"
    if case == "missing-file":
        return [str(tmp / "nope.jsonl")], "nope.jsonl: no such file or directory"
    if case == "unknown-type":
        (tmp / "x.csv").write_text("a,b\n")
        return [str(tmp / "x.csv")], "x.csv: unknown input type"
    if case == "parquet-column":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["x"]}), tmp / "p.parquet")
        return [str(tmp / "p.parquet")], "p.parquet: no column 'text' (columns: body)"
    if case == "damaged-gzip":
        g = tmp / "in.jsonl.gz"
        g.write_bytes(gzip.compress("\n".join(good).encode())[:-12])
        return [str(g)], "in.jsonl.gz: the gzip stream is damaged"
    if case == "bad-tokenizer":
        f.write_text("\n".join(good) + "\n")
        return [str(f), "--tokenizer", str(tmp)], "--tokenizer: no tokenizer.json in"
    if case == "output-is-a-file":
        f.write_text("\n".join(good) + "\n")
        (tmp / "out").write_text("a file where the output directory should go")
        return [str(f)], f"--output {tmp / 'out'}: File exists"
    if case == "other-options-same-output":
        f.write_text("\n".join(good) + "\n")
        assert run(str(f), "-o", str(tmp / "out")).returncode == 0
        return [str(f), "--text-field", "body"], "holds the output of prepare-data with other inputs or options"
    raise AssertionError(case)


BAD_INPUT = ["malformed-json", "missing-field", "not-text", "not-utf8", "late-line-in-a-later-unit", "missing-file",
             "unknown-type", "parquet-column", "damaged-gzip", "bad-tokenizer", "output-is-a-file",
             "other-options-same-output"]


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_exits_2_with_file_line_and_fix(tmp_path: Path, case: str) -> None:
    args, want = _bad_input(tmp_path, case)
    r = run(*args, "-o", str(tmp_path / "out"), "--workers", "2")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert want in r.stderr and "Fix:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout


# ---------------------------------------------------------------------------------------------- bad shards
@pytest.fixture(scope="module")
def good_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("good")
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs(200, "S")))
    assert prepare.main([str(src), "-o", str(d / "s"), "--shard-tokens", "3000", "--workers", "1", "--no-progress"]) == 0
    return d / "s"


def _break(d: Path, case: str) -> tuple[list[str], str]:
    index = json.loads((d / INDEX_FILE).read_text())
    shard = d / index["files"][1]["name"]
    if case == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 10 & ~1])  # cut to 10%, whole tokens
        return [], "is truncated"
    if case == "empty":
        shard.write_bytes(b"")
        return [], "is empty"
    if case == "odd-length":
        shard.write_bytes(shard.read_bytes()[:-1])
        return [], "not a whole number of uint16 tokens"
    if case == "corrupt":
        data = bytearray(shard.read_bytes())
        data[100] ^= 0x01
        shard.write_bytes(bytes(data))
        return [], "is corrupt: its CRC-32"
    if case == "missing-shard":
        shard.unlink()
        return [], "which is missing from"
    if case == "missing-index":
        (d / INDEX_FILE).unlink()
        return [], "no index.json in"
    if case == "vocab-larger-than-model":
        return ["--vocab-size", "100"], "more than the model's vocabulary of 100"
    if case == "id-outside-vocabulary":
        data = bytearray(shard.read_bytes())
        data[10:12] = (60000).to_bytes(2, "little")
        shard.write_bytes(bytes(data))
        entry = index["files"][1]  # a consistent file with a foreign id: its checksums written anew
        entry["checksum"] = prepare.S.crc32_file(shard)
        cb = entry["chunk_bytes"]
        table = np.asarray([zlib.crc32(data[k:k + cb]) for k in range(0, len(data), cb)], dtype="<u4").tobytes()
        (d / entry["chunk_index"]).write_bytes(table)
        entry["chunk_index_checksum"] = prepare.S.crc32_bytes(table)
        (d / INDEX_FILE).write_text(json.dumps(index))
        return [], f"{shard} holds token id 60000 at token offset 5, outside the tokenizer's (index.json) vocabulary"
    raise AssertionError(case)


BAD_SHARDS = ["truncated", "empty", "odd-length", "corrupt", "missing-shard", "missing-index",
              "vocab-larger-than-model", "id-outside-vocabulary"]


@pytest.mark.parametrize("case", BAD_SHARDS)
def test_bad_shards_exit_2_naming_the_file_and_the_fix(good_shards: Path, tmp_path: Path, case: str) -> None:
    import shutil

    d = tmp_path / "s"
    shutil.copytree(good_shards, d)
    assert run("--verify", "-o", str(d)).returncode == 0
    extra, want = _break(d, case)
    r = run("--verify", "-o", str(d), *extra)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert want in r.stderr and "Fix:" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("case", ["truncated", "vocab", "flipped-bit", "other-tokenizer"])
def test_the_trainer_stops_on_bad_shards_with_exit_2_before_training(good_shards: Path, tmp_path: Path,
                                                                       case: str) -> None:
    """The trainer's own start (kubetitan_trainer.main, as torchrun starts a worker): the shards re-check opens the
    ShardSet, so a cut shard or a model vocabulary smaller than the shards' is exit code 2 (not retried) naming the
    file, not a crash-loop or a silent run on 10% of the data. A flipped bit (same size, ids still in the
    vocabulary) is found when the first step reads the chunk, before the step uses it; shards whose index records
    another tokenizer.json than the run's are refused before the first step."""
    import shutil

    from support.specs import tiny_lpt, write_config

    d = tmp_path / "s"
    shutil.copytree(good_shards, d)
    vocab = 2048
    index = json.loads((d / INDEX_FILE).read_text())
    if case == "truncated":
        _break(d, "truncated")
        want = "is truncated"
    elif case == "vocab":  # shards written with a 4096-token tokenizer, a model of 2048 (the builtin tokenizer's 644 fit it)
        (d / INDEX_FILE).write_text(json.dumps({**index, "vocab_size": 4096}))
        want = "tokenizer of 4096 tokens (builtin), more than the model's vocabulary of 2048"
    elif case == "flipped-bit":  # the first shard, which the first step reads (sequential order)
        shard = d / index["files"][0]["name"]
        data = bytearray(shard.read_bytes())
        data[100] ^= 0x01
        shard.write_bytes(bytes(data))
        assert max(np.frombuffer(bytes(data), dtype="<u2")) < index["vocab_size"]
        want = f"shard {shard} is corrupt: bytes 0-"
    else:  # the same vocabulary size, another tokenizer.json
        index["tokenizer"] = {"name": "/data/tokenizers/other", "sha256": "12" * 32, "vocab_size": 644}
        (d / INDEX_FILE).write_text(json.dumps(index))
        want = "the shards' is /data/tokenizers/other (tokenizer.json sha256 1212121212121212…"
    obj = tiny_lpt({"model": {"flavor": "custom", "custom": {"dim": 64, "nLayers": 2, "nHeads": 4, "vocabSize": vocab}},
               "data": {"source": "shards", "order": "sequential", "shards": {"path": str(d)}},
               "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 1},
               "parallelism": {"dataParallelShardDegree": 1}})
    cfg = write_config(tmp_path / "trainer.toml", obj, tmp_path / "dump")
    if case in ("truncated", "vocab"):  # caught by the checks before any process group: the worker alone
        from support import warm
        from support.paths import REPO

        log = tmp_path / "trainer.log"
        proc = warm.popen("kubetitan_trainer.main", ["--job.config_file", str(cfg)],
                          {**os.environ, "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}, log, cwd=REPO)
        code = warm.wait_all([proc], timeout=300)[0]
        out = log.read_text(errors="replace")  # its stdout and stderr
    else:  # the pod's launcher with one worker, as a run starts it
        from support.trainer import launch

        code, out = launch(cfg, 1, f"bad-shards-{case}")
    assert code == 2, out[-3000:]
    assert want in out and "spec.data.shards.path" in out and "Fix:" in out and "Traceback" not in out, out[-3000:]
    said = [line for line in out.splitlines() if want in line and "Config error:" in line]
    assert len(said) == 1, out[-3000:]  # the worker says it once, on one line
    assert "step:" not in out, out[-3000:]  # no step trained


def _long_text(n: int = 5000) -> str:
    """~140 KiB of lines that stress the pre-tokenizers: indentation, tabs, blank lines, punctuation before newlines,
    digit runs, contractions, CRLF, non-ASCII."""
    parts = []
    for i in range(n):
        parts.append([f"def f{i}(x):\n    return x * {i * 7919}\n", f"\tTab line {i}; it's done.\n\n",
                      f"Ünïcode {i}… «quoted» — dash\r\n", f"{i}{i}{i} digits,\n.\n", f"  \n   spaces then text {i}\n",
                      f"'{i}' starts with a quote\n"][i % 6])
    return "".join(parts)


@pytest.mark.parametrize("pre", ["gpt2-bytelevel", "llama3-split"])
def test_long_documents_in_pieces_give_the_same_ids(pre: str, tmp_path: Path) -> None:
    """Memory: a long document is tokenized in pieces cut after a newline before a non-space character, or before a
    single space between two non-space characters; for the two pre-tokenizers piece_safe accepts, that is exactly the
    whole document's ids, with newlines and on one line (no newline at all: cut at spaces only)."""
    from tokenizers import Tokenizer

    spec = json.loads(TOKENIZER.read_text())
    if pre == "llama3-split":
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": prepare.LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    assert prepare.piece_safe(spec)
    f = tmp_path / "tokenizer.json"
    f.write_text(json.dumps(spec))
    prepare._init_worker(str(f), None)
    whole = Tokenizer.from_file(str(f))
    lines = _long_text()
    for text in (lines, lines.replace("\n", " ")):
        stats: dict[str, int] = {}
        pieces = list(prepare.text_pieces(text, prepare.PIECE_CHARS, stats))
        assert len(pieces) > 1 and "".join(pieces) == text and not stats
        assert [i for ids in prepare.encode_pieces(text) for i in ids] == whole.encode(text, add_special_tokens=False).ids


def test_text_without_whitespace_is_cut_at_the_piece_size() -> None:
    """No whitespace to cut at within a piece's size: a hard cut at exactly ``size`` characters, counted; pieces never
    exceed twice the size, and they join to the text."""
    text = "x" * 1000 + " y" + "z" * 2500 + "\nend"
    stats: dict[str, int] = {}
    pieces = list(prepare.text_pieces(text, 400, stats))
    assert "".join(pieces) == text
    # a hard cut at 400; before " y" (found within 800..1200); hard cuts at 1400 ... 3000; after the newline
    assert [len(p) for p in pieces] == [400, 600, 400, 400, 400, 400, 400, 503, 3]
    assert pieces[2].startswith(" y") and pieces[-1] == "end" and stats == {"hard_cuts": 6}


def test_tokenizers_that_may_not_be_cut_are_tokenized_whole() -> None:
    spec = json.loads(TOKENIZER.read_text())
    assert not prepare.piece_safe({**spec, "normalizer": {"type": "NFC"}})
    assert not prepare.piece_safe({**spec, "pre_tokenizer": {**spec["pre_tokenizer"], "add_prefix_space": True}})
    assert not prepare.piece_safe({**spec, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁"}})
    other = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\S+|\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    assert not prepare.piece_safe({**spec, "pre_tokenizer": other})


# ---------------------------------------------------------------------------------------------- long documents
PEAK_RSS = r"""
import resource, subprocess, sys
r = subprocess.run([sys.executable, "-m", "kubetitan_trainer.data.prepare", *sys.argv[1:]], capture_output=True, text=True)
sys.stderr.write(r.stderr)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # KiB: the largest of prepare-data and its workers
sys.exit(r.returncode)
"""


def test_a_10_mb_single_line_document_is_prepared_under_1_gib(tmp_path: Path) -> None:
    """One 10 MB document without a newline (a .txt line) in well under 1 GiB: it is tokenized and written piece by
    piece, and stays one document (BOS ... EOS): 270 MB here, where tokenizing it whole took 1.3 GB. A word-level
    tokenizer keeps this test to about 3 CPU-seconds (the builtin byte-level BPE tokenizes about 2 MB a CPU-second:
    bench/data_bench.py measures that one, 10 MB in 100 MB); it is not piece-safe, so this is the coarse (1 MiB) cut."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "a , b . c ; 1 2 x y z ada fox by it".split()  # 2.4 characters a token: 4.2 M tokens
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<s>", "</s>", "<unk>", *words, "short", "first",
                                                                   "document"])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    sentence = " ".join(words)
    repeats = 10_000_000 // (len(sentence) + 1)
    line = " ".join([sentence] * repeats)  # 10.0 MB, no newline
    (tmp_path / "one.txt").write_text("a short first document\n" + line + "\n")
    r = subprocess.run([sys.executable, "-c", PEAK_RSS, str(tmp_path / "one.txt"), "-o", str(tmp_path / "out"),
                        "--tokenizer", str(tmp_path / "tok"), "--workers", "1", "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    peak_mib = int(r.stdout.split()[-1]) / 1024
    assert peak_mib < 1024, f"peak RSS {peak_mib:.0f} MiB"
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    assert index["documents"] == 2 and index["long_documents"] == 1 and index["hard_cuts"] == 0
    ss = ShardSet.open(tmp_path / "out", verify="checksum")
    offsets = ss.document_offsets(0)
    n = len(words) * repeats
    assert offsets.tolist() == [0, 6, 6 + n + 2]  # <s> a short first document </s>, then <s> the line </s>
    ids = ss.read(6, n + 2)
    assert ids[0] == 0 and ids[-1] == 1  # BOS and EOS once: one document
    assert (ids[1:-1].reshape(repeats, len(words)) == [tok.token_to_id(w) for w in words]).all()  # every id, in order


def test_units_are_whole_lines_and_balanced_by_bytes(tmp_path: Path) -> None:
    """A unit ends at a line start, so a long line makes its unit as big as the work in it; the Indexed Job's parts
    split the units by bytes, and the workers get the largest units first."""
    f = tmp_path / "in.txt"
    short = "a short line of text\n"
    f.write_text(short * 50 + "x" * 5000 + "\n" + short * 400)
    plan = prepare.make_plan([f], 1000, {"text_field": "text"})
    sizes = prepare.unit_sizes(plan)
    assert sum(sizes) == f.stat().st_size
    data = f.read_bytes()
    assert all(data[p[1] - 1:p[1]] == b"\n" for u in plan["units"] for p in u if p[1] > 0)  # ranges start at lines
    assert max(sizes) > 5000 and sorted(sizes)[-2] <= 1000 + len(short)  # the long line's unit alone is big
    big = sizes.index(max(sizes))
    parts = [prepare.part_units(sizes, 2, p) for p in range(2)]
    assert list(parts[0]) + list(parts[1]) == list(range(len(sizes)))
    shares = [sum(sizes[u] for u in p) for p in parts]
    assert abs(shares[0] - shares[1]) <= max(sizes), shares  # by count it would be 2 units against 9: 6.3 kB to 4.5 kB
    jobs = [prepare.UnitJob(u, unit, [str(f)], "", "", "text", "uint16", 0, 1, 10, 10)
            for u, unit in enumerate(plan["units"])]
    order = [j.unit for j in prepare.dispatch_order(jobs)]
    assert order[0] == big and sorted(order) == list(range(len(sizes)))


def test_filters_skip_documents_and_count_them_in_the_index(tmp_path: Path) -> None:
    """--min-chars, --max-chars and --drop-binary (control characters, or a line that is not UTF-8) skip documents;
    index.json counts each reason, empty lines included, and records the filters."""
    f = tmp_path / "in.txt"
    f.write_bytes(b"tiny\n" + b"a normal line of text here\n" * 3 + b"\n" + b"x" * 300 + b"\n"
                  + b"\x00\x01\x02\x03 binary junk \x04\x05\x06\n" + b"caf\xe9 au lait\n")
    r = run(str(f), "-o", str(tmp_path / "out"), "--min-chars", "10", "--max-chars", "200", "--drop-binary",
            "--workers", "1")
    assert r.returncode == 0, r.stderr
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    assert index["documents"] == 3
    assert index["skipped"] == {"empty": 1, "short": 1, "long": 1, "binary": 2}
    assert index["filters"] == {"min_chars": 10, "max_chars": 200, "drop_binary": True}
    # the dataset card: the source's sha256, the filters and what they left out, the counts, the tokenizer
    import hashlib

    card = (tmp_path / "out" / prepare.CARD_FILE).read_text()
    assert f"| `{f}` | {f.stat().st_size:,} | `{hashlib.sha256(f.read_bytes()).hexdigest()}` |" in card
    assert "| 10 | 200 | yes | 1 | 1 | 1 | 2 |" in card
    assert f"| {index['total_tokens']:,} | 3 | 1 | uint16 |" in card and index["tokenizer"]["sha256"] in card
    assert prepare.looks_binary("text\ufffd" * 3) and not prepare.looks_binary("page one\fpage two\ttab\r\n")
