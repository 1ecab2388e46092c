"""kubetitan: Llama-3-style pre-training on Kubernetes with torchtitan.

The package is torch-free on purpose: the operator and the CLI install and run without it.
Layout (pure core, thin edge):

- ``api``         the typed ``LlamaPretrain`` spec and status, defaults (one source of truth)
- ``catalog``     model flavours and accelerator facts the validator and planner need
- ``validation``  semantic checks that the OpenAPI schema cannot express
- ``crd``         the CustomResourceDefinition generated from ``api``
- ``render``      spec -> the trainer's TOML config (torchtitan 0.2.2 keys + ``[kubetitan]``)
- ``plan``        spec + attempt -> the child objects of one attempt
- ``contract``    exit codes and the checkpoint rule shared by trainer and operator
- ``cli``         the ``kubetitan`` command
"""

GROUP = "kubetitan.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LlamaPretrain"
PLURAL = "llamapretrains"
SINGULAR = "llamapretrain"
SHORT_NAMES = ["lpt"]

__version__ = "0.1.0"
