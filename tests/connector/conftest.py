"""Fixtures shared by the connector tests: one LMCache server per module and server variant, with an fs L2 tier
whose files a test can scan for null-block bytes."""

import os

import pytest

from tests.support.harness import NULL_SENTINEL

CHUNK = 64
SENTINEL_RUN = bytes([NULL_SENTINEL]) * 256
"""Model or random KV bytes never hold such a run; the null page is made of it."""


@pytest.fixture(params=["default-flags", "separate-object-groups"], scope="module")
def hybrid_server(request, lmcache_server_factory, tmp_path_factory):
    """``(server, separate_object_groups, l2_dir)``: chunk 64, an fs L2 tier, with or without the flag."""
    separate = request.param == "separate-object-groups"
    l2 = tmp_path_factory.mktemp(f"l2-{request.param}")
    server = lmcache_server_factory(
        chunk_size=CHUNK,
        l2_adapters=({"type": "fs", "base_path": str(l2)},),
        extra_args=("--separate-object-groups",) if separate else (),
    )
    return server, separate, l2


def tier_files(l2) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(l2) for name in names]


def files_holding(l2, run: bytes) -> list[str]:
    """Stored objects (files of the fs tier) that contain ``run``."""
    found = []
    for path in tier_files(l2):
        with open(path, "rb") as file:
            if run in file.read():
                found.append(path)
    return found


def files_holding_the_null_page(l2) -> list[str]:
    """Stored objects (files of the fs tier) that contain a run of null-block sentinel bytes."""
    return files_holding(l2, SENTINEL_RUN)
