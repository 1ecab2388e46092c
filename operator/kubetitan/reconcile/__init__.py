"""The reconcile loop of one LlamaPretrain, between the kopf edge (``kubetitan.handlers``) and the pure core.

- ``expectations`` — the creates and deletes in flight until the watches show them (controller-runtime's idea);
- ``memory`` — :class:`RunMemory`, the per-run state no read can give back, each field saying why;
- ``apply`` — the decision's writes, idempotent (``create_children``: the one create fan-out);
- ``report`` — the status written once, the metrics after it, each Event once;
- ``cycle`` — observe (``kubetitan.observation.read``: one frozen ``Snapshot``) -> decide -> report the status ->
  apply -> report the Events;
- ``context`` — the operator's options and shared state.

What a cycle reads is ``kubetitan.observation``'s; the policy (``kubetitan.decide``), the status builder
(``kubetitan.status``) and the planner (``kubetitan.plan``) stay pure; nothing here imports kopf.
"""
