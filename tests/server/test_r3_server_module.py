"""The R3 chunk type in a real LMCache MP server: stored under the KV chunk keys, validated on the way in and
out, served byte-equal from L1 and from an L2 tier."""

import os
import threading
import time

import msgspec
import numpy as np
import pytest

from lmcache_r3.artifacts import R3Profile, decode_run, encode_run
from lmcache_r3.mp import protocol
from lmcache_r3.mp.r3_client import R3Client, R3ClientError

pytestmark = pytest.mark.server

CHUNK = 64
PROFILE = R3Profile(num_layers=4, top_k=2, num_experts=8)
MODEL = "tiny-moe"


def tokens_for(seed: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, 1000, size=length).tolist()


def rows_for(seed: int, num_tokens: int, profile: R3Profile = PROFILE) -> np.ndarray:
    rng = np.random.default_rng(10_000 + seed)
    return rng.integers(0, profile.num_experts, size=(num_tokens, *profile.row_shape)).astype(profile.dtype)


def wait_for_hit(client: R3Client, tokens, expected: int, timeout_s: float = 10.0, **kw) -> int:
    """Stores become visible asynchronously; poll the lookup (bounded) until it reports ``expected``."""
    deadline = time.monotonic() + timeout_s
    while True:
        hit = client.lookup(tokens, **kw).result().num_hit_chunks
        if hit == expected or time.monotonic() > deadline:
            return hit
        time.sleep(0.01)


@pytest.fixture
def client(r3_server):
    with R3Client(r3_server.url, MODEL, PROFILE) as r3:
        yield r3


def store_rows(client: R3Client, tokens, rows, start=0, **kw):
    objects = encode_run(PROFILE, start, rows[start:], CHUNK)
    return client.store(tokens, start, objects, end=start + len(rows[start:]), **kw).result()


def test_store_then_fetch_returns_the_same_rows_from_l1(own_r3_server):
    r3_server = own_r3_server
    tokens = tokens_for(1, 4 * CHUNK)
    rows = rows_for(1, 4 * CHUNK)
    with R3Client(r3_server.url, MODEL, PROFILE) as client:
        stored = store_rows(client, tokens, rows)
        assert (stored.num_chunks, stored.num_stored) == (4, 4)
        assert wait_for_hit(client, tokens, 4) == 4
        fetched = client.fetch(tokens).result()
    assert fetched.num_hit_chunks == 4
    decoded = decode_run(fetched.objects, PROFILE, 0, CHUNK)
    assert decoded.error is None
    assert np.array_equal(np.concatenate([c.rows for c in decoded.chunks]), rows)
    assert r3_server.l1_counts()["read_locked_count"] == 0


def test_fetch_after_l1_is_cleared_comes_from_the_l2_tier_byte_equal(r3_server_with_fs_tier):
    server = r3_server_with_fs_tier
    tokens, rows = tokens_for(2, 3 * CHUNK), rows_for(2, 3 * CHUNK)
    with R3Client(server.url, MODEL, PROFILE) as r3:
        store_rows(r3, tokens, rows)
        assert wait_for_hit(r3, tokens, 3) == 3
        objects_before = server.l1_counts()["total_object_count"]
        deadline = time.monotonic() + 10
        while True:  # the fs tier writes behind L1; clear once it has the objects
            server.clear_l1()
            if server.l1_counts()["total_object_count"] < objects_before or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert server.l1_counts()["total_object_count"] == 0
        fetched = r3.fetch(tokens).result()
        assert fetched.num_hit_chunks == 3
        decoded = decode_run(fetched.objects, PROFILE, 0, CHUNK)
        assert np.array_equal(np.concatenate([c.rows for c in decoded.chunks]), rows)


def test_another_cache_salt_never_hits(client):
    tokens, rows = tokens_for(3, 2 * CHUNK), rows_for(3, 2 * CHUNK)
    store_rows(client, tokens, rows, cache_salt="alice")
    assert wait_for_hit(client, tokens, 2, cache_salt="alice") == 2
    assert client.lookup(tokens, cache_salt="bob").result().num_hit_chunks == 0
    assert client.lookup(tokens).result().num_hit_chunks == 0


