"""The product installed into the real test cluster as a user installs it: ``helm install`` of charts/kubetitan, and
the operator run as a process with the chart's own arguments and the chart's ServiceAccount token.

The release sets ``replicaCount=0`` and ``webhook.url=https://127.0.0.1:<port>`` (the chart's out-of-cluster mode,
docs/install.md): the Deployment runs no pod (there is no container runtime here), the operator runs beside the
cluster with a token of the release's ServiceAccount (so the chart's RBAC is exactly what it may do), issues its
webhook certificate for 127.0.0.1 into the release's Secret and keeps the configuration's caBundle, and the real
API server calls its webhook at that URL.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from support.cluster import ControlPlane
from support.paths import REPO
from support import yamlio

CHART = REPO / "charts" / "kubetitan"
HELM = REPO / ".tools" / "bin" / "helm"
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
OUT_OF_POD_FLAGS = ("--metrics-port", "--liveness", "--webhook-cert-dir")
"""Chart arguments about the pod's own ports and mounts, replaced by the test's (free ports, a temporary folder)."""


def run_tool(tool: Path, *args: str, kubeconfig: Path, check: bool = True, input: str | None = None,
             timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": os.environ.get("HOME", "/root")}
    p = subprocess.run([str(tool), *args], env=env, capture_output=True, text=True, input=input, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{tool.name} {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def kubectl(*args: str, kubeconfig: Path, check: bool = True, input: str | None = None
            ) -> subprocess.CompletedProcess[str]:
    return run_tool(KUBECTL, *args, kubeconfig=kubeconfig, check=check, input=input)


def described_condition(out: str, type_: str) -> dict[str, str]:
    """One condition of ``kubectl describe``'s Status section (its generic describer prints each list item's keys
    as ``Key:  value`` lines, the first after a dash-less indent change)."""
    block = out.split("\n  Conditions:\n", 1)[1]
    items, cur = [], {}
    for line in block.splitlines():
        m = re.match(r"^    (\S[\w ]*?):\s+(.*)$", line)
        if not m:
            if line.startswith("    ") and cur:
                continue
            break
        key, value = m.groups()
        if key in cur:  # the next condition starts
            items.append(cur)
            cur = {}
        cur[key] = value.strip()
    items.append(cur)
    hit = [i for i in items if i.get("Type") == type_]
    assert hit, (type_, items)
    return hit[0]


@dataclass
class Release:
    cp: ControlPlane
    name: str = "kt"
    namespace: str = "kubetitan-system"
    webhook_port: int = 0
    values: dict[str, Any] = field(default_factory=dict)
    manifest: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fullname(self) -> str:
        return f"{self.name}-kubetitan"

    @property
    def webhook_url(self) -> str:
        return f"https://127.0.0.1:{self.webhook_port}"

    def helm_values(self) -> list[str]:
        sets = {"replicaCount": 0, "webhook.url": self.webhook_url, "webhook.port": self.webhook_port,
                **self.values}
        return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]

    def install(self) -> Release:
        """``helm install`` into the cluster (the CRDs from the chart's crds/, then every template)."""
        run_tool(HELM, "install", self.name, str(CHART), "-n", self.namespace, "--create-namespace", "--wait=false",
                 *self.helm_values(), kubeconfig=self.cp.admin_kubeconfig)
        out = run_tool(HELM, "get", "manifest", self.name, "-n", self.namespace, kubeconfig=self.cp.admin_kubeconfig)
        self.manifest = [d for d in yamlio.load_all(out.stdout) if d]
        return self

    def uninstall(self) -> None:
        run_tool(HELM, "uninstall", self.name, "-n", self.namespace, kubeconfig=self.cp.admin_kubeconfig, check=False)

    def webhook_ready(self) -> bool:
        """The configuration carries the operator's CA (the API server can call the webhook from then on)."""
        vwc = self.cp.admin.get("admissionregistration.k8s.io/v1/validatingwebhookconfigurations", None, self.fullname)
        return bool(vwc and vwc["webhooks"][0]["clientConfig"].get("caBundle"))

    def webhook_serving(self) -> bool:
        """The API server reaches the webhook: a dry-run create in ``default`` gets the webhook's answer (admitted or
        refused), not 'failed calling webhook' (no replica listening on the URL's port yet)."""
        from support.cluster import LPT, ApiError, resource_path

        probe = {"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
                 "metadata": {"name": "webhook-probe", "namespace": "default"}, "spec": {}}
        try:
            self.cp.admin.request("POST", resource_path(LPT, "default"), probe, params={"dryRun": "All"})
        except ApiError as e:
            return "failed calling webhook" not in str(e)
        return True

    def deployment(self) -> dict[str, Any]:
        return next(d for d in self.manifest if d["kind"] == "Deployment")

    def service_account(self) -> str:
        return self.deployment()["spec"]["template"]["spec"]["serviceAccountName"]

    def operator_kubeconfig(self) -> Path:
        """A kubeconfig with a token of the release's ServiceAccount (what the pod's projected token holds)."""
        return self.cp.service_account_kubeconfig(self.namespace, self.service_account())

    def operator_args(self, cert_dir: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
        """The chart's arguments of ``kubetitan operator`` (in-pod ports and mounts replaced), then ``extra``."""
        c = self.deployment()["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["kubetitan", "operator"], c["command"]
        args = [a for a in c["args"] if not a.startswith(OUT_OF_POD_FLAGS)]
        args.append(f"--webhook-cert-dir={cert_dir or tempfile.mkdtemp(prefix='kubetitan-webhook-')}")
        return args + list(extra)
