"""The trainer's one retry loop (kubetitan_trainer.retry) and its callers' policies, pure: waits recorded instead of
slept, fake S3 readers instead of a server (tests/s3 stages through a real one)."""

from __future__ import annotations

import pytest

from kubetitan_trainer import retry as retry_mod
from kubetitan_trainer.errors import ConfigError, TransientError
from kubetitan_trainer.retry import retry


def failing(errors: list[BaseException], result: object = "ok"):
    """A call that raises ``errors`` one per try, then returns ``result``; ``calls`` counts the tries."""

    def fn():
        fn.calls += 1
        if errors:
            raise errors.pop(0)
        return result

    fn.calls = 0
    return fn


WAITS = [
    ("doubling-then-capped", dict(attempts=6, first_wait=1.0, max_wait=5.0), [1.0, 2.0, 4.0, 5.0, 5.0]),
    ("full-jitter-at-half", dict(attempts=4, first_wait=1.0, max_wait=5.0, jitter=lambda: 0.5), [0.5, 1.0, 2.0]),
    ("one-try-no-wait", dict(attempts=1), []),
]


@pytest.mark.parametrize(("kw", "want"), [c[1:] for c in WAITS], ids=[c[0] for c in WAITS])
def test_the_waits_between_tries_and_the_last_error_raised_as_it_is(kw, want):
    waits: list[float] = []
    fn = failing([ValueError(f"no {i}") for i in range(10)])
    with pytest.raises(ValueError, match=f"no {kw['attempts'] - 1}"):
        retry(fn, what="x", transient=lambda e: True, sleep=waits.append, **kw)
    assert (fn.calls, waits) == (kw["attempts"], want)


def test_a_call_that_recovers_returns_its_value_and_each_retry_is_said_once():
    said: list[str] = []
    fn = failing([ConnectionError("reset\nby peer"), ConnectionError("reset")])
    assert retry(fn, what="GET a", transient=lambda e: True, attempts=5, sleep=lambda s: None, say=said.append) == "ok"
    assert said == ["GET a: ConnectionError: reset; retry 1/4 in 1.0 s", "GET a: ConnectionError: reset; retry 2/4 in 2.0 s"]


def test_an_error_the_caller_does_not_call_transient_is_raised_at_once():
    waits: list[float] = []
    fn = failing([PermissionError("denied")])
    with pytest.raises(PermissionError):
        retry(fn, what="x", transient=lambda e: not isinstance(e, PermissionError), attempts=5, sleep=waits.append)
    assert (fn.calls, waits) == (1, [])


# ---------------------------------------------------------------------------------------------- S3 staging's parts
class Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def seek(self, pos: int) -> None:
        self.pos = pos

    def readinto(self, buf: bytearray) -> int:
        chunk = self.data[self.pos:self.pos + len(buf)]
        buf[:len(chunk)] = chunk
        return len(chunk)


class Client:
    """``get_object`` answers from ``script``: an exception is raised, bytes are served (short ones too)."""

    def __init__(self, *script: object) -> None:
        self.script, self.calls = list(script), 0

    def get_object(self, bucket, key, **_):
        self.calls += 1
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return Reader(step)


def stager(client: Client):
    pytest.importorskip("s3torchconnector")
    from kubetitan_trainer.data import s3shards
    from kubetitan_trainer.storage import S3Settings

    st = object.__new__(s3shards.Stager)
    st.uri, st.bucket, st.prefix, st.field, st._client = "s3://b/p", "b", "p", "kubetitan.data.shards_path", client
    st.settings = s3shards.StageSettings(s3=S3Settings(uri="s3://b/p"), stage_dir="/nowhere")
    return st


PARTS = [
    ("ok", [b"0123456789"], b"2345", 1, []),
    ("dropped-then-ok", [OSError("reset"), b"0123456789"], b"2345", 2, [0.5]),
    ("short-read-then-ok", [b"0123", b"0123456789"], b"2345", 2, [0.5]),
    ("three-failures-no-wait-after-the-last", [OSError("a"), OSError("b"), OSError("c")], TransientError, 3, [0.5, 1.0]),
    ("access-denied-not-retried", [RuntimeError("AccessDenied: Access Denied")], ConfigError, 1, []),
]


@pytest.mark.parametrize(("script", "want", "calls", "waits"), [c[1:] for c in PARTS], ids=[c[0] for c in PARTS])
def test_a_part_get_is_retried_by_the_one_loop(monkeypatch, script, want, calls, waits):
    slept: list[float] = []
    monkeypatch.setattr(retry_mod.time, "sleep", slept.append)
    client = Client(*script)
    st = stager(client)
    if isinstance(want, bytes):
        assert bytes(st._get("f.bin", None, 2, 6)) == want
    else:
        with pytest.raises(want):
            st._get("f.bin", None, 2, 6)
    assert (client.calls, slept) == (calls, waits)
