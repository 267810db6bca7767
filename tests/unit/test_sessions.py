"""A finished request's LMCache server session ends only once nothing of the request can reach the server any more:
after the worker reported its stores finished, and after a lookup still out at the finish was released."""

from __future__ import annotations

import pytest

from lmcache_r3.mp.sessions import SessionEnds


def spec(name: str, *values):
    """One table row; ``name`` reads as the rule the row pins down."""
    return pytest.param(*values, id=name)


# Events: ("finished", id), ("stores", ids, held ids), ("released", id).
# Each row: the events in order, then the sessions ended after each event.
CASES = [
    spec(
        "a finished request's session ends when its stores are reported finished, not before",
        [("finished", "a"), ("stores", {"a"}, set())],
        [[], ["a"]],
    ),
    spec(
        "a finished request whose lookup is still out ends when the lookup is released",
        [("finished", "a"), ("stores", {"a"}, {"a"}), ("released", "a")],
        [[], [], ["a"]],
    ),
    spec(
        "stores reported for a request not yet finished end nothing (it ends with its own report)",
        [("stores", {"a"}, set()), ("finished", "a"), ("stores", {"a"}, set())],
        [[], [], ["a"]],
    ),
    spec(
        "a lookup released for a request whose stores are still out ends nothing",
        [("finished", "a"), ("released", "a"), ("stores", {"a"}, set())],
        [[], [], ["a"]],
    ),
    spec(
        "each session ends once, whatever repeats",
        [("finished", "a"), ("stores", {"a"}, set()), ("stores", {"a"}, set()), ("released", "a")],
        [[], ["a"], [], []],
    ),
    spec(
        "requests end independently, each at its own report",
        [("finished", "a"), ("finished", "b"), ("stores", {"b"}, set()), ("stores", {"a"}, set())],
        [[], [], ["b"], ["a"]],
    ),
    spec(
        "an id finished again after its session ended waits for its new stores",
        [("finished", "a"), ("stores", {"a"}, set()), ("finished", "a"), ("stores", {"a"}, set())],
        [[], ["a"], [], ["a"]],
    ),
]


@pytest.mark.parametrize(("events", "ended_after_each"), CASES)
def test_session_ends_after_the_requests_last_server_call(events, ended_after_each):
    ended: list[str] = []
    ends = SessionEnds(ended.append)
    seen: list[list[str]] = []
    for event in events:
        before = len(ended)
        kind = event[0]
        if kind == "finished":
            ends.finished(event[1])
        elif kind == "stores":
            ends.stores_finished(event[1], event[2].__contains__)
        else:
            ends.lookup_released(event[1])
        seen.append(ended[before:])
    assert seen == ended_after_each
    assert ends.pending() == 0


def test_pending_counts_finished_requests_whose_session_has_not_ended():
    ended: list[str] = []
    ends = SessionEnds(ended.append)
    ends.finished("a")
    ends.finished("b")
    ends.stores_finished({"a", "b"}, {"b"}.__contains__)
    assert (ended, ends.pending()) == (["a"], 1)
    ends.lookup_released("b")
    assert (ended, ends.pending()) == (["a", "b"], 0)
