"""The tests' one port allocator (kmockx.harness.free_port): ports a test names for a listener come from a block of
the process's own below the kernel's ephemeral range, so the kubelet double's rendezvous port can never equal a
test's metrics port again (a TCPStore binding every interface made every worker of a gang fail with EADDRINUSE)."""

from __future__ import annotations

import os
import socket

import pytest

from kmockx import harness


@pytest.mark.parametrize(("worker", "start"), [("", 10000), ("gw0", 11000), ("gw1", 12000), ("gw18", 30000)],
                         ids=["no-xdist", "gw0", "gw1", "block-of-29500-skipped"])
def test_each_process_has_its_own_block_below_the_ephemeral_range(worker, start) -> None:
    block = harness._port_block(worker, 60999)
    assert (block.start, len(block)) == (start, harness.PORT_BLOCK)
    assert 29500 not in block


def test_a_block_that_would_reach_the_ephemeral_range_is_refused() -> None:
    with pytest.raises(RuntimeError, match="below the ephemeral range"):
        harness._port_block("gw30", 32768)


def _block() -> range:
    return harness._port_block(os.environ.get("PYTEST_XDIST_WORKER", ""), harness._ephemeral_low())


def test_ports_are_never_handed_out_twice_in_a_row_and_are_free(monkeypatch) -> None:
    monkeypatch.setattr(harness, "_next_port", [])
    got = [harness.free_port() for _ in range(20)]
    assert len(set(got)) == 20
    assert all(p in _block() and p < harness._ephemeral_low() for p in got)


def test_a_port_something_listens_on_is_skipped(monkeypatch) -> None:
    port = _block().start + 5
    monkeypatch.setattr(harness, "_next_port", [port])
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert harness.free_port() == port + 1
    monkeypatch.setattr(harness, "_next_port", [port])
    assert harness.free_port() == port  # free again once it is closed
