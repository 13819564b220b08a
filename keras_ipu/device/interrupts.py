"""Ctrl-C (SIGINT) held back for a few statements that must not be cut in two.

An execution consumes (donates) the state it is given and returns the next
one: a `KeyboardInterrupt` between the two, after the old buffers are gone
and before the new state is kept, would lose the weights. Inside
`deferred()` an interrupt is recorded and raised as the block ends, once the
new state is kept. Only the main thread receives signals; elsewhere the
block runs as it is.

Example:

```python
with interrupts.deferred():
    new_state, outfeed = execute(state, batches)
    keep(new_state)
```
"""

from __future__ import annotations

# signal's C module: `signal.signal` converts handlers to and from enums at
# every call (tens of microseconds per execution at steps_per_execution=1).
import _signal
import signal
import threading
from typing import Any


class deferred:  # noqa: N801 - used as a function: `with deferred():`
    """Holds back SIGINT inside the block; one that arrived is handled as the block ends.

    Args:
        second_raises: Whether a second SIGINT inside the block raises
            `KeyboardInterrupt` at once (for a long block, such as loading
            a program: a user who presses Ctrl-C again wants out now).

    Example:

    >>> with deferred():
    ...     state = run(state)
    """

    __slots__ = ("_arrived", "_previous", "_second_raises")

    def __init__(self, second_raises: bool = False):
        self._second_raises = second_raises

    def __enter__(self) -> None:
        self._previous = None
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            previous = _signal.getsignal(signal.SIGINT)
        except ValueError:  # no signal handling here
            return
        if previous is None:  # a handler not set from Python: it cannot be put back
            return
        self._previous, self._arrived = previous, []
        _signal.signal(signal.SIGINT, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        if self._arrived and self._second_raises:
            self._arrived.clear()  # raised here: not again as the block ends
            raise KeyboardInterrupt
        self._arrived.append((signum, frame))

    def __exit__(self, *exc_info: Any) -> None:
        previous = self._previous
        if previous is None:
            return
        _signal.signal(signal.SIGINT, previous)
        if self._arrived and callable(previous):
            previous(*self._arrived[0])  # the default handler raises KeyboardInterrupt here
        elif self._arrived and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)
