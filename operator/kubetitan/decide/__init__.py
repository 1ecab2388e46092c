"""The restart decision (pure: no kopf, no client, no clock).

``decide(spec, status, observed)`` looks at what the cluster shows for one LlamaPretrain and returns
one :class:`Decision`: create the current attempt's children, keep running, wait, restart the gang
with a cause, fail, succeed, suspend, or clean up a finished run. The decision is the first answer of
an ordered list of small named rules (:data:`RULES`, JobSet's failure-policy style): each rule reads
the :class:`~kubetitan.decide.core.Facts` of this cycle and either decides or passes (None). The rules live by
policy, each module with its own table tests: ``failure`` (pod failures, the restart budgets and backoff, node
avoidance, in-place restarts), ``elastic`` (shrink, grow), ``liveness`` (hang, start-up, progress) and ``lifecycle``
(phase, completion, suspension, creation); ``core`` holds what they share. ``kubetitan.status`` turns the
decision into the new status; the kopf handlers only observe, call these two, write the status once,
then delete/create what the decision lists and send its events.

Any failure of one pod ends the whole attempt (gang); the next attempt has new pod names and resumes
from the newest complete checkpoint, so a pod stuck terminating never blocks it.

Observation is not failure: a failed scrape of rank 0's metrics never restarts a run. The hang and
start-up timers fire only on positive evidence (rank 0's metrics answered and showed no new step);
they are measured from times kept in the status (``status.observation``), so an operator restart or
fail-over neither resets nor fires them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kubetitan_core.api import LlamaPretrainSpec, LlamaPretrainStatus
from kubetitan.decide.core import Action, Decision, Rule, facts
from kubetitan.decide.elastic import grow, shrink
from kubetitan.decide.failure import node_grace, pod_failed, restarted_in_place
from kubetitan.decide.lifecycle import (attempt_not_created, attempt_pod_groups, deadline_exceeded, finished,
                                        lowered_steps_reached, rank0_succeeded, ranks_missing, status_behind_cluster,
                                        steps_raised, suspended, unschedulable)
from kubetitan.decide.liveness import hung, running, startup_timed_out, stuck_before_running
from kubetitan.observation import Observed


RULES: tuple[Rule, ...] = (
    status_behind_cluster, finished, deadline_exceeded, suspended, steps_raised, rank0_succeeded,
    lowered_steps_reached, attempt_not_created,
    shrink, pod_failed, ranks_missing, restarted_in_place, unschedulable, node_grace, stuck_before_running, hung,
    startup_timed_out, grow, running,
)
"""The decision rules in order; ``decide`` returns the first one's answer that is not None."""


# ------------------------------------------------------------------ decide
def decide(spec: LlamaPretrainSpec, status: LlamaPretrainStatus, obs: Observed,
           rules: Sequence[Rule] = RULES) -> Decision:
    """The first rule's answer, with the earlier attempts' pods added to what it deletes.

    Earlier attempts' pods always go (a pod stuck terminating on a dead node is forced out); pods of the
    current or a newer attempt are deleted only when a rule says so. A missing ConfigMap/Service of an attempt
    that goes on is listed in ``recreate``.
    """
    f = facts(spec, status, obs)
    for rule in rules:
        d = rule(f)
        if d is not None:
            break
    else:  # pragma: no cover - the last rule always answers
        raise AssertionError("no decision rule answered")
    if d.stale_status:
        return replace(d, rule=rule.__name__)
    force = tuple(dict.fromkeys(f.stuck() + d.force_delete))
    stale = tuple(p.name for p in f.previous if not p.deleting)
    delete = tuple(n for n in dict.fromkeys(stale + d.delete) if n not in force)
    # a ConfigMap/Service deleted by hand while the attempt goes on is created again at once (no restart); a
    # decision that creates the attempt's children creates it anyway, one that ends the attempt needs none
    recreate = obs.missing_children if f.current and d.action in (Action.KEEP, Action.WAIT) else ()
    return replace(d, delete=delete, force_delete=force, recreate=recreate, rule=rule.__name__,
                   delete_pod_groups=attempt_pod_groups(f, d))



__all__ = ["RULES", "Action", "Decision", "decide"]
