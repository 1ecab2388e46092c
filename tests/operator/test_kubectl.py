"""The real kubectl against kmockx with the operator running: apply, then get with printer columns."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kmockx.harness import Cluster, Operator, wait_for
from support.specs import NS, cpu_spec, lpt

pytestmark = pytest.mark.xdist_group("operator-kmock")
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"


def kubectl(cluster: Cluster, *args: str) -> str:
    out = subprocess.run([KUBECTL, "--kubeconfig", cluster.admin_kubeconfig, *args], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_kubectl_apply_and_get_shows_printer_columns(cluster: Cluster, tmp_path: Path) -> None:
    assert Path(KUBECTL).exists(), "kubectl is part of the CI image (/usr/bin/kubectl)"
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump(lpt("kc", cpu_spec())))
    with Operator(cluster):
        out = kubectl(cluster, "apply", "-f", str(f))
        assert "llamapretrain.kubetitan.io/kc created" in out
        wait_for(lambda: len(cluster.pod_names(NS, "kc")) == 2, 20, "pods")
        wait_for(lambda: cluster.status(NS, "kc").get("phase") == "Starting", 20, "phase")
        table = kubectl(cluster, "get", "lpt", "-n", NS)
        header, row = table.splitlines()[:2]
        assert header.split() == ["NAME", "PHASE", "PROGRESS", "LOSS", "TOK/S", "MFU", "CKPT", "RESTARTS", "AGE"]
        assert row.split()[:3] == ["kc", "Starting", "0/100"] and row.split()[7] == "0", row
        wide = kubectl(cluster, "get", "lpt", "kc", "-n", NS, "-o", "wide").splitlines()
        assert wide[0].split()[-4:] == ["NODES", "ATTEMPT", "ETA", "MESSAGE"]
        assert wide[1].split()[9] == "2", wide[1]  # the gang's size, after AGE
