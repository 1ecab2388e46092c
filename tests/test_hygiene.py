"""The product code reads as written on purpose (pure ``ast`` and text, nothing imported; well under a second):

- every module-level statement that is only an expression is a docstring (a string literal) or a call, so an edit
  that left a computed string where a docstring should be is seen;
- a ``# long: <why>`` marker opens its comment block (a marker spliced into the middle of a sentence explains
  nothing);
- one module defines each named string constant (a label, a resource, a reason): no two product modules assign the
  same string to an upper-case module-level name;
- no two test modules carry the same helper (a top-level function or class, not a test, of the same text): shared
  helpers live in tests/support (or a folder's conftest.py);
- the repository reads as a product: product code and docs name no call, session, issue or work item of the work that
  made them (upstream trackers such as "pytorch issue N" excepted), the device scripts are named by what they
  measure, and bench/results holds exactly the raw results that a doc, a test or a bench script cites (every cited
  path exists, nothing uncited is kept; bench/results/RECORDS.md is the dated history).
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

from support import codemap
from support.paths import REPO
from support.pyparse import parse


def _module_texts() -> dict[str, tuple[str, ast.Module]]:
    return {name: codemap._parsed(m.path) for name, m in codemap.modules().items()}


def odd_expressions(tree: ast.Module) -> list[int]:
    """Lines of module- or class-level expression statements that are neither a string literal nor a call."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for stmt in node.body:
                if not isinstance(stmt, ast.Expr):
                    continue
                v = stmt.value
                if isinstance(v, ast.Constant) and isinstance(v.value, str) or isinstance(v, (ast.Call, ast.Await)):
                    continue
                if isinstance(v, ast.Constant) and v.value is Ellipsis:
                    continue
                out.append(stmt.lineno)
    return out


def spliced_long_marks(text: str) -> list[int]:
    """Lines whose comment holds a ``# long:`` marker that is not the first line of its comment block."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if codemap.LONG_MARK.search(line) and line.lstrip().startswith("#") and i > 0 \
                and lines[i - 1].lstrip().startswith("#"):
            out.append(i + 1)
    return out


def string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments (upper-case names, strings of four characters or more): text -> name."""
    out = {}
    for stmt in tree.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else \
            stmt.target if isinstance(stmt, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id.isupper() and isinstance(stmt.value, ast.Constant) \
                and isinstance(stmt.value.value, str) and len(stmt.value.value) > 3:
            out[stmt.value.value] = target.id
    return out


def copied_helpers(sources: dict[str, str]) -> list[list[str]]:
    """Groups of ``file:line name`` whose top-level helper (def or class, not ``test_*``) has the same text."""
    by_text: dict[str, list[str]] = {}
    for path, text in sources.items():
        for node in parse(text, path).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and not node.name.startswith("test_"):
                seg = ast.get_source_segment(text, node) or ""
                by_text.setdefault(seg, []).append(f"{path}:{node.lineno} {node.name}")
    return [places for places in by_text.values() if len(places) > 1]


NUMBERED = re.compile(r"\b(?:(?:device )?[Cc]alls? ?\d+|[Ss]essions? \d+|[Ss]ession-\d+|(?<!pytorch )(?<!torchtitan )"
                      r"(?<!upstream )[Ii]ssues? #?\d+|[Ww]ork[- ]items?)\b")
"""A reference to the work that made something rather than to what it is (``call 13``, ``session 7``, ``issue 29``)."""
RESULT_PATH = re.compile(r"bench/results/[A-Za-z0-9_./{},*-]*")


def numbered_references(text: str) -> list[str]:
    """Each numbered work reference in ``text`` outside a ``bench/results/...`` path (raw data keeps its names)."""
    return [m.group(0) for m in NUMBERED.finditer(" ".join(RESULT_PATH.sub("", text).split()))]


RESULT_TAG = re.compile(r"(?:^|[/_.-])(?:call\d+|s(?!3(?:[/_.-]|$))\d+)(?=[/_.-]|$)")
"""A call or session tag in a raw result's path (``h100_call26_s19/``, ``s13-loop1-...``); ``s3`` is the storage."""
CITED_BY_OTHER_TESTS = frozenset({
    "bench/results/suite/process_overhead_s13_quiet.txt", "bench/results/suite/s16_test_model_step_cost.txt",
    "bench/results/suite/s16_windows_e2e_s3.txt.xz", "bench/results/suite/s16_windows_trainer.txt"})
"""Tagged results that test modules outside this one cite by name (rename them together with those citations)."""


def _bench_texts() -> dict[str, str]:
    """The bench scripts and their helpers (bench/results, the raw data and its dated records, excepted)."""
    bench = REPO / "bench"
    return {str(p.relative_to(REPO)): p.read_text(errors="replace") for p in sorted(bench.rglob("*"))
            if p.is_file() and p.suffix in (".py", ".sh", ".md") and bench / "results" not in p.parents}


def _product_texts() -> dict[str, str]:
    roots = [REPO / "docs", REPO / "operator", REPO / "trainer", REPO / "charts", REPO / "examples"]
    paths = [REPO / "README.md"] + [p for r in roots for p in r.rglob("*")
                                    if p.is_file() and p.suffix in (".md", ".py", ".yaml", ".json", ".txt", ".tpl")]
    return {str(p.relative_to(REPO)): p.read_text(errors="replace") for p in paths}


def _expand(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def cited_results(texts: dict[str, str], files: list[str]) -> tuple[set[str], list[str]]:
    """(the files of ``files`` that a text cites, the cited paths that match no file): a citation is a path, a
    folder (``.../``), a glob or a brace list, with or without trailing punctuation."""
    cited: set[str] = set()
    dangling = []
    for text in texts.values():
        for m in RESULT_PATH.finditer(text):
            for pattern in _expand(m.group(0).rstrip(".,;:)`'\"")):
                hits = {f for f in files if f == pattern or f.startswith(pattern.rstrip("/") + "/")
                        or ("*" in pattern and fnmatch.fnmatch(f, pattern + ("" if "." in pattern.rsplit("/", 1)[-1]
                                                                             else "*")))}
                if not hits and pattern.rstrip("/") != "bench/results":
                    dangling.append(pattern)
                cited |= hits
    return cited, dangling


def test_module_level_expressions_are_docstrings_or_calls():
    found = {name: lines for name, (_text, tree) in _module_texts().items() if (lines := odd_expressions(tree))}
    assert not found, ("expression statements that are neither a docstring nor a call (an edit left a computed "
                       f"value where a docstring should be; write the docstring as one string literal): {found}")


def test_long_markers_open_their_comment():
    found = {name: lines for name, (text, _tree) in _module_texts().items() if (lines := spliced_long_marks(text))}
    assert not found, ("`# long:` markers inside a comment block (write `# long: <why>` as the comment's first "
                       f"line): {found}")


def test_each_named_string_constant_is_defined_in_one_module():
    where: dict[str, list[str]] = {}
    for name, (_text, tree) in _module_texts().items():
        for text, const in string_constants(tree).items():
            where.setdefault(text, []).append(f"{name}.{const}")
    twice = {text: places for text, places in where.items() if len(places) > 1}
    assert not twice, f"string constants defined in more than one module (import the one definition): {twice}"


def test_no_test_helper_is_copied_between_modules():
    sources = {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "tests").rglob("*.py"))}
    copies = copied_helpers(sources)
    assert not copies, f"the same helper in several test modules (move it to tests/support): {copies}"


