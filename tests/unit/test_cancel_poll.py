"""CancelPoll: rows of a running request-level batch asked at most once per period, each found once."""

import pytest

from batchlm.backend.cancel_poll import CancelPoll, leave_check


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Row:
    """A row's question, counting how often it was asked."""

    def __init__(self) -> None:
        self.cancelled = False
        self.asked = 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.cancelled


def test_asks_once_per_period_and_reports_each_row_once():
    clock, rows = Clock(), [Row(), Row(), Row()]
    poll = CancelPoll(rows, period=0.1, clock=clock)
    assert poll.poll() == [] and [r.asked for r in rows] == [0, 0, 0]  # not before a period has passed
    rows[1].cancelled = True
    clock.now += 0.05
    assert poll.poll() == [] and [r.asked for r in rows] == [0, 0, 0]
    clock.now += 0.05
    assert poll.poll() == [1] and [r.asked for r in rows] == [1, 1, 1]
    assert poll.poll() == []  # within the next period: nothing asked
    rows[0].cancelled = rows[2].cancelled = True
    clock.now += 0.1
    assert poll.poll() == [0, 2] and [r.asked for r in rows] == [2, 1, 2]  # row 1 is not asked again
    clock.now += 1
    assert poll.poll() == [] and [r.asked for r in rows] == [2, 1, 2]  # all found: nothing left to ask


def test_a_question_that_raises_counts_as_not_cancelled():
    clock = Clock()

    def broken() -> bool:
        raise RuntimeError("server going away")

    row = Row()
    row.cancelled = True
    poll = CancelPoll([broken, row], period=0.1, clock=clock)
    clock.now += 0.1
    assert poll.poll() == [1]


def test_period_must_be_positive():
    with pytest.raises(ValueError, match="period"):
        CancelPoll([], period=0)


def test_a_row_past_its_deadline_leaves_without_asking_the_server():
    clock, row = Clock(), Row()
    poll = CancelPoll([leave_check(row, deadline=100.25, clock=clock), Row()], period=0.1, clock=clock)
    clock.now = 100.15
    assert poll.poll() == [] and row.asked == 1
    clock.now = 100.3
    assert poll.poll() == [0] and row.asked == 1  # the deadline answered; no round trip
    assert leave_check(row, deadline=None) is row
