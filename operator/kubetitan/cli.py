"""The ``kubetitan`` command.

    kubetitan validate FILE...          check LlamaPretrains; exit 1 listing every error
              [--policy POLICY]         ... and against the cluster admin's policy (kubetitan.policy)
    kubetitan render FILE [--attempt N] print the child objects of one attempt as YAML
              [--pod-groups]            ... as on a cluster that serves Kubernetes PodGroups
    kubetitan crd                       print the CustomResourceDefinition
    kubetitan run FILE                  train locally (CPU with gloo, or local GPUs)
    kubetitan prepare-data ...          tokenize a corpus into training shards
    kubetitan operator ...              run the operator

``validate``, ``render`` and ``crd`` need neither a cluster nor torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kubetitan import __version__
from kubetitan_core.strictyaml import YamlError, load_all

if TYPE_CHECKING:
    # The spec model (pydantic, about 0.2-0.9 s to import) loads only in the commands that read a LlamaPretrain, so
    # `kubetitan prepare-data` hands over to the trainer's process without paying for it.
    from kubetitan_core.api import LlamaPretrain
    from kubetitan_core.validation import FieldError

EXIT_INVALID = 1
EXIT_USAGE = 2


class InputError(Exception):
    """The input file cannot be used; the message says why and what to do."""


class BadYaml(InputError):
    """The file is malformed YAML (exit code 1, like any invalid LlamaPretrain)."""


def load_documents(path: str) -> list[Any]:
    """All YAML documents of a file (``-`` is standard input), empty ones dropped."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read the file: {e.strerror or e}") from None
    try:
        docs = [d for d in load_all(data) if d is not None]
    except YamlError as e:
        raise BadYaml(f"{path}: {e}") from None
    if not docs:
        raise InputError(f"{path}: holds no YAML document; expected a LlamaPretrain")
    return docs


def load_one(path: str) -> tuple[LlamaPretrain | None, list[FieldError]]:
    docs = load_documents(path)
    if len(docs) != 1:
        raise InputError(f"{path}: holds {len(docs)} documents; this command takes exactly one LlamaPretrain")
    from kubetitan_core.validation import parse

    return parse(docs[0])


def _print_errors(path: str, name: str, errors: list[FieldError]) -> None:
    print(f"{path}: LlamaPretrain {name or '<unnamed>'} is invalid ({len(errors)} error(s)):", file=sys.stderr)
    for e in errors:
        print(f"  - {e}", file=sys.stderr)


def load_policy(path: str) -> Any:
    """The admin policy of ``--policy FILE``: the chart's ``policy`` block, or a values file holding one."""
    from kubetitan import policy

    docs = load_documents(path)
    if len(docs) != 1:
        raise InputError(f"{path}: holds {len(docs)} documents; --policy takes one policy mapping")
    try:
        return policy.load(docs[0])
    except policy.PolicyError as e:
        raise InputError(f"{path}: {e}") from None


def _expand_lists(docs: list[Any]) -> list[Any]:
    """A ``kind: List`` (what ``kubectl get -o yaml`` writes, and ``kubectl apply`` takes) stands for its items."""
    out: list[Any] = []
    for d in docs:
        if isinstance(d, dict) and d.get("kind") == "List" and d.get("apiVersion") == "v1" \
                and isinstance(d.get("items"), list):
            out += d["items"]
        else:
            out.append(d)
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    from kubetitan import policy
    from kubetitan_core.validation import parse
    from kubetitan_core.warning_rules import file_warnings, warnings_for

    pol = load_policy(args.policy) if args.policy else None
    bad = 0
    for path in args.files:
        valid: list[Any] = []
        for doc in _expand_lists(load_documents(path)):
            lpt, errors = parse(doc)
            meta = doc.get("metadata") if isinstance(doc, dict) else None
            name = str(meta.get("name", "")) if isinstance(meta, dict) else ""
            if not errors and lpt is not None and pol is not None and (refused := policy.check(lpt, pol)):
                bad += 1
                print(f"{path}: LlamaPretrain {name} is valid but the policy {args.policy} refuses it "
                      f"({len(refused)} error(s)):", file=sys.stderr)
                for e in refused:
                    print(f"  - {e}", file=sys.stderr)
            elif errors:
                bad += 1
                _print_errors(path, name, errors)
            else:
                print(f"{path}: LlamaPretrain {name} is valid")
            if not errors and lpt is not None:
                valid.append(lpt)
                for w in warnings_for(lpt):  # warnings never change the exit code
                    print(f"{path}: warning [{w.rule}] {w}", file=sys.stderr)
        for _, w in file_warnings(valid):
            print(f"{path}: warning [{w.rule}] {w}", file=sys.stderr)
    return EXIT_INVALID if bad else 0