def test_a_sequence_sharing_the_first_k_chunks_hits_exactly_k(client):
    tokens, rows = tokens_for(4, 4 * CHUNK), rows_for(4, 4 * CHUNK)
    store_rows(client, tokens, rows)
    assert wait_for_hit(client, tokens, 4) == 4
    diverged = tokens[: 2 * CHUNK + 5] + [7] * (2 * CHUNK - 5)
    assert client.lookup(diverged).result().num_hit_chunks == 2
    fetched = client.fetch(diverged).result()
    decoded = decode_run(fetched.objects, PROFILE, 0, CHUNK)
    assert np.array_equal(np.concatenate([c.rows for c in decoded.chunks]), rows[: 2 * CHUNK])


def test_a_partial_last_chunk_is_never_stored(client):
    tokens, rows = tokens_for(5, 2 * CHUNK + 20), rows_for(5, 2 * CHUNK + 20)
    full = encode_run(PROFILE, 0, rows[: 2 * CHUNK], CHUNK)
    assert client.store(tokens, 0, full).result().num_chunks == 2  # end = len(tokens): the tail is not a chunk
    with_tail = full + encode_run(PROFILE, 2 * CHUNK, rows_for(6, CHUNK), CHUNK)
    with pytest.raises(R3ClientError, match="partial chunks are never stored"):
        client.store(tokens, 0, with_tail).result()
    longer = tokens + tokens_for(7, CHUNK)
    assert wait_for_hit(client, longer, 2) == 2


@pytest.mark.parametrize(
    "damage",
    ["flipped_payload_byte", "flipped_header_byte", "truncated", "other_profile", "wrong_start", "garbage_message"],
)
def test_malformed_stores_are_refused_with_the_reason_and_nothing_is_stored(client, r3_server, damage):
    tokens, rows = tokens_for(100 + len(damage), 2 * CHUNK), rows_for(8, 2 * CHUNK)
    objects = bytearray(encode_run(PROFILE, 0, rows, CHUNK))
    reason = "is invalid"
    if damage == "flipped_payload_byte":
        objects[-1] ^= 0x01
        reason = "checksum"
    elif damage == "flipped_header_byte":
        objects[30] ^= 0x40
        reason = "checksum"
    elif damage == "truncated":
        objects = objects[:-3]
        reason = "bytes were sent"
    elif damage == "other_profile":
        other = R3Profile(num_layers=4, top_k=2, num_experts=300)
        objects = bytearray(encode_run(other, 0, rows_for(8, 2 * CHUNK, other), CHUNK))
        reason = "bytes were sent"
    elif damage == "wrong_start":
        objects = bytearray(encode_run(PROFILE, CHUNK, rows, CHUNK))
        reason = "is invalid"
    if damage == "garbage_message":
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        future = client._client.server_module_call(
            ServerModuleCallRequest(method=protocol.METHOD_STORE, payload=os.urandom(64))
        )
        response = future.result(timeout=10)
        assert not response.success and "malformed StoreRequest" in response.error
    else:
        with pytest.raises(R3ClientError, match=reason):
            client.store(tokens, 0, bytes(objects)).result()
    # nothing stored, and the server keeps serving
    assert client.lookup(tokens).result().num_hit_chunks == 0
    assert r3_server.ping()
    good = store_rows(client, tokens, rows)
    assert good.num_stored == 2


def test_one_store_many_call_stores_every_requests_chunks_and_a_shared_chunk_once(client):
    shared = tokens_for(30, CHUNK)
    first, second = shared + tokens_for(31, 2 * CHUNK), shared + tokens_for(32, CHUNK)
    first_rows, second_rows = rows_for(31, 3 * CHUNK), rows_for(31, 2 * CHUNK)  # same tokens, same routing
    second_rows[CHUNK:] = rows_for(32, CHUNK)
    items = [
        (first, 0, encode_run(PROFILE, 0, first_rows, CHUNK), 3 * CHUNK, ""),
        (second, 0, encode_run(PROFILE, 0, second_rows, CHUNK), 2 * CHUNK, ""),
    ]
    results = client.store_many(items).result().results
    assert [(r.num_chunks, r.num_stored, r.num_present) for r in results] == [(3, 3, 0), (2, 1, 1)]
    for tokens, rows in ((first, first_rows), (second, second_rows)):
        assert wait_for_hit(client, tokens, len(rows) // CHUNK) == len(rows) // CHUNK
        decoded = decode_run(client.fetch(tokens).result().objects, PROFILE, 0, CHUNK)
        np.testing.assert_array_equal(np.concatenate([c.rows for c in decoded.chunks]), rows)


def test_wait_for_stores_on_a_server_that_is_not_there_fails_at_once_naming_the_address():
    from lmcache_r3.launch import free_port
    from lmcache_r3.mp.server_process import wait_for_stores

    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"LMCache server at {url} does not answer GET /status"):
        wait_for_stores(url, timeout_s=30.0)
    assert time.monotonic() - started < 10.0


