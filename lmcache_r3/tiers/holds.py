"""Holds on a caller's buffers: a tier touches LMCache's memory only while it holds it.

A tier's task copies between LMCache's L1 buffers and the tier. LMCache may reuse those buffers as soon as the task
is reported failed (the tier adapter's watchdog fails a task that runs too long), so every copy into or out of them,
and every checksum over them, runs under a *hold*: :meth:`CallerBuffers.hold` refuses once the task was failed or
ran past its timeout, and while any hold is taken the watchdog leaves the task alone. A copy is bounded (memory and
tmpfs do not stall), so the holds in progress delay a failure by at most their copies; a transfer that cannot be
stopped (Mooncake's direct reads) holds until it returns or its own bound passes.

:data:`UNHELD` is for a store used outside LMCache (tests, benchmarks): its holds are always granted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["UNHELD", "BuffersGone", "CallerBuffers"]


class BuffersGone(Exception):
    """A hold was refused: the task was failed and its buffers are LMCache's again (nothing was touched)."""


class CallerBuffers:
    """The buffers of one task; this base grants every hold (nothing can fail the task)."""

    def cancelled(self) -> bool:
        """Whether the task was failed: touch none of its buffers any more."""
        return False

    def hold(self) -> bool:
        """Take a hold (the task cannot be failed until :meth:`release`); False, and nothing held, once it was
        failed or ran past its timeout."""
        return True

    def release(self) -> None:
        """Give back one hold taken by :meth:`hold`."""

    @contextmanager
    def held(self) -> Iterator[None]:
        """``with buffers.held():`` touch the buffers inside; raises :class:`BuffersGone` when the hold is refused."""
        if not self.hold():
            raise BuffersGone("the task was failed; its buffers are no longer the tier's to touch")
        try:
            yield
        finally:
            self.release()


UNHELD = CallerBuffers()
