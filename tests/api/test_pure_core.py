"""The API types, the validator and the planner import with kopf and torch unavailable (the pure core: what a
shared API package would hold; the trainer imports these modules, so they must not pull either in)."""

from __future__ import annotations

import subprocess
import sys

BLOCKED = ("kopf", "torch", "torchtitan", "kubernetes_asyncio")
MODULES = ("kubetitan.api", "kubetitan.contract", "kubetitan.catalog", "kubetitan.validation", "kubetitan.k8sfields",
           "kubetitan.render", "kubetitan.plan", "kubetitan.crd", "kubetitan.apidoc", "kubetitan.strictyaml")


def test_core_modules_import_with_kopf_and_torch_blocked():
    code = (
        "import sys\n"
        f"for m in {BLOCKED!r}: sys.modules[m] = None  # any import of them raises ImportError\n"
        f"for m in {MODULES!r}: __import__(m)\n"
        "from kubetitan.validation import parse\n"
        "_, errs = parse({'apiVersion': 'kubetitan.io/v1alpha1', 'kind': 'LlamaPretrain', 'metadata': {'name': 'a'},"
        " 'spec': {'resources': {'env': [{'name': 'KUBETITAN_ATTEMPT', 'value': '1'}]}}})\n"
        "assert [e.rule for e in errs] == ['env.reserved'], errs\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {BLOCKED!r} and sys.modules[m] is not None))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_block_works():
    """The sys.modules trick does refuse the import (so the test above can fail)."""
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['kopf'] = None; import kopf"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "import of kopf halted" in r.stderr
