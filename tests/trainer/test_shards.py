"""The shard format and its reader (kubetitan_trainer.shards): what it reads, and every way a directory can be bad
raising a ConfigError that names the file and the fix. The subprocess cases (exit code 2, no traceback) are in
test_prepare.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from kubetitan_trainer.errors import ConfigError
from kubetitan_trainer.shards import INDEX_FILE, ShardSet, ShardWriter, make_index


def write_set(d: Path, docs_per_shard: list[list[list[int]]], vocab: int = 1000, dtype: str = "uint16") -> list[dict]:
    d.mkdir(parents=True, exist_ok=True)
    files = []
    for k, docs in enumerate(docs_per_shard):
        w = ShardWriter(d, f"shard-{k:06d}.bin", dtype)
        w.add(np.asarray([t for doc in docs for t in doc]), np.asarray([len(doc) for doc in docs]))
        files.append(w.close())
    index = make_index(files, dtype=dtype, vocab_size=vocab, bos_id=1, eos_id=2,
                       tokenizer={"name": "test", "sha256": "0" * 64})
    (d / INDEX_FILE).write_text(json.dumps(index))
    return files


@pytest.fixture
def two_shards(tmp_path: Path) -> Path:
    d = tmp_path / "s"
    write_set(d, [[[1, 10, 11, 2], [1, 12, 2]], [[1, 13, 14, 15, 2]]])
    return d


def test_reads_the_concatenated_stream_across_shards(two_shards: Path) -> None:
    ss = ShardSet.open(two_shards, vocab_size=1000, verify="checksum")
    assert (ss.total_tokens, ss.num_documents, ss.dtype, ss.bos_id, ss.eos_id) == (12, 3, "uint16", 1, 2)
    assert ss.read(5, 5).tolist() == [12, 2, 1, 13, 14] and ss.read(5, 5).dtype == np.int64
    assert ss.read(0, 12).tolist() == [1, 10, 11, 2, 1, 12, 2, 1, 13, 14, 15, 2]
    assert ss.document_offsets(0).tolist() == [0, 4, 7] and ss.document_offsets(1).tolist() == [7, 12]
    with pytest.raises(IndexError):
        ss.read(10, 3)


def test_uint32_and_lazy_checksums(tmp_path: Path) -> None:
    write_set(tmp_path / "s", [[[1, 70000, 2]], [[1, 5, 2]]], vocab=100000, dtype="uint32")
    ss = ShardSet.open(tmp_path / "s", verify="lazy")
    assert ss.read(1, 3).tolist() == [70000, 2, 1]
    assert ss.shards[0].verified and ss.shards[1].verified


def _corrupt(d: Path, how: str) -> str:
    """Break a good directory one way; returns a fragment the error message must hold."""
    b = d / "shard-000001.bin"
    index = json.loads((d / INDEX_FILE).read_text())
    if how == "no-dir":
        return "does not exist"
    if how == "no-index":
        (d / INDEX_FILE).unlink()
        return "no index.json"
    if how == "bad-json":
        (d / INDEX_FILE).write_text("{not json")
        return "cannot be read as JSON"
    if how == "missing-key":
        del index["vocab_size"]
        (d / INDEX_FILE).write_text(json.dumps(index))
        return "'vocab_size' is missing"
    if how == "missing-shard":
        b.unlink()
        return "shard-000001.bin, which is missing"
    if how == "truncated":
        b.write_bytes(b.read_bytes()[:4])
        return "is truncated"
    if how == "empty":
        b.write_bytes(b"")
        return "is empty"
    if how == "odd-length":
        b.write_bytes(b.read_bytes() + b"\x00")
        return "not a whole number of uint16 tokens"
    if how == "no-tokens":
        index["files"] = []
        (d / INDEX_FILE).write_text(json.dumps(index))
        return "holds no tokens"
    if how == "corrupt":
        data = bytearray(b.read_bytes())
        data[2] ^= 0xFF
        b.write_bytes(bytes(data))
        return "is corrupt: its CRC-32"
    if how == "future-version":
        index["version"] = 9
        (d / INDEX_FILE).write_text(json.dumps(index))
        return "format version 9"
    raise AssertionError(how)


CASES = ["no-dir", "no-index", "bad-json", "missing-key", "missing-shard", "truncated", "empty", "odd-length",
         "no-tokens", "corrupt", "future-version"]


@pytest.mark.parametrize("how", CASES)
def test_a_bad_directory_is_a_config_error_naming_the_file_and_the_fix(tmp_path: Path, how: str) -> None:
    d = tmp_path / "s"
    write_set(d, [[[1, 10, 2]], [[1, 11, 12, 2]]])
    want = _corrupt(d if how != "no-dir" else d, how)
    path = d / "nothing-here" if how == "no-dir" else d
    with pytest.raises(ConfigError) as e:
        ShardSet.open(path, verify="checksum")
    assert want in str(e.value) and "Fix:" in str(e.value), str(e.value)
    assert e.value.exit_code == 2


def test_corruption_is_found_lazily_on_first_read(tmp_path: Path) -> None:
    d = tmp_path / "s"
    write_set(d, [[[1, 10, 2]], [[1, 11, 12, 2]]])
    _corrupt(d, "corrupt")
    ss = ShardSet.open(d, verify="lazy")
    assert ss.read(0, 3).tolist() == [1, 10, 2]  # shard 0 is fine
    with pytest.raises(ConfigError, match="shard-000001.bin is corrupt"):
        ss.read(2, 2)


def test_vocabulary_checks(tmp_path: Path) -> None:
    d = tmp_path / "s"
    write_set(d, [[[1, 10, 2]], [[1, 900, 2]]], vocab=1000)
    with pytest.raises(ConfigError, match="tokenizer of 1000 tokens .* more than the model's vocabulary of 512"):
        ShardSet.open(d, vocab_size=512)
    # an id the index's own vocabulary does not hold (a shard not written with that tokenizer)
    (d / INDEX_FILE).write_text(json.dumps({**json.loads((d / INDEX_FILE).read_text()), "vocab_size": 800}))
    ss = ShardSet.open(d)
    assert ss.read(0, 4).tolist() == [1, 10, 2, 1]
    with pytest.raises(ConfigError, match=r"shard-000001.bin holds token id 900 at token offset 1, outside"):
        ss.read(2, 3)


def test_dtype_mismatch_names_the_setting(two_shards: Path) -> None:
    with pytest.raises(ConfigError, match="shards_dtype .* is uint32 but .* hold uint16"):
        ShardSet.open(two_shards, dtype="uint32")


def test_version_1_is_read_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "v1"
    d.mkdir()
    np.asarray([5, 6, 2, 7], dtype=np.uint16).tofile(d / "shard-00000.bin")
    np.asarray([8, 2], dtype=np.uint16).tofile(d / "shard-00001.bin")
    (d / INDEX_FILE).write_text(json.dumps({"dtype": "uint16", "vocab_size": 100, "eos_id": 2, "tokenizer": "/t",
                                            "documents": 3, "total_tokens": 6,
                                            "files": [{"name": "shard-00000.bin", "tokens": 4},
                                                      {"name": "shard-00001.bin", "tokens": 2}]}))
    with caplog.at_level(logging.WARNING, logger="kubetitan.shards"):
        ss = ShardSet.open(d, verify="checksum")
    assert "version-1 shards index" in caplog.text and "Re-run `kubetitan prepare-data`" in caplog.text
    assert (ss.version, ss.bos_id, ss.num_documents, ss.tokenizer_name) == (1, None, 3, "/t")
    assert ss.read(2, 4).tolist() == [2, 7, 8, 2]
    (d / "shard-00001.bin").write_bytes(b"\x01")
    with pytest.raises(ConfigError, match="not a whole number"):
        ShardSet.open(d)
