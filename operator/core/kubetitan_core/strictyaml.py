"""A strict, total YAML reader for LlamaPretrain files: every malformed input is an error, never a traceback.

Refuses what the API server (or common sense) refuses and PyYAML accepts or crashes on: bytes that are
not UTF-8, duplicate mapping keys, more than :data:`MAX_ALIASES` aliases (alias bombs), recursive
aliases, nesting deeper than :data:`MAX_DEPTH`, and integers outside int64. Errors carry the line.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

MAX_DEPTH = 64
MAX_ALIASES = 64
MAX_NODES = 100_000
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class YamlError(Exception):
    """A YAML input that cannot be used; ``str()`` says where and why."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that counts aliases as they are composed."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0
        self.depth = 0

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise YamlError(f"line {mark.line + 1}: more than {MAX_ALIASES} aliases; "
                                "write the values out instead of using anchors")
        # PyYAML composes recursively: stop at the depth limit with the line, before Python's recursion limit.
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH + 1:
                mark = self.peek_event().start_mark
                raise YamlError(f"line {mark.line + 1}, column {mark.column + 1}: nested deeper than {MAX_DEPTH} "
                                "levels; flatten it (no LlamaPretrain field is nested that deep)")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def scan_to_next_token(self) -> None:
        """PyYAML's scanner with libyaml's tab rule (``yaml_parser_scan_to_next_token``): a tab is white space where
        no simple key can start (after a value, ``steps: 1000<TAB># c``) and inside flow collections. PyYAML skips
        only spaces there and calls such a file invalid; libyaml, go-yaml and so kubectl read it. A tab that
        indents a line is still refused (no simple key is allowed to start there only after a line break)."""
        if self.index == 0 and self.peek() == "\uFEFF":
            self.forward()
        while True:
            while self.peek() == " " or (self.peek() == "\t" and (self.flow_level or not self.allow_simple_key)):
                self.forward()
            if self.peek() == "#":
                while self.peek() not in "\0\r\n\x85\u2028\u2029":
                    self.forward()
            if not self.scan_line_break():
                return
            if not self.flow_level:
                self.allow_simple_key = True