def cmd_render(args: argparse.Namespace) -> int:
    from kubetitan.plan import attempt_children, uses_pod_group

    lpt, errors = load_one(args.file)
    if errors or lpt is None:
        _print_errors(args.file, lpt.metadata.name if lpt else "", errors)
        return EXIT_INVALID
    if not lpt.metadata.name:
        raise InputError(f"{args.file}: has only metadata.generateName, and the API server picks the name; give "
                         "metadata.name to render the children")
    if args.namespace:
        lpt.metadata.namespace = args.namespace
    objs = attempt_children(lpt, args.attempt, pod_groups=uses_pod_group(lpt.spec, served=args.pod_groups))
    print(f"# kubetitan {__version__}: children of LlamaPretrain {lpt.metadata.name}, attempt {args.attempt}.")
    print("# The operator adds owner references (they need the object's uid) when it creates them.")
    sys.stdout.write(yaml.safe_dump_all(objs, sort_keys=False))
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    from kubetitan_core.crd import crd

    try:
        obj = crd(kubernetes_version=args.kubernetes_version)
    except ValueError as e:  # a --kubernetes-version that is not MAJOR.MINOR
        raise InputError(f"--kubernetes-version: {e}") from None
    sys.stdout.write(yaml.safe_dump(obj, sort_keys=False))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    lpt, errors = load_one(args.file)
    if errors or lpt is None:
        _print_errors(args.file, lpt.metadata.name if lpt else "", errors)
        return EXIT_INVALID
    argv = [args.file] + (["--output-dir", args.output_dir] if args.output_dir else []) + (
        ["--steps", str(args.steps)] if args.steps is not None else []) + (["--ledger"] if args.ledger else [])
    return _exec_trainer("kubetitan_trainer.local", argv, "run")


def _exec_trainer(module: str, argv: list[str], what: str) -> int:
    """Hand this process over to a trainer command (``python -m MODULE ARGV``).

    The operator package never imports the trainer's (the two share only ``kubetitan_core``): ``run`` and
    ``prepare-data`` replace this process with the trainer's own, so signals (Ctrl-C) and the exit code are the
    trainer's, exactly as if it had been started directly.
    """
    import importlib.util
    import os

    if importlib.util.find_spec(module.split(".")[0]) is None:  # finds the package without importing it
        raise InputError(f"`kubetitan {what}` needs the trainer package kubetitan-trainer (torch, torchtitan), "
                         "which is not installed here. Install it with `make setup` or `pip install -e ./trainer`.")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])
    return 0  # not reached


def _forward(module: str, func: str, argv: list[str], what: str) -> int:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise InputError(f"`kubetitan {what}` needs {module}: {e}. Run `make setup`.") from None
    return int(getattr(mod, func)(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubetitan", description="Llama 3 pre-training on Kubernetes with torchtitan.")
    p.add_argument("--version", action="version", version=f"kubetitan {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    v = sub.add_parser("validate", help="check LlamaPretrain files; exit 1 listing every error")
    v.add_argument("files", nargs="+", metavar="FILE", help="YAML files (- for stdin); several documents allowed")
    v.add_argument("--policy", metavar="POLICY",
                   help="also check against this admin policy: a YAML file with the chart's policy keys "
                        "(hostPathPrefixes, serviceAccounts, priorityClasses, imagePrefixes, tolerationKeys), "
                        "or a Helm values file with a policy block")
    v.set_defaults(func=cmd_validate)

    r = sub.add_parser("render", help="print the child objects of one attempt as YAML (like helm template)")
    r.add_argument("file", metavar="FILE")
    r.add_argument("--attempt", type=int, default=0, help="attempt number (default 0)")
    r.add_argument("--namespace", "-n", help="namespace to render into (default: the file's, else default)")
    r.add_argument("--pod-groups", action="store_true",
                   help="render as on a cluster that serves Kubernetes PodGroups (scheduling.k8s.io/v1beta1): the "
                        "attempt's PodGroup and the pods' schedulingGroup, unless spec.scheduling keeps them out")
    r.set_defaults(func=cmd_render)

    c = sub.add_parser("crd", help="print the LlamaPretrain CustomResourceDefinition")
    c.add_argument("--kubernetes-version", metavar="X.Y",
                   help="target an older API server: 1.27 drops the CEL rules' fieldPath and reason (1.28+)")
    c.set_defaults(func=cmd_crd)

    run = sub.add_parser("run", help="train locally with the same trainer the pods run")
    run.add_argument("file", metavar="FILE")
    run.add_argument("--output-dir", help="where checkpoints, logs and metrics go (default ./runs/<name>)")
    run.add_argument("--steps", type=int, help="override spec.training.steps")
    run.add_argument("--ledger", action="store_true", help="write the sample ledger (every global sample each rank "
                     "trains, OUTPUT/kubetitan/ledger/) whatever spec.data.ledger says")
    run.set_defaults(func=cmd_run)

    # These two forward their arguments untouched to their own parsers (prepare-data: in the trainer's process).
    sub.add_parser("prepare-data", help="tokenize a text/JSONL/Parquet corpus into shards", add_help=False)
    sub.add_parser("operator", help="run the operator (see `kubetitan operator --help`)", add_help=False)
    return p


FORWARDED = {"operator": ("kubetitan.runner", "main")}
TRAINER_COMMANDS = {"prepare-data": "kubetitan_trainer.data.prepare"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in TRAINER_COMMANDS:
            return _exec_trainer(TRAINER_COMMANDS[argv[0]], argv[1:], argv[0])
        if argv and argv[0] in FORWARDED:
            module, func = FORWARDED[argv[0]]
            return _forward(module, func, argv[1:], argv[0])
        args = build_parser().parse_args(argv)
        if getattr(args, "attempt", 0) is not None and getattr(args, "attempt", 0) < 0:
            raise InputError("--attempt must be 0 or more")
        return args.func(args)
    except BadYaml as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
