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

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Holds back SIGINT inside the block; one that arrived is handled as the block ends.

    Example:

    >>> with deferred():
    ...     state = run(state)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGINT)
    except ValueError:  # no signal handling here
        yield
        return
    arrived: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: arrived.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if arrived and callable(previous):
        previous(*arrived[0])  # the default handler raises KeyboardInterrupt here
    elif arrived and previous == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)
