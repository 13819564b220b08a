"""The streamed outfeed: each step's results reach the host while the execution runs.

A program built with a `StepStream` sends its steps' outputs to the host
from inside its on-device loop, a chunk of consecutive steps at a time (an
unordered host callback: each replica's chunks still arrive in order, since
its loop runs them in order). The device holds a chunk's results until it is
complete, so the chunk length is the outfeed's buffer depth: the number of
steps of results the device holds before the host must take them. A host
callback costs about 100 µs on XLA:CPU (measured in BENCHMARKS.md), so by
default a chunk is about a tenth of an execution. The host takes the steps
from `chunks()`, each chunk with every replica's values, while the device
goes on; the device waits when the host falls two chunks behind. `mute()`
makes the device drop what it sends (nobody listens, or the host gave up
after an error), so a running execution never waits on a host that stopped
reading.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

_POLL_S = 0.05
# Chunks sent but not yet taken by the host, per replica, before the device waits.
_CHUNKS_AHEAD = 2
# Without a buffer depth, an execution sends about this many chunks.
_DEFAULT_CHUNKS = 10


class StreamBroken(RuntimeError):
    """An execution ended without sending every step it owed the host."""


class StepStream:
    """The host end of a streamed outfeed.

    Args:
        replicas: Replicas that send each step.
        buffer_depth: Steps of results the device holds before sending them
            (the chunk length, at most; it divides the execution's steps).
            `None`: about a tenth of an execution.

    Example:

    >>> stream = StepStream(replicas=2, buffer_depth=4)
    >>> stream.chunk_length(16)
    4
    >>> # inside the program's loop, after each chunk of 4 steps:
    >>> #   io_callback(stream.send, None, replica_index, chunk_outputs)
    >>> for per_replica in stream.chunks(16, finished=lambda: outfeed.is_ready()):
    ...     handle(per_replica)  # each replica's outputs of the chunk's steps
    """

    def __init__(self, replicas: int, buffer_depth: int | None = None):
        self.replicas = replicas
        self.buffer_depth = buffer_depth
        self._queue: queue.Queue = queue.Queue(maxsize=_CHUNKS_AHEAD * replicas)
        self._muted = threading.Event()

    def chunk_length(self, steps: int) -> int:
        """Steps per chunk for `steps` steps: their largest divisor within the depth."""
        depth = self.buffer_depth or max(1, steps // _DEFAULT_CHUNKS)
        return max(d for d in range(1, min(depth, steps) + 1) if steps % d == 0)

    def send(self, replica: Any, values: Any) -> None:
        """Called by the device (a host callback thread) with one chunk of one replica."""
        entry = (int(replica), values)
        while not self._muted.is_set():
            try:
                self._queue.put(entry, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def chunks(self, count: int, finished: Callable[[], bool]) -> Iterator[list[Any]]:
        """The next chunks, `count` steps in all, each as its replicas' values in replica order.

        Each replica's values have a leading axis of the chunk's steps.

        Args:
            count: Steps to take.
            finished: Whether the execution that sends them has ended; a
                stream still short of steps after that is broken.

        The steps end early when the stream is muted (the run stopped).

        Raises:
            StreamBroken: When the execution ended without sending them all
                (it failed on the device).
        """
        pending = [collections.deque() for _ in range(self.replicas)]
        taken = 0
        while taken < count:
            try:
                replica, values = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._muted.is_set():
                    return
                if finished() and self._queue.empty():
                    raise StreamBroken(
                        f"The execution ended after sending {taken} of its {count} steps."
                    ) from None
                continue
            pending[replica].append(values)
            while taken < count and all(pending):
                chunk = [replica_chunks.popleft() for replica_chunks in pending]
                taken += _length(chunk[0])
                yield chunk

    def mute(self) -> None:
        """From now on the device's steps are dropped (and none waits for room)."""
        self._muted.set()
        self.clear()

    def unmute(self) -> None:
        """Steps are kept again (call when no execution that sends is running)."""
        self.clear()
        self._muted.clear()

    def clear(self) -> None:
        """Drops the steps the host has not taken."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return



def _length(tree: Any) -> int:
    """Steps in a chunk: the leading axis of its arrays."""
    return int(jax.tree_util.tree_leaves(tree)[0].shape[0])
