"""Kept for trainer tests written before tests/support: the builders are ``support.specs`` (TINY, tiny_lpt,
write_config); import them from there."""

from support.specs import TINY, write_config  # noqa: F401 - re-exported
from support.specs import tiny_lpt as lpt  # noqa: F401 - re-exported under its old name
