"""The Mooncake tier's pure parts, and its behaviour with no master at all: settings that fail with the key and the
fix, objects that are served only when their header and checksum match, batches that stay within their staging
bound, distinct keys for distinct objects, and a tier that answers at once while it cannot reach a master."""

from __future__ import annotations

import json
import os
import time

import pytest
import xxhash
from lmcache.v1.distributed.api import ObjectKey

from lmcache_r3.launch import LOOPBACK, free_port
from lmcache_r3.tiers.holds import UNHELD
from lmcache_r3.tiers.mooncake_adapter import MooncakeL2Adapter, mooncake_key
from lmcache_r3.tiers.mooncake_client import UNAVAILABLE, _Deadlines, describe
from lmcache_r3.tiers.mooncake_config import (
    MooncakeTierConfigError,
    mooncake_config,
    parse_size,
    settings_from_params,
)
from lmcache_r3.tiers.mooncake_store import MooncakeObjectStore, batch_groups, open_object, prefix_pattern, seal_object
from lmcache_r3.tiers.shm_store import HEADER, encode_header

MOONCAKE = {"local_hostname": LOOPBACK, "metadata_server": "P2PHANDSHAKE", "master_server_address": "10.0.0.1:50051"}


@pytest.fixture
def no_mooncake_env(monkeypatch):
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    return monkeypatch


# -- settings ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 0), (4096, 4096), ("512MB", 512 << 20), ("1.5g", 3 << 29), ("64 kb", 64 << 10), ("100", 100), ("7b", 7)],
)
def test_sizes_are_read_as_ints_or_with_a_unit(value, expected):
    assert parse_size("x", value) == expected


@pytest.mark.parametrize("value", [-1, "abc", "MB", True, None, 1.5, "-2GB"])
def test_a_bad_size_names_its_key(value):
    with pytest.raises(MooncakeTierConfigError, match=r"adapter_params\.batch_bytes must be a size in bytes"):
        parse_size("adapter_params.batch_bytes", value)


@pytest.mark.parametrize("missing", ["local_hostname", "metadata_server", "master_server_address"])
def test_a_missing_required_setting_is_named_with_an_example(missing):
    inline = {key: value for key, value in MOONCAKE.items() if key != missing}
    with pytest.raises(MooncakeTierConfigError, match=rf"adapter_params\.mooncake\.{missing} is required.*e\.g\."):
        mooncake_config(inline)


def test_an_unknown_or_malformed_setting_is_named():
    with pytest.raises(MooncakeTierConfigError, match=r"unknown keys \['master_adress'\]; known keys"):
        mooncake_config({**MOONCAKE, "master_adress": "x"})
    with pytest.raises(MooncakeTierConfigError, match=r"adapter_params\.mooncake\.local_buffer_size must be a size"):
        mooncake_config({**MOONCAKE, "local_buffer_size": "lots"})
    with pytest.raises(MooncakeTierConfigError, match=r"adapter_params\.mooncake: .*protocol"):
        mooncake_config({**MOONCAKE, "protocol": ""})


def test_inline_settings_default_to_a_client_that_lends_no_memory():
    config = mooncake_config({**MOONCAKE, "local_buffer_size": "1MB"})
    assert (config.global_segment_size, config.local_buffer_size, config.protocol) == (0, 1 << 20, "tcp")


def test_without_inline_settings_the_file_in_mooncake_config_path_is_read(tmp_path, no_mooncake_env):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({**MOONCAKE, "global_segment_size": "1GB"}))
    no_mooncake_env.setenv("MOONCAKE_CONFIG_PATH", str(path))
    settings = settings_from_params({"master_metrics_port": 9100})
    assert settings.mooncake.master_server_address == "10.0.0.1:50051"
    assert settings.mooncake.global_segment_size == 1 << 30
    assert settings.health_url == "http://10.0.0.1:9100/health"


