"""kubetitan-core: what the operator and the trainer share, and nothing else.

Neither kopf, the Kubernetes client nor torch is imported here (tests/api/test_pure_core.py runs that check in a
fresh interpreter), so the operator installs without torch and the trainer image without the operator:

- ``api``         the typed ``LlamaPretrain`` spec and status, defaults (one source of truth)
- ``validation``  the rule table ``RULES`` and the semantic checks a JSON schema cannot express
- ``crd``         the CustomResourceDefinition generated from ``api`` and the CEL twins in ``RULES``
- ``catalog``     model flavours, accelerators and instance types the validator, planner and trainer need
- ``render``      spec -> the trainer's TOML config (torchtitan 0.2.2 keys + ``[kubetitan]``)
- ``contract``    exit codes, metric names, env names and the checkpoint rule between trainer and operator
- ``causes``      the restart causes, one table: detectors, in-place/re-create, budgets, docs
- ``k8sfields``   the pass-through pod fields checked against the Kubernetes 1.32 OpenAPI schema
- ``strictyaml``  the YAML loader every file a user hands us goes through
"""

GROUP = "kubetitan.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LlamaPretrain"
PLURAL = "llamapretrains"
SINGULAR = "llamapretrain"
SHORT_NAMES = ["lpt"]

__version__ = "0.1.0"
