"""A finished request's LMCache server session ends only once nothing of the request can reach the server any more:
after the worker reported its stores finished, and after a lookup still out at the finish was released."""

from __future__ import annotations

import time

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


# ("release sent", id): the request's lookup locks were released, the server has not answered; ("answered", id):
# it answered; ("poll",): an engine step.
CASES += [
    spec(
        "a session ends only once the server answered the release of its lookup's locks",
        [("finished", "a"), ("release sent", "a"), ("stores", {"a"}, set()), ("poll",), ("answered", "a"), ("poll",)],
        [[], [], [], [], [], ["a"]],
    ),
    spec(
        "an answered release does not hold the end",
        [("finished", "a"), ("release sent", "a"), ("answered", "a"), ("stores", {"a"}, set())],
        [[], [], [], ["a"]],
    ),
    spec(
        "a lookup released after the finish ends the session at the step after the server answered",
        [
            ("finished", "a"),
            ("stores", {"a"}, {"a"}),
            ("release sent", "a"),
            ("released", "a"),
            ("answered", "a"),
            ("poll",),
        ],
        [[], [], [], [], [], ["a"]],
    ),  # fmt: skip
    spec(
        "one request's unanswered release holds no other session",
        [
            ("finished", "a"),
            ("finished", "b"),
            ("release sent", "a"),
            ("stores", {"a", "b"}, set()),
            ("answered", "a"),
            ("poll",),
        ],
        [[], [], [], ["b"], [], ["a"]],
    ),  # fmt: skip
]


class Answer:
    """The server's answer to a release, as the connector sees it: done or not (``query()``, as LMCache's futures)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def run(events) -> tuple[list[list[str]], SessionEnds]:
    ended: list[str] = []
    ends = SessionEnds(ended.append)
    answers: dict[str, Answer] = {}
    seen: list[list[str]] = []
    for event in events:
        before = len(ended)
        kind = event[0]
        if kind == "finished":
            ends.finished(event[1])
        elif kind == "stores":
            ends.stores_finished(event[1], event[2].__contains__)
        elif kind == "released":
            ends.lookup_released(event[1])
        elif kind == "release sent":
            ends.release_sent(event[1], [answers.setdefault(event[1], Answer())])
        elif kind == "answered":
            answers[event[1]].done = True
        else:
            ends.poll()
        seen.append(ended[before:])
    return seen, ends


@pytest.mark.parametrize(("events", "ended_after_each"), CASES)
def test_session_ends_after_the_requests_last_server_call(events, ended_after_each):
    seen, ends = run(events)
    assert seen == ended_after_each
    assert ends.pending() == 0


def test_a_release_the_server_never_answers_holds_the_session_end_only_for_the_bound():
    ended: list[str] = []
    ends = SessionEnds(ended.append)
    ends.finished("a")
    ends.release_sent("a", [Answer()], wait_s=0.05)
    ends.stores_finished({"a"}, lambda r: False)
    ends.poll()
    assert ended == [] and ends.pending() == 1
    time.sleep(0.06)
    ends.poll()
    assert ended == ["a"] and ends.pending() == 0


def test_pending_counts_finished_requests_whose_session_has_not_ended():
    ended: list[str] = []
    ends = SessionEnds(ended.append)
    ends.finished("a")
    ends.finished("b")
    ends.stores_finished({"a", "b"}, {"b"}.__contains__)
    assert (ended, ends.pending()) == (["a"], 1)
    ends.lookup_released("b")
    assert (ended, ends.pending()) == (["a", "b"], 0)
