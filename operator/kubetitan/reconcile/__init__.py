"""The reconcile loop of one LlamaPretrain, between the kopf edge (``kubetitan.handlers``) and the pure core.

- ``snapshot`` — :class:`Snapshot`, one cycle's frozen read of a run, and its pure helpers (``decision_inputs``);
- ``observe`` — the read that fills it (object, indexes, rank 0's /metrics, the attempt's applied spec);
- ``expectations`` — the creates and deletes in flight until the watches show them (controller-runtime's idea);
- ``memory`` — :class:`RunMemory`, the per-run state no read can give back, each field saying why;
- ``apply`` — the decision's writes, idempotent (``create_children``: the one create fan-out);
- ``report`` — the status written once, the metrics after it, each Event once;
- ``cycle`` — observe -> decide -> report the status -> apply -> report the Events;
- ``context`` — the operator's options and shared state.

The policy (``kubetitan.decide``), the status builder (``kubetitan.status``) and the planner (``kubetitan.plan``)
stay pure; nothing here imports kopf.
"""
