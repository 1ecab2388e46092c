"""The shard format and its reader (kubetitan_trainer.data.shards): what it reads, and every way a directory can be bad
raising a ConfigError that names the file and the fix. The subprocess cases (exit code 2, no traceback) are in
test_prepare.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from kubetitan_trainer.data.shards import INDEX_FILE, ShardSet, ShardWriter, TokenizerIdentity, make_index
from kubetitan_trainer.errors import ConfigError


def write_set(d: Path, docs_per_shard: list[list[list[int]]], vocab: int = 1000, dtype: str = "uint16",
              chunk_bytes: int = 64 << 10) -> list[dict]:
    d.mkdir(parents=True, exist_ok=True)
    files = []
    for k, docs in enumerate(docs_per_shard):
        w = ShardWriter(d, f"shard-{k:06d}.bin", dtype, chunk_bytes=chunk_bytes)
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


def _flip(path: Path, byte: int) -> None:
    data = bytearray(path.read_bytes())
    data[byte] ^= 0x01  # the low bit of a token: the id stays inside the vocabulary, the size stays the same
    path.write_bytes(bytes(data))


def test_a_lazy_reader_verifies_the_chunks_a_read_touches_before_returning_them(tmp_path: Path) -> None:
    """A shard of 10 chunks of 64 bytes (32 uint16 tokens) with one bit flipped in chunk 6: reads before it return
    and verify only their own chunks; the first read touching chunk 6 is refused naming the shard and the bytes."""
    d = tmp_path / "s"
    tokens = [1, *range(10, 10 + 318), 2]  # 320 tokens: 640 bytes, 10 chunks
    files = write_set(d, [[tokens]], chunk_bytes=64)
    assert files[0]["chunk_bytes"] == 64 and (d / files[0]["chunk_index"]).stat().st_size == 10 * 4
    _flip(d / "shard-000000.bin", 6 * 64 + 10)
    ss = ShardSet.open(d, vocab_size=1000, verify="lazy")
    assert ss.read(40, 20).tolist() == tokens[40:60]  # bytes 80-120: chunk 1 only
    assert ss._chunk_ok[0].tolist() == [False, True] + [False] * 8
    assert ss.read(0, 192).tolist() == tokens[:192]  # chunks 0-5
    assert ss._chunk_ok[0].tolist() == [True] * 6 + [False] * 4 and not ss.shards[0].verified
    with pytest.raises(ConfigError) as e:
        ss.read(190, 10)  # tokens 190-199: chunks 5 and 6
    msg = str(e.value)
    assert f"shard {d / 'shard-000000.bin'} is corrupt: bytes 384-448 (chunk 6)" in msg and "Fix:" in msg, msg
    assert e.value.exit_code == 2


def test_every_chunk_verified_marks_the_shard_verified(tmp_path: Path) -> None:
    d = tmp_path / "s"
    tokens = [1, *range(10, 10 + 97), 2]  # 99 tokens: 198 bytes, 4 chunks (the last one short)
    write_set(d, [[tokens]], chunk_bytes=64)
    ss = ShardSet.open(d, verify="lazy")
    for k in range(0, 99, 9):
        ss.read(k, min(9, 99 - k))
    assert ss.shards[0].verified and ss._chunk_ok[0].all()
    _flip(d / "shard-000000.bin", 196)  # after the checks: verified bytes are not checked again (once per chunk)
    assert ss.read(98, 1).tolist() == [3]


def test_a_directory_without_chunk_checksums_is_verified_per_shard_on_first_read(tmp_path: Path) -> None:
    """Directories written before the chunk index: the whole shard's CRC-32 on its first read."""
    d = tmp_path / "s"
    write_set(d, [[[1, 10, 2]], [[1, 11, 12, 2]]], chunk_bytes=64)
    index = json.loads((d / INDEX_FILE).read_text())
    for f in index["files"]:
        (d / f.pop("chunk_index")).unlink()
        del f["chunk_index_checksum"], f["chunk_bytes"]
    (d / INDEX_FILE).write_text(json.dumps(index))
    _flip(d / "shard-000001.bin", 6)
    ss = ShardSet.open(d, verify="lazy")
    assert ss.read(0, 3).tolist() == [1, 10, 2] and ss.shards[0].verified
    with pytest.raises(ConfigError, match="shard-000001.bin is corrupt: its CRC-32 is"):
        ss.read(3, 1)


def test_a_corrupt_or_missing_chunk_index_is_named(tmp_path: Path) -> None:
    d = tmp_path / "s"
    write_set(d, [[[1, *range(10, 60), 2]]], chunk_bytes=64)
    _flip(d / "shard-000000.crc", 0)
    with pytest.raises(ConfigError, match="chunk index .*shard-000000.crc is corrupt"):
        ShardSet.open(d, verify="lazy").read(0, 4)
    (d / "shard-000000.crc").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="chunk index .*shard-000000.crc has 1 bytes where index.json says 8"):
        ShardSet.open(d, verify="lazy")
    (d / "shard-000000.crc").unlink()
    with pytest.raises(ConfigError, match="lists shard-000000.crc, which is missing"):
        ShardSet.open(d)


def test_verify_checksum_checks_the_chunks_too(tmp_path: Path) -> None:
    """A .bin whose chunk index disagrees with it (both consistent with index.json) is found by a full check."""
    d = tmp_path / "s"
    write_set(d, [[[1, *range(10, 60), 2]]], chunk_bytes=64)
    crc = d / "shard-000000.crc"
    data = bytearray(crc.read_bytes())
    data[0] ^= 1
    crc.write_bytes(bytes(data))
    index = json.loads((d / INDEX_FILE).read_text())
    from kubetitan_trainer.data.shards import crc32_bytes

    index["files"][0]["chunk_index_checksum"] = crc32_bytes(bytes(data))
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"is corrupt: bytes 0-64 \(chunk 0\)"):
        ShardSet.open(d, verify="checksum")


def test_shards_of_another_tokenizer_are_refused_naming_both_and_the_fix(tmp_path: Path) -> None:
    """The identity is the sha256 of tokenizer.json: the same hash under another name or path is the same
    tokenizer; another hash is refused whatever the vocabulary."""
    d = tmp_path / "s"
    write_set(d, [[[1, 10, 2]]])  # the index records {"name": "test", "sha256": "000..."}
    ShardSet.open(d, tokenizer=TokenizerIdentity("/elsewhere/copy", "0" * 64))  # same file, other path: fine
    with pytest.raises(ConfigError) as e:
        ShardSet.open(d, vocab_size=1000, tokenizer=TokenizerIdentity("builtin", "ab" * 32))
    msg = str(e.value)
    assert "prepared with another tokenizer than this run's" in msg, msg
    assert "the shards' is test (tokenizer.json sha256 0000000000000000…" in msg, msg
    assert "the run's is builtin (sha256 abababababababab…" in msg, msg
    assert "Fix: re-run `kubetitan prepare-data --tokenizer" in msg and "point spec.tokenizer at" in msg, msg
    index = json.loads((d / INDEX_FILE).read_text())
    del index["tokenizer"]["sha256"]
    (d / INDEX_FILE).write_text(json.dumps(index))
    ShardSet.open(d, tokenizer=TokenizerIdentity("builtin", "ab" * 32))  # nothing recorded: nothing to compare


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