def test_one_fetch_many_call_answers_each_range_in_order(client):
    stored, missing = tokens_for(35, 3 * CHUNK), tokens_for(36, 2 * CHUNK)
    rows = rows_for(35, 3 * CHUNK)
    store_rows(client, stored, rows)
    assert wait_for_hit(client, stored, 3) == 3
    results = client.fetch_many([(stored, CHUNK, 3 * CHUNK, ""), (missing, 0, 2 * CHUNK, ""), (stored, 0, None, "")])
    first, miss, whole = results.result().results
    assert (first.num_hit_chunks, miss.num_hit_chunks, miss.objects, whole.num_hit_chunks) == (2, 0, b"", 3)
    decoded = decode_run(first.objects, PROFILE, CHUNK, CHUNK)
    np.testing.assert_array_equal(np.concatenate([c.rows for c in decoded.chunks]), rows[CHUNK:])


def test_a_fetch_many_call_with_one_invalid_range_is_refused_and_locks_nothing(own_r3_server):
    tokens = tokens_for(37, 2 * CHUNK)
    with R3Client(own_r3_server.url, MODEL, PROFILE) as client:
        store_rows(client, tokens, rows_for(37, 2 * CHUNK))
        assert wait_for_hit(client, tokens, 2) == 2
        # The first range is valid and stored; the second starts inside a chunk.
        with pytest.raises(R3ClientError, match=r"token range \[5, 128\) of 128 tokens is invalid"):
            client.fetch_many([(tokens, 0, 2 * CHUNK, ""), (tokens, 5, 2 * CHUNK, "")]).result()
        time.sleep(0.3)  # a prefetch started for the valid range would have taken its read locks by now
        assert own_r3_server.l1_counts()["read_locked_count"] == 0
        assert client.fetch(tokens).result().num_hit_chunks == 2  # the server still serves the range


def test_fetch_many_ranges_sharing_chunks_and_a_gap_hit_their_leading_chunks_and_release_every_lock(own_r3_server):
    tokens = tokens_for(38, 3 * CHUNK)
    sibling = tokens[:CHUNK] + tokens_for(39, 2 * CHUNK)  # shares the first chunk, not the rest
    rows = rows_for(38, 3 * CHUNK)
    with R3Client(own_r3_server.url, MODEL, PROFILE) as client:
        store_rows(client, tokens, rows)
        assert wait_for_hit(client, tokens, 3) == 3
        assert client.delete(tokens, CHUNK, 2 * CHUNK).result().num_deleted == 1  # a gap: chunk 2 is still stored
        calls = [(tokens, 0, 3 * CHUNK, ""), (sibling, 0, 3 * CHUNK, ""), (tokens, 2 * CHUNK, 3 * CHUNK, "")]
        first, shared, after_gap = client.fetch_many(calls).result().results
        assert (first.num_hit_chunks, shared.num_hit_chunks, after_gap.num_hit_chunks) == (1, 1, 1)
        assert first.objects == shared.objects  # the chunk both ranges share
        np.testing.assert_array_equal(decode_run(first.objects, PROFILE, 0, CHUNK).chunks[0].rows, rows[:CHUNK])
        np.testing.assert_array_equal(
            decode_run(after_gap.objects, PROFILE, 2 * CHUNK, CHUNK).chunks[0].rows, rows[2 * CHUNK :]
        )
        # Every object the call locked is released, those past a range's gap included.
        assert own_r3_server.l1_counts()["read_locked_count"] == 0


