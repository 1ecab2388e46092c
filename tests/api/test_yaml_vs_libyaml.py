"""The strict YAML reader reads what kubectl's reader (libyaml / go-yaml) reads: merge keys whose written keys
override merged ones, ``<<: [*a, *b]`` lists, a tab before a trailing comment; and it still refuses what it refuses
on purpose (a key written twice, a tab that indents). Checked case by case and on a generated set against libyaml
(PyYAML's C binding, ``yaml.CSafeLoader``)."""

from __future__ import annotations

import random

import pytest
import yaml

from kubetitan_core import strictyaml
from kubetitan_core.strictyaml import YamlError

# Each case: text, what libyaml reads (and so should we).
SAME_AS_LIBYAML = {
    "merge-explicit-overrides": "labels: &l {app: x, team: a}\nmeta:\n  <<: *l\n  team: b\n",
    "merge-list": "a: &a {x: 1}\nc: &c {v: 2, z: 3}\nb:\n  <<: [*a, *c]\n  w: 1\n",
    "merge-list-explicit-overrides": "a: &a {x: 1}\nc: &c {v: 2, z: 3}\nb:\n  <<: [*a, *c]\n  z: 9\n",
    "merge-nested": "d: &d {p: {q: 1}}\ne: &e\n  <<: *d\n  r: 2\nf:\n  <<: *e\n  p: 5\n",
    "merge-in-flow": "a: &a {x: 1}\nb: {<<: *a, x: 2}\n",
    "tab-before-comment": "steps: 1000\t# c\n",
    "tabs-before-comment": "spec:\n  training:\n    steps: 10 \t \t# ten\n",
    "tab-in-flow": "x: [1,\t2, {a:\t3}]\n",
    "tab-after-sequence-value": "- a\t# c\n- b\n",
}


@pytest.mark.parametrize("text", SAME_AS_LIBYAML.values(), ids=SAME_AS_LIBYAML.keys())
def test_reads_what_libyaml_reads(text):
    assert strictyaml.load_all(text) == list(yaml.load_all(text, Loader=yaml.CSafeLoader))


def test_in_a_merge_list_the_earlier_map_wins():
    """The YAML merge spec and go-yaml (kubectl's reader: ``decoder.merge`` walks the list backwards) let a key of an
    earlier map override the same key of a later one. PyYAML's constructor (with or without libyaml) lets the later
    one win or not depending on whether the two key strings are one object (its ``flatten_mapping`` deduplicates by
    ``id()``), so here we follow the spec and kubectl, and the generated set below never repeats a key across
    merged maps."""
    text = "a: &a {x: 1}\nc: &c {x: 2, z: 3}\nb:\n  <<: [*a, *c]\n"
    assert strictyaml.load_all(text)[0]["b"] == {"x": 1, "z": 3}
    text = "a: &a {x: 1}\nc: &c {x: 2, z: 3}\nb:\n  <<: [*c, *a]\n"
    assert strictyaml.load_all(text)[0]["b"] == {"x": 2, "z": 3}


REFUSED = {
    "written-twice": ("a: 1\na: 2\n", "duplicate key"),
    "written-twice-after-merge": ("m: &m {x: 1}\nb:\n  <<: *m\n  x: 2\n  x: 3\n", "duplicate key"),
    "two-merge-keys": ("a: &a {x: 1}\nb:\n  <<: *a\n  <<: *a\n", "duplicate merge key"),
    "merge-of-scalar": ("b:\n  <<: 3\n", "merge key takes a mapping"),
    "merge-list-of-scalar": ("a: &a {x: 1}\nb:\n  <<: [*a, 3]\n", "merge key takes a mapping"),
    "tab-indent": ("a:\n\tb: 1\n", "not valid YAML"),
}


@pytest.mark.parametrize("text, fragment", REFUSED.values(), ids=REFUSED.keys())
def test_still_refuses(text, fragment):
    with pytest.raises(YamlError, match=fragment):
        strictyaml.load_all(text)


