"""An in-memory stand-in for torch's ``Store`` (``set``, ``get``, ``check``, ``add``): the calls the launchers'
rendezvous-store protocol makes (``kubetitan_trainer.launch.store``), without torch. Thread-safe, as the TCPStore
that several agents share is."""

from __future__ import annotations

import threading


class MemStore:
    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self.kv[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        with self._lock:
            return self.kv[key]

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self.kv for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self.kv.get(key, b"0")) + amount
            self.kv[key] = str(value).encode()
            return value
