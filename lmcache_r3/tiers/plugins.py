"""lmcache_r3's tiers by name in ``LMCACHE_CONFIG_FILE``: ``{type: shm, ...}`` becomes LMCache's plugin adapter spec.

    tiers:
      - type: shm
        root: /dev/shm/lmcache_r3
        capacity_bytes: 8589934592
        ttl_seconds: 3600

becomes ``--l2-adapter '{"type": "plugin", "module_path": "lmcache_r3.tiers.shm_adapter", "class_name":
"ShmL2Adapter", "adapter_params": {"root": ..., "capacity_bytes": ..., "ttl_seconds": ...}}'``. Every other key
of the entry is an adapter parameter, except the keys LMCache reads for any adapter (``eviction``,
``affinity_tag``, ``shared``, ``persist_enabled``, ``serde``), which stay beside ``type``. Stock LMCache adapter
types (``fs``, ``resp``, ``plugin``, ...) pass through unchanged.
"""

from __future__ import annotations

from typing import Any

PLUGINS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "shm": ("lmcache_r3.tiers.shm_adapter", "ShmL2Adapter", ("root", "capacity_bytes")),
    "mooncake": ("lmcache_r3.tiers.mooncake_adapter", "MooncakeL2Adapter", ()),  # or MOONCAKE_CONFIG_PATH
}
"""Tier type -> (module, adapter class, required parameters)."""

_BESIDE_TYPE = ("eviction", "affinity_tag", "shared", "persist_enabled", "serde")
"""Keys LMCache 0.5.6 reads beside ``type`` for every adapter (``L2AdapterConfigBase``), not adapter parameters."""


def required_parameters(kind: str) -> tuple[str, ...]:
    """The parameters a tier of ``kind`` must have (none for stock LMCache types)."""
    return PLUGINS[kind][2] if kind in PLUGINS else ()


def l2_adapter_spec(tier: dict[str, Any]) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON object of one ``tiers`` entry."""
    kind = tier.get("type")
    if kind not in PLUGINS:
        return dict(tier)
    module_path, class_name, _ = PLUGINS[kind]
    spec: dict[str, Any] = {"type": "plugin", "module_path": module_path, "class_name": class_name}
    spec.update({key: tier[key] for key in _BESIDE_TYPE if key in tier})
    spec["adapter_params"] = {key: value for key, value in tier.items() if key != "type" and key not in _BESIDE_TYPE}
    return spec
