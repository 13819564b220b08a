"""The streamed outfeed: each step's results reach the host while the execution runs.

A program built with a `StepStream` sends its steps' outputs to the host
from inside its on-device loop, a chunk of consecutive steps at a time (an
unordered host callback: each replica's chunks still arrive in order, since
its loop runs them in order). The device holds a chunk's results until it is
complete, so the chunk length is the outfeed's buffer depth: the number of
steps of results the device holds before the host must take them. A host
callback costs about 100 µs on XLA:CPU (measured in BENCHMARKS.md), so by
default a chunk is about a fifth of an execution. The host takes the steps
from `chunks()`, each chunk with every replica's values, while the device
goes on; the device waits when the host falls two chunks behind. `mute()`
makes the device drop what it sends (nobody listens, or the host gave up
after an error), so a running execution never waits on a host that stopped
reading.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

_POLL_S = 0.05
# The replica of a chunk that holds every replica's values (`send_replicated`).
_ALL_REPLICAS = -1
# Chunks sent but not yet taken by the host, per replica, before the device waits.
_CHUNKS_AHEAD = 2
# Without a buffer depth, an execution sends about this many chunks.
_DEFAULT_CHUNKS = 5


class StreamBroken(RuntimeError):
    """An execution ended without sending every step it owed the host."""


class StepStream:
    """The host end of a streamed outfeed.

    Args:
        replicas: Replicas that send each step.
        buffer_depth: Steps of results the device holds before sending them
            (the chunk length, at most; it divides the execution's steps).
            `None`: about a fifth of an execution.

    Example:

    >>> stream = StepStream(replicas=2, buffer_depth=4)
    >>> stream.chunk_length(16)
    4
    >>> # inside the program's loop (traced), after each chunk of 4 steps:
    >>> #   stream.emit(replica_index, chunk_outputs)
    >>> for per_replica in stream.chunks(16, finished=lambda: outfeed.is_ready()):
    ...     handle(per_replica)  # each replica's outputs of the chunk's steps
    """

    def __init__(self, replicas: int, buffer_depth: int | None = None):
        self.replicas = replicas
        self.buffer_depth = buffer_depth
        self._queue: queue.Queue = queue.Queue(maxsize=_CHUNKS_AHEAD * replicas)
        self._muted = threading.Event()
        self._layouts: list[_PackedLayout] = []

    def chunk_length(self, steps: int) -> int:
        """Steps per chunk for `steps` steps: their largest divisor within the depth."""
        depth = self.buffer_depth or max(1, steps // _DEFAULT_CHUNKS)
        return max(d for d in range(1, min(depth, steps) + 1) if steps % d == 0)

    def emit(self, replica: Any, values: Any) -> None:
        """Inside a traced program: sends `values` (one replica's chunk) to the host.

        The values travel packed into one byte vector: a host callback
        converts each argument to a device array first (about 45 µs each on
        XLA:CPU), so one argument costs least.
        """
        layout = _PackedLayout.of(values)
        if layout not in self._layouts:
            self._layouts.append(layout)
        header = jnp.stack([jnp.int32(self._layouts.index(layout)),
                            jnp.asarray(replica, jnp.int32)])
        packed = jnp.concatenate([_bytes(header), *map(_bytes, jax.tree_util.tree_leaves(values))])
        io_callback(self._receive, None, packed, ordered=False)

    def _receive(self, packed: Any) -> None:
        """The host callback: unpacks a chunk and queues it."""
        if self._muted.is_set():
            return
        data = np.asarray(packed)
        layout_index, replica = data[:_HEADER_BYTES].view(np.int32)
        self.send(int(replica), self._layouts[layout_index].unpack(data[_HEADER_BYTES:]))

    def send_replicated(self, values: Any) -> None:
        """Queues every replica's chunk at once: arrays `[steps, replicas, ...]`, maybe not ready.

        For programs the host dispatches a chunk at a time: the reader waits
        for the arrays, not the dispatching thread.
        """
        self.send(_ALL_REPLICAS, values)

    def send(self, replica: int, values: Any) -> None:
        """Queues one replica's chunk for the host (waits while the host is behind)."""
        entry = (replica, values)
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
            if replica == _ALL_REPLICAS:
                values = jax.tree_util.tree_map(np.asarray, values)
                for r, replica_chunks in enumerate(pending):
                    replica_chunks.append(jax.tree_util.tree_map(lambda a, r=r: a[:, r], values))
            else:
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



_HEADER_BYTES = 8  # layout index and replica, two int32


@dataclasses.dataclass(frozen=True)
class _PackedLayout:
    """Where each array of a packed chunk lies in its bytes."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) per leaf

    @classmethod
    def of(cls, values: Any) -> _PackedLayout:
        leaves, treedef = jax.tree_util.tree_flatten(values)
        return cls(treedef, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves))

    def unpack(self, data: np.ndarray) -> Any:
        arrays, offset = [], 0
        for shape, dtype in self.leaves:
            stored = np.dtype("uint8") if dtype == "bool" else np.dtype(dtype)
            count = int(np.prod(shape))
            array = np.frombuffer(data, stored, count, offset).reshape(shape)
            arrays.append(array.astype(bool) if dtype == "bool" else array)
            offset += count * stored.itemsize
        return self.treedef.unflatten(arrays)


def _bytes(array: Any) -> Any:
    """A traced array's bytes, flat (`uint8`)."""
    array = jnp.asarray(array)
    if array.dtype == jnp.bool_:
        array = array.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(array, jnp.uint8).reshape(-1)


def _length(tree: Any) -> int:
    """Steps in a chunk: the leading axis of its arrays."""
    return int(jax.tree_util.tree_leaves(tree)[0].shape[0])
