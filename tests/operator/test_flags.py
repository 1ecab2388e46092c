"""`kubetitan operator` flags that tune decisions: parsed into Options, bad values refused with the fix."""

from __future__ import annotations

import pytest

from kubetitan_core.hang import AUTO_HANG_FLOOR_SECONDS
from support.fakes import operator_options


def test_the_auto_hang_floor_defaults_to_30_s_and_can_be_lowered() -> None:
    assert operator_options().hang_floor_seconds == AUTO_HANG_FLOOR_SECONDS == 30
    assert operator_options("--hang-floor-seconds=5").hang_floor_seconds == 5.0
    assert operator_options("--hang-floor-seconds", "0.5").hang_floor_seconds == 0.5


@pytest.mark.parametrize("bad", ["0", "-3", "abc", "inf", "nan", ""])
def test_a_hang_floor_that_is_not_positive_seconds_is_refused_with_the_fix(bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        operator_options(f"--hang-floor-seconds={bad}")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--hang-floor-seconds" in err and "is not a number of seconds above 0 (e.g. 30)" in err, err


def test_the_admins_resize_interval_defaults_to_10_minutes_and_reaches_the_decision() -> None:
    """``--resize-min-interval-seconds``: the cluster admin's cap on how often an elastic run resizes."""
    from kubetitan.observation import DEFAULT_RESIZE_MIN_INTERVAL_SECONDS

    assert operator_options().resize_min_interval_seconds == DEFAULT_RESIZE_MIN_INTERVAL_SECONDS == 600
    assert operator_options("--resize-min-interval-seconds=1800").resize_min_interval_seconds == 1800.0


def test_the_admins_pod_group_switch_defaults_to_auto(capsys) -> None:
    assert operator_options().pod_groups == "auto"
    assert operator_options("--pod-groups=disabled").pod_groups == "disabled"
    with pytest.raises(SystemExit):
        operator_options("--pod-groups=off")
    assert "--pod-groups" in capsys.readouterr().err


def test_a_resize_interval_that_is_not_positive_seconds_is_refused_with_the_fix(capsys) -> None:
    with pytest.raises(SystemExit):
        operator_options("--resize-min-interval-seconds=0")
    assert "--resize-min-interval-seconds" in capsys.readouterr().err
