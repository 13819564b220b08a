"""Tracebacks that show the user's frames, as Keras' own training methods' do.

Keras filters its internal frames out of the exceptions its `fit`,
`evaluate` and `predict` raise (`keras.config.is_traceback_filtering_enabled`).
An IPU model's runs go through keras_ipu, whose frames are as little
actionable: they are filtered out with Keras' own.
"""

from __future__ import annotations

import functools
import os
import traceback
import types
from collections.abc import Callable
from typing import Any

import keras

# keras_ipu's folder and Keras' internals (`keras/src`, as Keras filters).
_HIDDEN = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
           os.path.join(os.path.dirname(os.path.abspath(keras.__file__)), "src") + os.sep)


def user_frames_only(method: Callable) -> Callable:
    """`method`, whose exceptions carry only the frames outside keras_ipu and Keras.

    Only while Keras' traceback filtering is on (the default); the
    exception itself, its message, cause and context are unchanged.

    Args:
        method: A model method (`fit`, `evaluate`, `predict`).

    Returns:
        The wrapped method.

    Example:

    >>> fit = user_frames_only(fit)   # a ValueError's traceback ends at the user's call
    """

    @functools.wraps(method)
    def filtered(*args: Any, **kwargs: Any) -> Any:
        if not keras.config.is_traceback_filtering_enabled():
            return method(*args, **kwargs)
        try:
            return method(*args, **kwargs)
        except Exception as error:
            raise error.with_traceback(_user_traceback(error.__traceback__))  # noqa: B904

    return filtered


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without the hidden frames (the innermost one, that raised, if none
    is left)."""
    frames = list(traceback.walk_tb(tb))
    kept = [(f, line) for f, line in frames if not f.f_code.co_filename.startswith(_HIDDEN)]
    chain = None
    for frame, line in reversed(kept or frames[-1:]):
        chain = types.TracebackType(chain, frame, frame.f_lasti, line)
    return chain
