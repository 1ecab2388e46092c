"""Window sources for the global stream's tests (``kubetitan_trainer.data.stream``): a token stream whose tokens
name their own offset, so a window's tokens say which window it is. Torch-free."""

from __future__ import annotations

import numpy as np

from kubetitan_trainer.data.stream import WindowSource


class ArangeShards:
    """A token stream whose token at offset o is o: a window's tokens say which window it is."""

    dtype = "uint32"

    def __init__(self, total_tokens: int) -> None:
        self.total_tokens = total_tokens

    def read(self, offset: int, n: int) -> np.ndarray:
        assert 0 <= offset and offset + n <= self.total_tokens
        return np.arange(offset, offset + n, dtype=np.int64)


SEQ = 7  # windows of 8 tokens


def source(name: str, windows: int, held_out_percent: float = 0.0) -> WindowSource:
    return WindowSource(name, ArangeShards(windows * (SEQ + 1) + 3), SEQ, held_out_percent)
