"""The caller's context on the threads a run starts: user code there sees what it would
see on the thread of `fit`.

Plain Keras reads a generator or a `PyDataset` and calls the batch hooks on the
thread that called `fit`. keras_ipu reads them on its infeed thread and calls
asynchronous batch hooks on a thread of their own, where user code must find
what it would find on the caller's: the active strategy scope (context
variables) and Keras' global state, which Keras keeps per thread: the global
seed generator that unseeded `keras.random` calls draw from (seeded by
`keras.utils.set_random_seed`), the dtype policy, custom objects, layer names.
Keras' scopes of one call (name scopes, stateless and symbolic scopes) stay the
thread's own.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from keras.src.backend.common import global_state

# Keras' per-thread attributes that are the program's ambient state, not one call's.
CARRIED_KERAS_STATE = (
    "global_random_seed",
    "global_seed_generator",
    "dtype_policy",
    "custom_objects_scope_dict",
    "safe_mode_saving",
    "object_name_uids",
    "nnx_enabled",
)


class CallersState:
    """The calling thread's context, to run functions in on another thread.

    Made on the caller's thread. Each `run` first gives its thread the
    caller's Keras state (the same objects: a draw from the global seed
    generator advances the caller's), and hands back what the function set
    (a seed generator made by a first unseeded draw, a new dtype policy), as
    if the function had run on the caller's thread.

    Example:

    >>> state = CallersState()          # on the thread of `fit`
    >>> batch = state.run(next, source)  # on the infeed thread
    """

    def __init__(self):
        self._context = contextvars.copy_context()
        # The caller thread's own attribute dict: read and written from the other.
        self._keras = vars(global_state.GLOBAL_STATE_TRACKER)

    def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """Calls `function(*args)` as the caller's thread would.

        Args:
            function: What to call (a hook's delivery, a source's `next`).
            *args: Its arguments.

        Returns:
            What `function` returned.

        Raises:
            Exception: Whatever `function` raised.
        """
        own = vars(global_state.GLOBAL_STATE_TRACKER)
        if own is self._keras:  # on the caller's thread
            return self._context.run(function, *args)
        for key in CARRIED_KERAS_STATE:
            if key in self._keras:
                own[key] = self._keras[key]
            else:
                own.pop(key, None)
        given = {key: own.get(key) for key in CARRIED_KERAS_STATE}
        try:
            return self._context.run(function, *args)
        finally:
            # Only what the function set: the caller may have set others meanwhile.
            for key in CARRIED_KERAS_STATE:
                if own.get(key) is not given[key]:
                    self._keras[key] = own.get(key)


def read_as_caller(items: Any) -> Iterator[Any]:
    """Iterates `items`, each item read as the thread that calls this would read it.

    Args:
        items: An iterable (a feed's executions, which run user code).

    Returns:
        An iterator over the items, for another thread to read.

    Example:

    >>> infeed_source = read_as_caller(feed.executions(stop.is_set))
    """
    return _read(CallersState(), iter(items))  # the state is taken here, on the caller's


def _read(state: CallersState, iterator: Iterator[Any]) -> Iterator[Any]:
    while True:
        try:
            item = state.run(next, iterator)
        except StopIteration:
            return
        yield item


__all__ = ["CARRIED_KERAS_STATE", "CallersState", "read_as_caller"]
