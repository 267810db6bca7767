"""R3 stores read from the slot mirror and not yet sent: when they go out, and merged per request.

Every R3 call costs the engine core and the LMCache server a fixed amount of work (a message, a hand-off to the
client's sending thread, a handler in the server), so the scheduler sends the R3 of many requests and steps in
one ``store_many`` call. How long a store may wait depends on who could use it:

* a chunk of **prompt** tokens only can serve another request at once (a rollout group's other samples on
  another engine, the same prompt sent again): it waits at most ``batch_steps`` reported engine steps;
* a chunk holding tokens the request **generated** (the one the prompt ends in, too: its key hashes every token
  up to its end) can serve only a request whose prompt holds them, which exists once this one has ended (the
  next turn of a conversation, a partial rollout resumed), or this request itself after a preemption: it waits
  until the request ends or is preempted (:meth:`UnsentStores.flush_for`);
* whatever waits, at most ``max_nbytes`` of objects and token ids are held: past that, everything goes.

The stores of one request follow each other (each starts where the previous one ended), so while they wait they
are merged into one: one store of ``[first start, last end)`` with the latest token ids, instead of one item per
chunk, each with its own copy of the prefix. Engine-free and server-free: testable on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_r3.mp.r3_client import StoreSpec

TOKEN_ID_BYTES = 8
"""What one held token id is counted as (a reference in a Python list; on the wire, msgspec's integers)."""


@dataclass
class _Unsent:
    request_id: str
    tokens: Sequence[int]
    start: int
    parts: list[bytes]
    end: int
    salt: str

    def spec(self) -> StoreSpec:
        return self.tokens, self.start, b"".join(self.parts), self.end, self.salt  # one part: joined without a copy


class UnsentStores:
    """The unsent R3 stores of a scheduler (see the module docstring).

    Args:
        batch_steps: reported engine steps a store of prompt tokens may wait; 0: no store waits at all (every
            step's stores go out in that step, generated tokens' too).
        max_nbytes: objects and token ids held, past which every store goes out.
    """

    def __init__(self, batch_steps: int, max_nbytes: int = 8 << 20) -> None:
        self.batch_steps = batch_steps
        self.max_nbytes = max_nbytes
        self._items: list[_Unsent] = []
        self._last: dict[str, _Unsent] = {}
        """Per request, its latest unsent store (the one a following store merges into)."""
        self._prompt_since: int | None = None
        """The reported step when the oldest unsent store holding prompt tokens was added."""
        self._flush_ids: set[str] = set()
        """Requests that ended or were preempted since the last :meth:`due` check."""
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, request_id: str, item: StoreSpec, prompt_chunks: bool, reported: int) -> None:
        """Hold one store of ``request_id``, read after engine step ``reported`` had reported its rows.

        Args:
            item: ``(token_ids, start, objects, end, cache_salt)``; ``token_ids`` is not copied.
            prompt_chunks: whether its first chunk holds prompt tokens only (see the module docstring).
        """
        tokens, start, objects, end, salt = item
        last = self._last.get(request_id)
        if last is not None and last.end == start and last.salt == salt:
            self.nbytes += TOKEN_ID_BYTES * (len(tokens) - len(last.tokens)) + len(objects)
            last.tokens, last.end = tokens, end
            last.parts.append(objects)
        else:
            last = _Unsent(request_id, tokens, start, [objects], end, salt)
            self._items.append(last)
            self._last[request_id] = last
            self.nbytes += TOKEN_ID_BYTES * len(tokens) + len(objects)
        if prompt_chunks and self._prompt_since is None:
            self._prompt_since = reported

    def flush_for(self, request_id: str) -> None:
        """The request ended or was preempted: if a store of it is held at the next :meth:`due` check (its last
        chunks may be read after this call, in the same engine step), everything held goes out then."""
        self._flush_ids.add(request_id)

    def due(self, reported: int) -> bool:
        """Whether the held stores go out now, the latest reported step being ``reported``."""
        flushed = False
        if self._flush_ids:  # most steps: nobody ended
            flushed = not self._flush_ids.isdisjoint(self._last)
            self._flush_ids.clear()
        if not self._items:
            return False
        if flushed or self.batch_steps == 0 or self.nbytes >= self.max_nbytes:
            return True
        return self._prompt_since is not None and reported - self._prompt_since >= self.batch_steps

    def take(self) -> tuple[list[StoreSpec], tuple[str, ...]]:
        """Every held store (merged per request) and the requests they belong to, in the order they were held."""
        items, self._items, self._last = self._items, [], {}
        self._prompt_since, self.nbytes = None, 0
        return [item.spec() for item in items], tuple(item.request_id for item in items)
