"""A real Mooncake master + holder on loopback serves put/get across processes."""

import os
import uuid

import pytest

pytestmark = pytest.mark.mooncake


def test_put_then_get_returns_the_same_mebibyte(mooncake_store):
    key, value = f"smoke-{uuid.uuid4().hex}", os.urandom(1 << 20)
    assert mooncake_store.put(key, value) == 0
    assert mooncake_store.is_exist(key) == 1
    assert mooncake_store.get_size(key) == len(value)
    assert mooncake_store.get(key) == value


def test_object_outlives_the_client_that_wrote_it(mooncake_cluster):
    key, value = f"holder-{uuid.uuid4().hex}", os.urandom(64 << 10)
    writer = mooncake_cluster.client()
    assert writer.put(key, value) == 0
    writer.close()
    reader = mooncake_cluster.client()
    try:
        assert reader.get(key) == value
    finally:
        reader.close()


def test_missing_key_is_reported_as_missing_not_as_data(mooncake_store):
    key = f"absent-{uuid.uuid4().hex}"
    assert mooncake_store.is_exist(key) == 0
    assert mooncake_store.get_size(key) < 0