def test_a_bad_mooncake_config_path_says_what_is_wrong_with_it(tmp_path, no_mooncake_env):
    with pytest.raises(MooncakeTierConfigError, match=r"adapter_params\.mooncake .* MOONCAKE_CONFIG_PATH"):
        settings_from_params({})
    no_mooncake_env.setenv("MOONCAKE_CONFIG_PATH", str(tmp_path / "absent.json"))
    with pytest.raises(MooncakeTierConfigError, match="cannot be read"):
        settings_from_params({})
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    no_mooncake_env.setenv("MOONCAKE_CONFIG_PATH", str(broken))
    with pytest.raises(MooncakeTierConfigError, match="is not valid JSON"):
        settings_from_params({})
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"local_hostname": LOOPBACK, "metadata_server": "P2PHANDSHAKE"}))
    no_mooncake_env.setenv("MOONCAKE_CONFIG_PATH", str(partial))
    with pytest.raises(MooncakeTierConfigError, match="master_server_address.*fix that field"):
        settings_from_params({})


def test_the_health_url_needs_a_host_port_master_or_an_explicit_url():
    with pytest.raises(MooncakeTierConfigError, match="set adapter_params.master_health_url"):
        settings_from_params({"mooncake": {**MOONCAKE, "master_server_address": "etcd://10.0.0.1:2379"}})
    explicit = settings_from_params(
        {"mooncake": {**MOONCAKE, "master_server_address": "etcd://x"}, "master_health_url": "http://m:1/health"}
    )
    assert explicit.health_url == "http://m:1/health"
    with pytest.raises(MooncakeTierConfigError, match=r"master_metrics_port must be the master's --metrics_port"):
        settings_from_params({"mooncake": MOONCAKE, "master_metrics_port": 70000})
    with pytest.raises(MooncakeTierConfigError, match=r"adapter_params\.call_timeout_seconds must be a number"):
        settings_from_params({"mooncake": MOONCAKE, "call_timeout_seconds": 0})


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, 256),
        ({"batch_max_objects": 64}, 64),
        ({"batch_max_objects": 1024, "num_io_threads": 1}, 1024),
        ({"batch_max_objects": 128, "num_io_threads": 8}, 128),
    ],
)
def test_a_call_moves_at_most_batch_max_objects(params, expected):
    assert settings_from_params({"mooncake": MOONCAKE, **params}).batch_max_objects == expected


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"batch_max_objects": 0}, r"batch_max_objects must be an int >= 1, got 0"),
        ({"batch_max_objects": "many"}, r"batch_max_objects must be an int >= 1, got 'many'"),
        ({"batch_max_objects": 512}, r"num_io_threads \(4\) x batch_max_objects \(512\) .* 4096 transfer parts"),
        ({"num_io_threads": 16}, r"num_io_threads \(16\) x batch_max_objects \(256\) .* lower one"),
    ],
)
def test_more_transfer_parts_in_flight_than_mooncake_survives_are_refused(params, message):
    with pytest.raises(MooncakeTierConfigError, match=message):
        settings_from_params({"mooncake": MOONCAKE, **params})


def test_the_adapter_refuses_an_unknown_parameter_listing_the_known_ones():
    with pytest.raises(
        MooncakeTierConfigError, match=r"unknown adapter_params \['capacity'\]; known: .*capacity_bytes"
    ):
        MooncakeL2Adapter({"mooncake": MOONCAKE, "capacity": 1})


# -- objects, batches, keys --------------------------------------------------------------------------------------------
def _sealed(payload: bytes, key: str = "prefix/key-a") -> bytearray:
    sealed = bytearray(HEADER.size + len(payload))
    seal_object(memoryview(sealed), memoryview(payload), key)
    return sealed


def test_an_object_is_served_only_when_header_and_checksum_match():
    payload = os.urandom(1000)
    assert bytes(open_object(memoryview(_sealed(payload)), "prefix/key-a")) == payload
    for position in (0, 10, HEADER.size - 1, HEADER.size, HEADER.size + 999):
        damaged = _sealed(payload)
        damaged[position] ^= 0x01
        assert open_object(memoryview(damaged), "prefix/key-a") is None, f"a flipped bit at byte {position} was served"
    assert open_object(memoryview(_sealed(payload))[:-1], "prefix/key-a") is None
    assert open_object(memoryview(_sealed(payload) + b"x"), "prefix/key-a") is None
    assert open_object(memoryview(bytearray(HEADER.size + 1000)), "prefix/key-a") is None
    unseeded = bytearray(encode_header(len(payload), xxhash.xxh3_64_intdigest(payload)) + payload)
    assert open_object(memoryview(unseeded), "prefix/key-a") is None