# ------------------------------------------------------------------ a generated set
_WORDS = ["alpha", "b2", "team", "x_y", "c-d", "v1", "model", "steps", "Z"]


def _scalar(r: random.Random) -> object:
    return r.choice([r.randint(-1000, 10**6), r.choice(_WORDS) + str(r.randint(0, 9)), "quoted: text", True, None,
                     1.5])


def _value(r: random.Random, depth: int) -> object:
    roll = r.random()
    if depth >= 3 or roll < 0.45:
        return _scalar(r)
    if roll < 0.75:
        return {f"{r.choice(_WORDS)}{i}": _value(r, depth + 1) for i in range(r.randint(0, 4))}
    return [_value(r, depth + 1) for _ in range(r.randint(0, 4))]


def _sep(r: random.Random) -> str:
    return r.choice([" ", "\t", " \t", "\t\t", "  "])


def _comment(r: random.Random) -> str:
    return f"{_sep(r)}# {r.choice(_WORDS)}" if r.random() < 0.5 else ""


def _emit(v: object, r: random.Random, indent: int) -> list[str]:
    """Block-style lines for a mapping or list value, with random comments after values (tab- or space-led)."""
    pad = " " * indent
    lines: list[str] = []
    items = v.items() if isinstance(v, dict) else ((None, x) for x in v)  # type: ignore[union-attr]
    for k, x in items:
        head = f"{pad}{k}:" if k is not None else f"{pad}-"
        if isinstance(x, (dict, list)) and x:
            lines.append(head + _comment(r))
            lines += _emit(x, r, indent + 2)
        else:
            flow = yaml.safe_dump(x, default_flow_style=True, width=10**6).strip()
            flow = flow.removesuffix("\n...").removesuffix("...").strip()
            lines.append(f"{head} {flow}{_comment(r)}")
    return lines


def _document(r: random.Random) -> str:
    base = {f"{r.choice(_WORDS)}{i}": _scalar(r) for i in range(r.randint(1, 4))}
    # keys of `other` never repeat those of `base`: for a key in both, PyYAML and kubectl disagree on which wins
    # (test_in_a_merge_list_the_earlier_map_wins)
    other = {f"o{r.choice(_WORDS)}{i}": _scalar(r) for i in range(r.randint(1, 4))}
    body = {f"k{i}": _value(r, 1) for i in range(r.randint(1, 5))}
    lines = ["base: &base " + yaml.safe_dump(base, default_flow_style=True, width=10**6).strip() + _comment(r),
             "other: &other " + yaml.safe_dump(other, default_flow_style=True, width=10**6).strip()]
    lines += _emit(body, r, 0)
    lines.append("merged:")
    lines.append("  <<: " + r.choice(["*base", "[*base, *other]", "[*other, *base]"]) + _comment(r))
    for k in r.sample(sorted(set(base) | set(other)), k=r.randint(0, 2)):  # written keys override merged ones
        lines.append(f"  {k}: overridden{_comment(r)}")
    return "\n".join(lines) + "\n"


def test_a_generated_set_reads_as_libyaml_reads_it():
    """600 documents with merge keys (single and lists, with written keys overriding), nested blocks and flow
    values, and comments led by tabs or spaces: each reads as libyaml reads it, and what libyaml refuses (a tab
    right after a block entry's dash, where a key could start) is refused too. The go-yaml-specific readings (1e3
    as a number, y/n as booleans, integral floats as ints) are not generated; test_strict_input covers them."""
    r = random.Random(20261204)
    outcomes = {"read": 0, "refused": 0}
    for n in range(600):
        text = _document(r)
        try:
            want = [yaml.load(text, Loader=yaml.CSafeLoader)]
        except yaml.YAMLError:
            with pytest.raises(YamlError):
                strictyaml.load_all(text)
            outcomes["refused"] += 1
            continue
        assert strictyaml.load_all(text) == want, f"document {n}:\n{text}"
        outcomes["read"] += 1
    assert outcomes["read"] > 300 and outcomes["refused"] > 10, outcomes  # the set exercises both sides
