"""Random prompts for randomized schedules: fresh ones, and prefixes of earlier ones with fresh suffixes."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Drawn(Protocol):
    """A request drawn earlier in a schedule: its id and prompt."""

    rid: str
    prompt: list[int]


def seeded_prompt(length: int, seed: int) -> list[int]:
    """``length`` tokens in [10, 900), the same for the same seed."""
    return [int(t) for t in np.random.default_rng(seed).integers(10, 900, size=length)]


def fresh_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def draw_prompt(
    rng: random.Random, earlier: Sequence[Drawn], chunk: int, block: int, max_len: int
) -> tuple[list[int], str]:
    """A fresh prompt, or a prefix of an earlier one (``chunk``-, ``block``- or un-aligned) plus a fresh suffix;
    with where it came from, for a failure's description."""
    if not earlier or rng.random() < 0.35:
        return fresh_tokens(rng, rng.randint(16, max_len)), "fresh"
    source = rng.choice(earlier)
    n = min(len(source.prompt), max_len)
    kind = rng.random()
    if kind < 0.35 and n >= chunk:
        k = chunk * rng.randint(1, n // chunk)
    elif kind < 0.6 and n >= block:
        k = block * rng.randint(1, n // block)
        k = k + block if k % chunk == 0 and k + block <= n else k
    else:
        k = rng.randint(1, n)
    suffix = min(0 if rng.random() < 0.15 else rng.randint(1, 120), max_len - k)
    origin = f"{source.rid}[:{k}] + {suffix} fresh" if k < len(source.prompt) or suffix else f"repeat of {source.rid}"
    return source.prompt[:k] + fresh_tokens(rng, suffix), origin