def test_one_malformed_item_refuses_the_whole_store_many_call(client):
    good, bad = tokens_for(33, 2 * CHUNK), tokens_for(34, CHUNK)
    damaged = bytearray(encode_run(PROFILE, 0, rows_for(34, CHUNK), CHUNK))
    damaged[-1] ^= 0xFF
    items = [(good, 0, encode_run(PROFILE, 0, rows_for(33, 2 * CHUNK), CHUNK), 2 * CHUNK, ""),
             (bad, 0, bytes(damaged), CHUNK, "")]  # fmt: skip
    with pytest.raises(R3ClientError, match=r"nothing stored: R3 object 0 of 1 \(item 2 of 2\) is invalid"):
        client.store_many(items).result()
    assert client.lookup(good).result().num_hit_chunks == 0


@pytest.mark.parametrize(
    "other",
    [
        R3Profile(num_layers=4, top_k=2, num_experts=16),  # objects of the same size
        R3Profile(num_layers=8, top_k=2, num_experts=8),  # bigger: never read past the stored object
        R3Profile(num_layers=2, top_k=2, num_experts=8),  # smaller
    ],
    ids=["same-size", "bigger", "smaller"],
)
def test_objects_of_another_profile_under_the_same_key_are_a_miss_and_stay(client, r3_server, other):
    # Two engines deriving different profiles for one model name: each misses the other's objects, and neither
    # deletes them as damaged.
    seed = 9 + other.num_layers + other.num_experts
    tokens, rows = tokens_for(seed, CHUNK), rows_for(seed, CHUNK)
    store_rows(client, tokens, rows)
    assert wait_for_hit(client, tokens, 1) == 1
    damaged = r3_server.status()["lmcache_r3"]["damaged_objects"]
    with R3Client(r3_server.url, MODEL, other) as reader:
        assert reader.lookup(tokens).result().num_hit_chunks == 0
        assert reader.fetch(tokens).result().objects == b""
    assert r3_server.status()["lmcache_r3"]["damaged_objects"] == damaged, "an intact object was taken for damaged"
    (chunk,) = decode_run(client.fetch(tokens).result().objects, PROFILE, 0, CHUNK).chunks
    np.testing.assert_array_equal(chunk.rows, rows)


def test_eight_concurrent_clients_on_overlapping_prefixes_only_ever_read_what_was_stored(own_r3_server):
    r3_server = own_r3_server
    shared = tokens_for(11, 2 * CHUNK)
    shared_rows = rows_for(11, 2 * CHUNK)
    errors: list[str] = []

    def worker(index: int) -> None:
        with R3Client(r3_server.url, MODEL, PROFILE, timeout_s=20) as r3:
            tokens = shared + tokens_for(200 + index, 2 * CHUNK)
            rows = np.concatenate([shared_rows, rows_for(200 + index, 2 * CHUNK)])
            for _ in range(5):
                r3.store(tokens, 0, encode_run(PROFILE, 0, rows, CHUNK)).result()
                fetched = r3.fetch(tokens).result()
                decoded = decode_run(fetched.objects, PROFILE, 0, CHUNK)
                if decoded.error is not None or len(decoded.chunks) != fetched.num_hit_chunks:
                    errors.append(f"client {index}: invalid object served: {decoded.error}")
                got = np.concatenate([c.rows for c in decoded.chunks]) if decoded.chunks else rows[:0]
                if not np.array_equal(got, rows[: len(got)]):
                    errors.append(f"client {index}: rows differ from what was stored")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert r3_server.l1_counts()["read_locked_count"] == 0


def test_status_reports_the_r3_counters(client, r3_server):
    tokens, rows = tokens_for(12, CHUNK), rows_for(12, CHUNK)
    store_rows(client, tokens, rows)
    status = r3_server.status()["lmcache_r3"]
    assert status["namespace"] == "##r3" and status["chunk_size"] == CHUNK
    assert status["stored_chunks"] >= 1 and status["store_calls"] >= 1


def test_status_reports_the_server_time_r3_handlers_took(client, r3_server):
    tokens = tokens_for(13, 2 * CHUNK)
    before = r3_server.status()["lmcache_r3"]
    store_rows(client, tokens, rows_for(13, 2 * CHUNK))
    stored = r3_server.status()["lmcache_r3"]
    assert client.fetch(tokens).result().num_hit_chunks == 2
    fetched = r3_server.status()["lmcache_r3"]
    assert stored["store_handler_us"] > before["store_handler_us"]  # a store costs server time, and it shows
    assert stored["read_handler_us"] == before["read_handler_us"]
    assert fetched["read_handler_us"] > stored["read_handler_us"]
    assert fetched["store_handler_us"] == stored["store_handler_us"]


