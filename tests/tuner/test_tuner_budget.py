import time

import pytest

from kilnx.tuner.budget import Budget, parse_duration


@pytest.mark.parametrize("text, seconds", [("2m", 120), ("90s", 90), ("1h", 3600), ("1h30m", 5400),
                                           ("45", 45), ("0.5m", 30), (" 10M ", 600), ("250ms", 0.25)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "5x", "m", "-1m", "0s", "2m!"])
def test_parse_duration_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_budget_gives_unused_time_to_later_targets():
    b = Budget(total_s=90, targets=3)
    assert b.next_target_seconds() == pytest.approx(30, abs=0.5)
    b.finish_target()  # the first target took (almost) no time: the other two share all 90 s
    assert b.next_target_seconds() == pytest.approx(45, abs=0.5)
    b.started -= 60  # pretend 60 s went by
    b.finish_target()
    assert b.next_target_seconds() == pytest.approx(30, abs=0.5)
    b.started -= 100
    assert b.next_target_seconds() == 0.0

