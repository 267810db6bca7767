"""Tiers shared and stacked: two LMCache servers on one /dev/shm root, and a server with the /dev/shm tier above
the Mooncake tier."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from lmcache_r3.mp.r3_client import R3Client
from tests.server.test_r3_server_module import CHUNK, MODEL, PROFILE, rows_for, store_rows, tokens_for
from tests.support.mooncake import MOONCAKE_ENV
from tests.tiers import test_mooncake_tier as mooncake
from tests.tiers.test_shm_tier import clear_l1, fetch_rows, shm_root, shm_tier, tier_files, wait_for_files

__all__ = ["shm_root"]  # the fixture, shared with the shm tier tests

pytestmark = pytest.mark.server


def start_shm(factory, root: str):
    return factory(l2_adapters=(shm_tier(root),))


def test_two_servers_on_one_root_serve_each_others_objects_and_never_a_torn_one(r3_server_factory, shm_root):
    first, second = start_shm(r3_server_factory, shm_root), start_shm(r3_server_factory, shm_root)
    prompts = {seed: (tokens_for(seed, 3 * CHUNK), rows_for(seed, 3 * CHUNK)) for seed in range(400, 408)}
    failures: list[str] = []

    def writer_and_reader(server, seeds):
        with R3Client(server.url, MODEL, PROFILE, timeout_s=20) as r3:
            for seed in seeds:  # both servers write the same keys, in opposite orders
                tokens, rows = prompts[seed]
                store_rows(r3, tokens, rows)
            for seed in seeds:
                hits, fetched = fetch_rows(r3, prompts[seed][0])
                if hits and not np.array_equal(fetched, prompts[seed][1][: hits * CHUNK]):
                    failures.append(f"seed {seed}: wrong rows through {server.url}")

    threads = [threading.Thread(target=writer_and_reader, args=(first, list(prompts))),
               threading.Thread(target=writer_and_reader, args=(second, list(reversed(prompts))))]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures
    wait_for_files(shm_root, 3 * len(prompts))  # one file per key: the first writer won, the other was a no-op
    assert len(tier_files(shm_root)) == 3 * len(prompts)

    clear_l1(first)
    clear_l1(second)
    with R3Client(second.url, MODEL, PROFILE) as r3:  # what either server wrote, the other serves from the root
        for tokens, rows in prompts.values():
            hits, fetched = fetch_rows(r3, tokens)
            assert hits == 3 and np.array_equal(fetched, rows)
    first.stop()
    second.stop()


@pytest.mark.mooncake
def test_shm_stacked_above_mooncake_serves_from_mooncake_when_the_root_is_emptied(
    r3_server_factory, mooncake_cluster, shm_root
):
    with pytest.MonkeyPatch.context() as env:
        for name, value in MOONCAKE_ENV.items():
            env.setenv(name, value)
        server = r3_server_factory(l2_adapters=(shm_tier(shm_root), mooncake.mooncake_tier(mooncake_cluster)))
    try:
        mooncake.wait_for(lambda: mooncake.tier_status(server)["state"] == "up", 10, "connected to the master")
        tokens, rows = tokens_for(420, 3 * CHUNK), rows_for(420, 3 * CHUNK)
        with R3Client(server.url, MODEL, PROFILE) as r3:
            assert store_rows(r3, tokens, rows).num_stored == 3
            wait_for_files(shm_root, 3)
            mooncake.wait_for_stored(server, 3)
            clear_l1(server)
            hits, fetched = fetch_rows(r3, tokens)
            assert hits == 3 and np.array_equal(fetched, rows)  # from the first tier that has them
            for entry in tier_files(shm_root):
                os.remove(entry)
            clear_l1(server)
            hits, fetched = fetch_rows(r3, tokens)
            assert hits == 3 and np.array_equal(fetched, rows)  # the shm tier lost them; Mooncake still serves
    finally:
        server.stop()