def _syntax_error(e: yaml.YAMLError) -> str:
    """One line: where, what, and how to fix it (PyYAML's own text spans several lines)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    hint = ("indent with spaces, not tabs" if "\\t" in problem or "\t" in problem else
            "check the indentation and quote values that contain ': ', ' #' or start with a special character")
    return f"{where}not valid YAML: {problem}{f' ({context})' if context else ''}; fix the syntax there ({hint})"


# kubectl and the API server read YAML with go-yaml v2 (sigs.k8s.io/yaml), which takes 3e-4, 1E5 and 1e+3 as numbers;
# PyYAML's YAML 1.1 float needs a dot and a signed exponent, so it would read `learningRate: 3e-4` as a string.
_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
                              list("-+0123456789."))
# go-yaml v2 also reads y/Y/n/N as booleans (PyYAML does not), and has no base-60 numbers (PyYAML reads 1:30 as 90).
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))
_Loader.bool_values = {**yaml.SafeLoader.bool_values, "y": True, "n": False}
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
JSON_INT_LIMIT = 1e21
"""Go's JSON writes an integral float below this as an integer (1000.0 -> 1000): what kubectl sends for ``steps:
1e3``, and what the API server then reads as an integer."""


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _path(path: list[str]) -> str:
    return ".".join(path) or "<document>"


def _build(loader: _Loader, node: yaml.Node, path: list[str], depth: int, stack: set[int],
           count: list[int]) -> Any:
    count[0] += 1
    if count[0] > MAX_NODES:
        raise YamlError(f"line {_line(node)}: more than {MAX_NODES} values (alias expansion?); simplify the file")
    if depth > MAX_DEPTH:
        raise YamlError(f"line {_line(node)}: {_path(path)}: nested deeper than {MAX_DEPTH} levels; flatten it")
    if id(node) in stack:
        raise YamlError(f"line {_line(node)}: {_path(path)}: an alias refers to itself; remove the recursion")
    if isinstance(node, yaml.ScalarNode):
        if node.tag in _NUMBER_TAGS and ":" in node.value and node.style is None:
            return node.value  # a YAML 1.1 base-60 number to PyYAML, a string to go-yaml (and the API server)
        try:
            value = loader.construct_object(node, deep=True)
        except (ValueError, yaml.YAMLError) as e:  # e.g. an integer with thousands of digits
            raise YamlError(f"line {_line(node)}: {_path(path)}: {node.value[:40]!r} cannot be read: "
                            f"{str(e).splitlines()[0][:120]}; fix the value") from None
        if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            raise YamlError(f"line {_line(node)}: {_path(path)}: integer out of the 64-bit range; use a "
                            "smaller value")
        if isinstance(value, float) and value.is_integer() and abs(value) < JSON_INT_LIMIT:
            value = int(value)  # as the YAML -> JSON conversion kubectl does: 1e3 and 1000.0 arrive as 1000
        if not isinstance(value, (str, int, float, bool, type(None))):
            value = node.value  # timestamps, binary: kept as the written text
        return value
    stack = stack | {id(node)}
    if isinstance(node, yaml.SequenceNode):
        return [_build(loader, c, path[:-1] + [f"{path[-1] if path else ''}[{i}]"], depth + 1, stack, count)
                for i, c in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        return _mapping(loader, node, path, depth, stack, count)
    raise YamlError(f"line {_line(node)}: unsupported YAML node")


_MERGE = "tag:yaml.org,2002:merge"


def _mapping(loader: _Loader, node: yaml.MappingNode, path: list[str], depth: int, stack: set[int],
             count: list[int]) -> dict[Any, Any]:
    """A mapping with the YAML merge-key semantics kubectl's reader has: the written keys override merged ones, and
    in ``<<: [*a, *b]`` a key of an earlier map overrides the same key of a later one. Only a key written twice
    in the mapping itself is a duplicate. (PyYAML's ``flatten_mapping`` is not used: it tells merged keys from
    written ones by the identity of their string objects.)"""
    merged: dict[Any, Any] = {}
    out: dict[Any, Any] = {}
    lines: dict[Any, int] = {}
    merge_line = 0
    for k, v in node.value:
        if k.tag == _MERGE:
            if merge_line:
                raise YamlError(f"line {_line(k)}: {_path(path + ['<<'])}: duplicate merge key (first on line "
                                f"{merge_line}); list the maps in one: <<: [*a, *b]")
            merge_line = _line(k)
            sources = v.value if isinstance(v, yaml.SequenceNode) else [v]
            for src in reversed(sources):  # the first map listed wins: apply it last
                if not isinstance(src, yaml.MappingNode):
                    raise YamlError(f"line {_line(src)}: {_path(path + ['<<'])}: a merge key takes a mapping or a "
                                    "list of mappings (e.g. <<: *defaults); merge only maps")
                merged.update(_build(loader, src, path, depth + 1, stack, count))
            continue
        key = _build(loader, k, path, depth + 1, stack, count)
        if isinstance(key, (list, dict)):
            raise YamlError(f"line {_line(k)}: {_path(path)}: a mapping key must be a plain value")
        if key in out:
            raise YamlError(f"line {_line(k)}: {_path(path + [str(key)])}: duplicate key (first on line "
                            f"{lines[key]}); keep only one")
        lines[key] = _line(k)
        out[key] = _build(loader, v, path + [str(key)], depth + 1, stack, count)
    return {**{k: v for k, v in merged.items() if k not in out}, **out} if merged else out


def load_all(data: bytes | str) -> list[Any]:
    """All documents of ``data``, strictly; raises :class:`YamlError`."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise YamlError(f"line {line}: byte {e.start} is not UTF-8 ({e.reason}); save the file as UTF-8") from None
    else:
        text = data
    if "\x00" in text:
        raise YamlError(f"line {text[: text.index(chr(0))].count(chr(10)) + 1}: a NUL character, so this is not a text "
                        "file; remove it (save the file as UTF-8 text)")
    docs: list[Any] = []
    try:
        loader = _Loader(text)
        while loader.check_node():
            node = loader.get_node()
            if node is not None:
                docs.append(_build(loader, node, [], 0, set(), [0]))
    except yaml.YAMLError as e:
        raise YamlError(_syntax_error(e)) from None
    except RecursionError:
        raise YamlError(f"nested deeper than {MAX_DEPTH} levels; flatten it") from None
    return docs