def test_an_intact_object_of_another_key_is_never_served():
    # Mooncake may evict an object during a read and reuse its memory for another key's object of the same size.
    payload = os.urandom(1000)
    assert open_object(memoryview(_sealed(payload, key="prefix/key-b")), "prefix/key-a") is None


@pytest.mark.parametrize(
    ("sizes", "max_items", "expected"),
    [
        ([], 8, []),
        ([4, 4, 4, 20, 1], 8, [([0, 1], 8), ([2], 4), ([3], 20), ([4], 1)]),
        ([10, 10], 8, [([0], 10), ([1], 10)]),
        ([1] * 5, 8, [([0, 1, 2, 3, 4], 5)]),
        ([1] * 5, 2, [([0, 1], 2), ([2, 3], 2), ([4], 1)]),  # the count ends a group before the size does
        ([1] * 4, 1, [([0], 1), ([1], 1), ([2], 1), ([3], 1)]),
        ([4, 4, 4, 1], 3, [([0, 1], 8), ([2, 3], 5)]),  # the size ends the first group, the count never does
    ],
)
def test_batches_stage_at_most_the_limit_and_the_object_count_unless_one_object_alone_exceeds_it(
    sizes, max_items, expected
):
    assert batch_groups(10, sizes, max_items) == expected


def test_distinct_object_keys_get_distinct_mooncake_keys():
    base = ObjectKey(chunk_hash=bytes(range(32)), model_name="org/model", kv_rank=7, object_group_id=0)
    variants = [
        base,
        ObjectKey(base.chunk_hash, "org/model##r3", 7, 0),
        ObjectKey(base.chunk_hash, "org/model", 8, 0),
        ObjectKey(base.chunk_hash, "org/model", 7, 1),
        ObjectKey(base.chunk_hash, "org/model", 7, 0, "salt"),
        ObjectKey(bytes(32), "org/model", 7, 0),
    ]
    names = [mooncake_key(key) for key in variants]
    assert len(set(names)) == len(variants)
    assert names[0] == "lmcache_r3/org/model@0@7@@" + bytes(range(32)).hex()
    assert mooncake_key(base, "other/") != names[0]


def test_codes_are_named():
    assert describe(-704) == "OBJECT_NOT_FOUND(-704)"
    assert describe(UNAVAILABLE).startswith("UNAVAILABLE")
    assert describe(-12345) == "MOONCAKE_ERROR(-12345)"


# -- no master ---------------------------------------------------------------------------------------------------------
def test_without_a_master_every_call_answers_unavailable_at_once():
    port = free_port()  # nothing listens there
    store = MooncakeObjectStore(
        settings_from_params(
            {
                "mooncake": {**MOONCAKE, "master_server_address": f"{LOOPBACK}:{free_port()}"},
                "master_metrics_port": port,
            }
        )
    )
    try:
        began = time.monotonic()
        assert store.exists(["a", "b"]) == [UNAVAILABLE, UNAVAILABLE]
        assert store.put(["a"], [memoryview(b"x")]) == [UNAVAILABLE]
        into = bytearray(4)
        assert store.get_into(["a"], [memoryview(into)]) == [UNAVAILABLE] and into == bytearray(4)
        answered: list = []
        store.exists_then(["a"], answered.append)
        assert store.put_then(["a"], [memoryview(b"x")], UNHELD, answered.append)
        assert store.get_then(["a"], [memoryview(into)], UNHELD, answered.append)
        assert answered == [[UNAVAILABLE]] * 3 and into == bytearray(4), "the callbacks were not answered at once"
        assert time.monotonic() - began < 0.5
        stats = store.stats()
        assert stats["state"] == "connecting" and "waiting for the master" in stats["reason"]
        assert stats["errors_by_code"] == {describe(UNAVAILABLE): 7}
    finally:
        store.close()