def test_info_reports_chunk_size_and_namespace(client):
    info = client.info().result()
    assert (info.chunk_size, info.namespace) == (CHUNK, "##r3")


def test_protocol_messages_round_trip():
    request = protocol.LookupRequest(protocol.ChunkRange(MODEL, [1, 2, 3], 0, 3, "s"), protocol.ProfileSpec(4, 2, 8))
    assert protocol.decode(protocol.encode(request), protocol.LookupRequest) == request
    with pytest.raises(msgspec.DecodeError):
        protocol.decode(b"\x00\x01", protocol.LookupRequest)


def test_an_object_damaged_in_the_tier_is_never_served(r3_server_with_fs_tier, tmp_path_factory):
    server = r3_server_with_fs_tier
    base = next(a["base_path"] for a in server.settings.l2_adapters)
    tokens, rows = tokens_for(13, 2 * CHUNK), rows_for(13, 2 * CHUNK)
    with R3Client(server.url, MODEL, PROFILE) as r3:
        before = {p for p in _files(base)}
        store_rows(r3, tokens, rows)
        deadline = time.monotonic() + 10
        while len(new := _files(base) - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(new) == 2, f"expected the tier to hold 2 new objects, found {sorted(new)}"
        second = max(new, key=lambda p: _header_token_start(p))
        data = bytearray(open(second, "rb").read())
        data[-10] ^= 0xFF  # one payload byte of chunk 1 flips on disk
        open(second, "wb").write(bytes(data))
        server.clear_l1()
        fetched = r3.fetch(tokens).result()
        assert fetched.num_hit_chunks == 1, "the damaged chunk must end the hit"
        decoded = decode_run(fetched.objects, PROFILE, 0, CHUNK)
        assert np.array_equal(decoded.chunks[0].rows, rows[:CHUNK])
        assert server.status()["lmcache_r3"]["damaged_objects"] >= 1
        assert second not in _files(base), "the damaged object stays in the tier"
        assert r3.lookup(tokens).result().num_hit_chunks == 1


def _files(base: str) -> set[str]:
    return {os.path.join(root, name) for root, _, names in os.walk(base) for name in names}


def _header_token_start(path: str) -> int:
    from lmcache_r3.artifacts import read_header

    data = open(path, "rb").read()
    index = data.find(b"R3RX")
    return read_header(data[index:]).token_start


def test_calls_piling_up_for_a_dead_server_never_stall_the_other_clients_of_the_process(r3_server):
    """LMCache sends the requests of every client in a process from one polling thread. Past zmq's high-water mark
    (1000 queued messages) a send to a dead server would block that thread, and with it every other client's
    calls (LMCache's own KV traffic included): the calls to the dead server fail instead, the others go on."""
    from lmcache_r3.launch import free_port

    tokens = tokens_for(15, CHUNK)
    with R3Client(f"tcp://127.0.0.1:{free_port()}", MODEL, PROFILE, timeout_s=30) as dead:
        with R3Client(r3_server.url, MODEL, PROFILE, timeout_s=10) as live:
            piled = [dead.lookup(tokens) for _ in range(1500)]
            assert live.lookup(tokens).result().num_hit_chunks == 0, "the live server's call never came back"
            for call in piled[1200:]:
                with pytest.raises(R3ClientError, match="could not be sent to the LMCache server"):
                    call.result(timeout=5)


def test_a_dead_server_costs_the_caller_a_bounded_wait_and_a_clear_error():
    from lmcache_r3.launch import free_port
    from lmcache_r3.mp.r3_client import R3TimeoutError

    with R3Client(f"tcp://127.0.0.1:{free_port()}", MODEL, PROFILE, timeout_s=0.5) as r3:
        call = r3.lookup(tokens_for(14, CHUNK))
        started = time.monotonic()
        with pytest.raises(R3TimeoutError, match="no answer from the LMCache server within the bound"):
            call.result()
        assert time.monotonic() - started < 5
