"""StoresInFlight: a finished request is reported done sending only once every store of it has answered."""

import pytest

from lmcache_r3.mp.stores_in_flight import StoresInFlight


class Future:
    """A store's answer, as LMCache's ``MessagingFuture.query()`` reports it."""

    def __init__(self) -> None:
        self.answered = False

    def query(self) -> bool:
        return self.answered


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "answered, healthy, waited_s, done",
    [
        ((), True, 0.0, set()),  # both stores out: held
        ((0,), True, 0.0, set()),  # the earlier answered, the later (which LMCache tracks last) is out: held
        ((1,), True, 0.0, set()),  # the later answered first, the earlier is out: held
        ((0, 1), True, 0.0, {"a"}),  # every store answered
        ((), False, 0.0, {"a"}),  # the server is unhealthy: LMCache failed the stores, nothing will answer
        ((), True, 59.9, set()),
        ((), True, 60.0, {"a"}),  # held as long as LMCache's own wait for a store: freed, with a warning
    ],
)
def test_a_finished_request_waits_for_each_of_its_stores(answered, healthy, waited_s, done):
    clock = Clock()
    stores = StoresInFlight(clock=clock)
    futures = [Future(), Future()]
    for future in futures:
        stores.submitted("a", future)
    assert stores.finished_sending({"a"}, healthy=True) == set()  # reported while both are out
    for i in answered:
        futures[i].answered = True
    clock.now += waited_s
    assert stores.finished_sending(set(), healthy) == done  # LMCache reports a request once; the hold remembers it
    assert stores.held() == {"a"} - done


def test_requests_without_stores_out_pass_at_once_and_others_are_not_held_for_them():
    stores = StoresInFlight()
    out = Future()
    stores.submitted("a", out)
    answered = Future()
    answered.answered = True
    stores.submitted("b", answered)
    assert stores.finished_sending({"a", "b", "c"}, healthy=True) == {"b", "c"}
    out.answered = True
    assert stores.finished_sending(set(), healthy=True) == {"a"}
    assert stores.finished_sending(set(), healthy=True) == set()  # reported once


def test_answered_stores_of_running_requests_are_forgotten():
    stores = StoresInFlight()
    for _ in range(1000):
        future = Future()
        stores.submitted("running", future)
        future.answered = True
        stores.finished_sending(set(), healthy=True)
    assert stores.storing() == set()  # nothing accumulates while the request runs
    assert stores.finished_sending({"running"}, healthy=True) == {"running"}
