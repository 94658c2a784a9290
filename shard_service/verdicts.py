"""The optimizer steps' verdicts (step items) a stage took and passed down, so that each is taken once and the last
ones go again over a new link to the next stage.

Why: a verdict lost with a broken link left the step applied on the stages before the break and on none after
it, for good. Sent again, the stages after apply it (or refuse it) as they would have.
"""

from __future__ import annotations

import collections

from shardtrain.v1 import shard_pb2

VERDICTS_KEPT = 4  # step items passed down, sent again over a new link to the next stage (a step settles before
                   # the forward after it runs, and the SDK runs at most one step ahead: the last one or two matter)


class Verdicts:
    """The optimizer steps whose verdict a stage took, and the last verdicts it passed down."""

    def __init__(self) -> None:
        self.last = 0                      # the highest optimizer step whose verdict came
        self._taken: set[int] = set()      # recent optimizer steps whose verdict came
        self._taken_up_to = 0              # and every one up to this
        self._passed: collections.deque[shard_pb2.LinkMessage] = collections.deque(maxlen=VERDICTS_KEPT)

    def take(self, number: int) -> bool:
        """Records that optimizer step `number`'s verdict came; False if it had come before."""
        if number <= self._taken_up_to or number in self._taken:
            return False
        self._taken.add(number)
        self.last = max(self.last, number)
        if len(self._taken) > 4 * VERDICTS_KEPT:
            oldest = min(self._taken)
            self._taken.discard(oldest)
            self._taken_up_to = oldest
        return True

    def passed_down(self, verdict: shard_pb2.LinkMessage) -> None:
        """Keeps a verdict passed to the next stage (the last VERDICTS_KEPT)."""
        self._passed.append(verdict)

    @property
    def passed(self) -> list[shard_pb2.LinkMessage]:
        """The last verdicts passed down, oldest first."""
        return list(self._passed)
