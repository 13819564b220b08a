"""The infeed: a host thread that moves the next executions' data onto the device.

While the device runs execution k, the thread prepares the host data of
execution k+1 and copies it to the IPU's device, so the host work and the
transfer overlap with the device's work.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax

_DONE = object()
_CLOSE_TIMEOUT_S = 10.0


class Infeed:
    """Iterates `source` on a background thread, `depth` items ahead.

    Args:
        source: An iterable of items; it is iterated on the thread.
        place: Applied to each item on the thread, e.g. a copy to a device.
        depth: Items prepared ahead of the consumer, at most.
        threaded: With `False`, items are prepared in the consumer's thread
            when it asks for them. For sources whose items cost less to make
            than a thread hand-over (a slice of an in-memory array: about
            15 µs against 50-70 µs of GIL hand-over per item, measured), this
            is faster; the device still runs ahead, since executions are
            dispatched asynchronously.
        first_inline: The first item is prepared in the caller's thread when
            the infeed opens, and the thread starts when the consumer asks
            for the second. For an infeed opened ahead of other host work (a
            run's setup): its first item is ready without a thread to start
            or hand the GIL over to, before that work or the first
            execution's dispatch. Ignored with `threaded=False`.
        stop: The event `close` sets (the source may ask it between the
            parts of an item); a new one by default.

    An exception raised by `source` or `place` is re-raised to the consumer
    at the item where it happened.

    Example:

    >>> with Infeed(batches, lambda b: jax.device_put(b, device)) as infeed:
    ...     for batch in infeed:
    ...         state, outfeed = program(state, batch)
    """

    def __init__(
        self,
        source: Iterable[Any],
        place: Callable[[Any], Any] = lambda item: item,
        depth: int = 2,
        threaded: bool = True,
        first_inline: bool = False,
        stop: threading.Event | None = None,
    ):
        self._queue: queue.Queue = queue.Queue()
        # An item is prepared only with a slot, which the consumer frees when it takes
        # one: at most `depth` items wait or are being prepared, not one more held back.
        self._slots = threading.Semaphore(depth)
        self._stop = stop if stop is not None else threading.Event()
        self._inline = None if threaded else map(place, source)
        self._first: tuple[bool, Any] | None = None
        self._start_later = False
        if threaded and first_inline:
            source = iter(source)
            self._first = self._prepared(source, place)
        self._thread = threading.Thread(
            target=self._produce, args=(source, place), name="keras_ipu-infeed", daemon=True
        )
        if threaded and not first_inline:
            try:
                self._thread.start()
            except BaseException:
                # A Ctrl-C while it started: nobody gets this object to close it, and
                # the thread may be running (inside its source): it is stopped here.
                self.close()
                raise

    @staticmethod
    def _prepared(source: Iterator[Any], place: Callable[[Any], Any]) -> tuple[bool, Any]:
        """The queue entry of the source's next item, prepared here."""
        try:
            return True, place(next(source))
        except StopIteration:
            return True, _DONE
        except Exception as error:  # handed to the consumer at its first item
            return False, error

    def _produce(self, source: Iterable[Any], place: Callable[[Any], Any]) -> None:
        try:
            items = iter(source)
            while self._slot():
                try:
                    item = next(items)
                except StopIteration:
                    break
                if self._stop.is_set():
                    return
                self._queue.put((True, place(item)))
            else:
                return  # stopped
        except BaseException as error:  # handed to the consumer
            self._queue.put((False, error))
            return
        self._queue.put((True, _DONE))

    def _slot(self) -> bool:
        """Waits for a free slot; False once the infeed is closed."""
        while not self._stop.is_set():
            if self._slots.acquire(timeout=0.1):
                return True
        return False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._inline is not None:
            return next(self._inline)
        if self._first is not None:
            (ok, item), self._first = self._first, None
            # The rest starts when asked for: a thread started now would contend
            # for the GIL with the consumer's use of this item (its dispatch).
            self._start_later = ok and item is not _DONE
        else:
            if self._start_later:
                self._start_later = False
                self._thread.start()
            ok, item = self._queue.get()
            self._slots.release()
        if not ok:
            raise item
        if item is _DONE:
            raise StopIteration
        return item

    def close(self) -> None:
        """Stops the thread and drops what it prepared."""
        self._stop.set()
        # An unread first item (opened ahead of a run that never ran) holds device buffers.
        self._first, self._start_later = None, False
        # A source blocked inside its own iteration cannot be interrupted;
        # the daemon thread is then left to finish on its own.
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass

    def __enter__(self) -> Infeed:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def to_device(device: jax.Device) -> Callable[[Any], Any]:
    """A `place` function that copies an item's arrays to `device`."""
    return lambda tree: jax.device_put(tree, device)