@pytest.mark.parametrize(
    ("params", "sizes", "answered_by_callback"),
    [
        ({}, [96 << 10] * 16, True),  # a batch of R3 objects: one staged call
        ({"inline_max_bytes": 0}, [96 << 10], False),  # off
        ({"inline_max_bytes": "1MB"}, [96 << 10] * 16, False),  # more than inline_max_bytes
        ({"batch_bytes": 1 << 20}, [600 << 10] * 2, False),  # two calls
        ({}, [], True),  # nothing to do: answered at once
    ],
)
def test_only_a_put_or_read_of_one_small_staged_call_is_answered_by_callback(params, sizes, answered_by_callback):
    master = {**MOONCAKE, "master_server_address": f"{LOOPBACK}:{free_port()}"}
    store = MooncakeObjectStore(
        settings_from_params({"mooncake": master, "master_metrics_port": free_port(), **params})
    )
    try:
        views = [memoryview(bytearray(size)) for size in sizes]
        keys = [f"k{i}" for i in range(len(sizes))]
        answered: list = []
        assert store.put_then(keys, views, UNHELD, answered.append) is answered_by_callback
        assert store.get_then(keys, views, UNHELD, answered.append) is answered_by_callback
        assert answered == ([[UNAVAILABLE] * len(sizes)] * 2 if answered_by_callback else [])
    finally:
        store.close()


def test_deadlines_run_in_time_order_and_those_left_run_at_close():
    deadlines = _Deadlines("test-deadlines", slack_s=0.01, idle_s=0.05)
    ran: list = []
    now = time.monotonic()
    for name, after in (("c", 0.30), ("a", 0.05), ("b", 0.15), ("later", 60.0)):
        deadlines.add(now + after, lambda closing, name=name: ran.append((name, closing)))
    time.sleep(0.6)
    assert ran == [("a", False), ("b", False), ("c", False)]
    deadlines.close()
    deadlines.add(time.monotonic() + 60, lambda closing: ran.append(("after close", closing)))
    assert ran[3:] == [("later", True), ("after close", True)]


def test_a_deadline_runs_no_earlier_than_its_time():
    deadlines = _Deadlines("test-deadlines", slack_s=0.01, idle_s=1.0)
    ran = []
    due = time.monotonic() + 0.2
    deadlines.add(due, lambda closing: ran.append(time.monotonic()))
    time.sleep(0.5)
    deadlines.close()
    assert len(ran) == 1 and due <= ran[0] < due + 0.2, "a deadline ran early, or late past its slack and a margin"


def test_an_adapter_without_a_master_starts_unhealthy_and_answers_lookups_with_misses():
    adapter = MooncakeL2Adapter(
        {"mooncake": {**MOONCAKE, "master_server_address": f"{LOOPBACK}:{free_port()}"}, "master_metrics_port": 1}
    )
    try:
        status = adapter.report_status()
        assert not status["is_healthy"] and status["state"] == "connecting"
        task = adapter.submit_lookup_and_lock_task([ObjectKey(bytes(32), "m", 0, 0)], {})
        deadline = time.monotonic() + 1
        while (hits := adapter.query_lookup_and_lock_result(task)) is None:
            assert time.monotonic() < deadline, "a lookup waited on a missing master"
            time.sleep(0.01)
        assert hits.popcount() == 0
    finally:
        adapter.close()


@pytest.mark.parametrize(
    ("prefix", "pattern"),
    [
        ("lmcache_r3/", "^lmcache_r3/"),
        ("team.a/", r"^team\.a/"),
        ("run-7@x/", "^run-7@x/"),  # '-' and '@' mean nothing outside a bracket: left as they are
        ("a(b)[c]{d}|e", r"^a\(b\)\[c\]\{d\}\|e"),
        ("^$*+?\\", r"^\^\$\*\+\?\\"),
    ],
)
def test_a_clear_removes_exactly_the_keys_under_the_prefix(prefix, pattern):
    import re

    assert prefix_pattern(prefix) == pattern
    compiled = re.compile(pattern)  # Python's grammar agrees with ECMAScript on these escapes
    assert compiled.match(prefix + "model@0@0@@ab") and not compiled.match("x" + prefix)
