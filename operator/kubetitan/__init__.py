"""kubetitan: the operator and the ``kubetitan`` CLI (Llama-3-style pre-training on Kubernetes with torchtitan).

Torch-free on purpose: the operator and the CLI install and run without it. What the operator shares with the
trainer (API types, rule table, CRD, catalog, trainer.toml rendering, contract) lives in the separate
``kubetitan_core`` package (operator/core); this package never imports ``kubetitan_trainer``, and the trainer
never imports this one. Layout (pure core, thin edge):

- ``plan``        spec + attempt -> the child objects of one attempt
- ``observation`` what the operator saw of a run, typed: pods, nodes, rank 0's scrape, the cycle's snapshot
- ``decide``      observed state -> the next action (ordered rule table ``decide.RULES``; one module per policy)
- ``status``      the one place the status is built
- ``conditions``  condition types and reasons
- ``policy``      the cluster admin's policy (allowed hostPaths, images, service accounts, ...)
- ``apidoc``      docs/api.md generated from ``kubetitan_core``
- ``reconcile``   one cycle of a run: observe (``observation.read``) -> decide -> report -> apply, with expectations
- ``handlers``    the kopf registration (indexes, wake-ups, daemons); ``runner`` its flags and main loop
- ``kube``        the client edge
- ``cli``         the ``kubetitan`` command (``run``/``prepare-data`` hand over to the trainer's own process)
"""

__version__ = "0.1.0"