def test_copied_helpers_are_seen():
    helper = "def _events(c, name):\n    return sorted(c.list(name))\n"
    got = copied_helpers({"a.py": helper + "def test_a():\n    pass\n", "b.py": helper, "c.py": "def _other():\n    pass\n"})
    assert got == [["a.py:1 _events", "b.py:1 _events"]]


def test_product_code_and_docs_name_no_call_session_or_issue():
    found = {path: refs for path, text in _product_texts().items() if (refs := numbered_references(text))}
    assert not found, ("numbered references to the work that made the code (say what it is or which script measured "
                       f"it; dated history goes to bench/results/RECORDS.md): {found}")


def test_bench_scripts_say_what_they_measure_not_which_call_ran_them():
    found = {path: refs for path, text in _bench_texts().items() if (refs := numbered_references(text))}
    assert not found, ("bench scripts that name the call, session or issue that ran them (say what the script "
                       f"measures and why; dated history goes to bench/results/RECORDS.md): {found}")


def test_docs_and_bench_use_no_removed_environment_name():
    """A doc or bench script that names a ``KUBETITAN_*`` setting nothing reads tells people to set what does nothing
    (a bench script would measure the defaults while saying otherwise): every name is in docs/trainer.md's table (the
    product's) or a string a bench module or tests/support reads (``"KUBETITAN_..."``: their own tools' switches)."""
    texts = {**_bench_texts(), **{str(p.relative_to(REPO)): p.read_text() for p in
                                  [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}}
    known = set(re.findall(r"^\| `(KUBETITAN_[A-Z0-9_]+)`", (REPO / "docs" / "trainer.md").read_text(), re.M))
    tools = [p for root in ("bench", "tests/support") for p in (REPO / root).rglob("*.py") if "results" not in p.parts]
    known |= {n for p in tools for n in re.findall(r"[\"'](KUBETITAN_[A-Z0-9_]+)[\"']", p.read_text())}
    unknown = {path: sorted(names) for path, text in texts.items()
               if (names := set(re.findall(r"\bKUBETITAN_[A-Z0-9_]*[A-Z0-9]\b", text)) - known)}
    assert not unknown, ("docs or bench scripts name environment settings that nothing reads (tuning is spec.runtime "
                         "now, docs/api.md; bench/device/recovery_anatomy.sh takes RUNTIME=FIELD=VALUE,...; a past "
                         f"number made with a removed knob says which spec.runtime field it is today): {unknown}")


def test_bench_results_are_named_by_what_they_hold():
    results = REPO / "bench" / "results"
    tagged = sorted(name for p in results.rglob("*") if p.is_file()
                    and RESULT_TAG.search(name := str(p.relative_to(REPO))) and name not in CITED_BY_OTHER_TESTS)
    assert not tagged, ("raw results named by the call or session that made them (git mv them to a name that says "
                        f"what they hold, e.g. recovery/h100_aot_artefact_run1/, and update every citation): {tagged}")


@pytest.mark.parametrize(("name", "tagged"), [
    ("bench/results/recovery/h100_call26_s19/results.json", True),
    ("bench/results/hog_repeat/s13-loop1-6a5b9db.txt", True),
    ("bench/results/compile/aot_cache_probe_cpu_s17.txt", True),
    ("bench/results/suite/dirs_trainer_e2e_s3_debug_model.txt", False),
    ("bench/results/s3/s3_bench.txt", False),
    ("bench/results/hog_repeat/2026-12-05_loop1_5216fe2.txt", False),
])
def test_result_tags_are_seen(name, tagged):
    assert bool(RESULT_TAG.search(name)) is tagged


@pytest.mark.parametrize(("text", "want"), [
    ("measured in call 13 (session 7, issue 18)", ["call 13", "session 7", "issue 18"]),
    ("the session-12 run; a work item", ["session-12", "work item"]),
    ("results kept outside $OUT since call13+", ["call13"]),
    ("pytorch\nissue 183413 and torchtitan issue 3476; bench/results/gpu/x_call3_s11/ raw", []),
], ids=["call-session-issue", "hyphen-and-work-item", "call-without-space", "upstream-and-paths"])
def test_numbered_references_are_seen(text, want):
    assert numbered_references(text) == want


def test_device_scripts_are_named_by_what_they_measure():
    numbered = sorted(p.name for p in (REPO / "bench" / "device").glob("*.sh")
                      if re.search(r"(?:^|_)(?:call|session|issue)\d", p.stem) or p.stem.isdigit())
    assert not numbered, f"device scripts named by a number, not by what they measure: {numbered}"


def test_bench_results_hold_exactly_what_is_cited():
    results = REPO / "bench" / "results"
    files = sorted(str(p.relative_to(REPO)) for p in results.rglob("*") if p.is_file())
    roots = [REPO / "docs", REPO / "tests", REPO / "bench", REPO / "operator", REPO / "trainer", REPO / "examples"]
    texts = {str(p): p.read_text(errors="replace") for r in roots for p in r.rglob("*")
             if p.is_file() and p.suffix in (".md", ".py", ".sh", ".yaml") and results not in p.parents
             and p != Path(__file__)}
    texts["README.md"] = (REPO / "README.md").read_text()
    cited, dangling = cited_results(texts, files)
    assert not dangling, f"cited results that do not exist (moved, compressed to .xz, or dropped?): {sorted(set(dangling))}"
    uncited = sorted(set(files) - cited - {"bench/results/RECORDS.md"})
    assert not uncited, f"raw results no doc, test or bench script cites (drop them, or cite them): {uncited[:20]}"


def test_citations_are_read():
    files = ["bench/results/a/x.txt", "bench/results/a/y.txt", "bench/results/b/run_1.log", "bench/results/c/z.json"]
    texts = {"d.md": "raw in `bench/results/a/` and bench/results/b/run_{1,2}.log; bench/results/c/*.json."}
    assert cited_results(texts, files) == (set(files), ["bench/results/b/run_2.log"])


def test_string_constants_are_read():
    tree = ast.parse('GPU = "nvidia.com/gpu"\nX: str = "abcd"\nlower = "ignored"\nN = 3\nS = "ab"\n')
    assert string_constants(tree) == {"nvidia.com/gpu": "GPU", "abcd": "X"}


@pytest.mark.parametrize(("source", "want"), [
    ('X = 1\n"""Doc."""\nf()\n', []),
    ('X = 1\n"""Doc.""".replace("a", "b") if False else """Doc."""\n', [2]),
    ("class A:\n    x: int\n    1 + 1\n", [3]),
], ids=["docstring-and-call", "computed-docstring", "class-level-arithmetic"])
def test_odd_expressions_are_seen(source, want):
    assert odd_expressions(ast.parse(source)) == want


@pytest.mark.parametrize(("source", "want"), [
    ("# long: a table of rules\ndef f():\n    pass\n", []),
    ("# The agent subclass (imported here, as all of the\n# long: launcher) closes over state\ndef f():\n", [2]),
], ids=["opens-the-comment", "spliced"])
def test_spliced_long_marks_are_seen(source, want):
    assert spliced_long_marks(source) == want
