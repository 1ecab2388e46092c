"""Every ``KUBETITAN_*`` environment name in the product's sources is in docs/trainer.md's "Environment variables"
table, and the table names none that is gone (pure text: well under a second). Tuning is not an environment variable:
it is ``[kubetitan.runtime]`` (``spec.runtime``)."""

from __future__ import annotations

import functools
import re

from support.paths import REPO

SOURCES = ("operator", "trainer", "images", "charts")
NAME = re.compile(r"\bKUBETITAN_[A-Z0-9_]*[A-Z0-9]\b")
SECTION = "## Environment variables"


@functools.cache
def in_sources() -> dict[str, str]:
    """Each name -> one file it is in (``KUBETITAN_`` alone, the reserved prefix, is not a name)."""
    found: dict[str, str] = {}
    for root in SOURCES:
        for path in sorted((REPO / root).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".png"):
                for name in NAME.findall(path.read_text(errors="replace")):
                    found.setdefault(name, str(path.relative_to(REPO)))
    return found


def in_doc() -> list[str]:
    text = (REPO / "docs" / "trainer.md").read_text()
    section = text[text.index(SECTION):].split("\n## ", 1)[0]
    return re.findall(r"^\| `(KUBETITAN_[A-Z0-9_]+)` \|", section, flags=re.M)


def test_the_environment_table_lists_every_name_in_the_sources_and_no_other():
    code, doc = in_sources(), in_doc()
    assert len(doc) == len(set(doc)), "a name is listed twice in docs/trainer.md's environment table"
    missing = {n: f for n, f in code.items() if n not in doc}
    assert not missing, f"add these to docs/trainer.md's {SECTION!r} table (who sets and reads them): {missing}"
    gone = sorted(set(doc) - set(code))
    assert not gone, f"no longer in the sources: remove them from docs/trainer.md's {SECTION!r} table: {gone}"


def test_no_tuning_knob_is_read_from_the_environment():
    """The tuning that was read from worker variables (refused by the API's env.reserved, so no cluster run could use
    it) is the typed [kubetitan.runtime] table now."""
    removed = {"KUBETITAN_TIER_READ", "KUBETITAN_TIER_LOAD_THREADS", "KUBETITAN_TIER_DEFER_OPTIMIZER",
               "KUBETITAN_TIER_DEFER_THREADS", "KUBETITAN_TIER_DEFER_SWITCH_MS", "KUBETITAN_STAGING_WRITE",
               "KUBETITAN_STAGING_WRITE_THREADS", "KUBETITAN_EARLY_CUDA_CONTEXT", "KUBETITAN_AOT_PRECOMPILE"}
    assert not removed & set(in_sources())
