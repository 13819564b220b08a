"""The infeed and outfeed queue options (`set_infeed_queue_options`, `set_outfeed_queue_options`).

The keys are those of the reference's `IPUInfeedQueue` and `IPUOutfeedQueue`
constructors. Two act on keras_ipu's data path: `prefetch_depth` (how many
executions' inputs are staged on the device ahead of the running one) and
`buffer_depth` (how many steps of results the device holds before the host
must take them, with asynchronous callbacks; by default about a fifth of an
execution). The others are accepted for
ported code and have no effect; keys Keras sets itself, keys that cannot work
with Keras and unknown keys are refused.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

DEFAULT_PREFETCH_DEPTH = 2
# The reference's limit on a data stream's prefetch buffer.
_MAX_DEPTH = 255

_NO_EFFECT = "accepted; no effect on the device model"

INFEED_KWARGS = {
    "prefetch_depth": "executions' inputs staged on the device ahead of the running one",
    "data_to_prefetch": "deprecated in the reference; accepted, no effect",
    "feed_name": "generated automatically; accepted, no effect",
    "device_ordinal": "set by the model's IPUs; accepted, no effect",
    "replication_factor": "set automatically from the model; accepted, no effect",
    "optimise_latency": "a Poplar stream setting; accepted, no effect",
}
OUTFEED_KWARGS = {
    "buffer_depth": "steps of results the device holds before the host takes them",
    "feed_name": "generated automatically; accepted, no effect",
    "replication_factor": "set automatically from the model; accepted, no effect",
    "io_batch_size": "deprecated in the reference; accepted, no effect",
    "optimise_latency": "a Poplar stream setting; accepted, no effect",
}
_INFEED_AUTOMATIC = ("dataset", "infeed_spec", "element_spec")
_OUTFEED_INCOMPATIBLE = ("outfeed_mode", "device_ordinal")
_DEPTHS = {"prefetch_depth", "buffer_depth"}
# The reference's types of the keys without effect (each may be None): checked when set,
# as the options are saved with the model (as JSON).
_NO_EFFECT_TYPES: dict[str, type] = {
    "data_to_prefetch": numbers.Integral, "feed_name": str, "device_ordinal": numbers.Integral,
    "replication_factor": numbers.Integral, "optimise_latency": bool,
    "io_batch_size": numbers.Integral,
}
_TYPE_NAMES = {numbers.Integral: "an integer", str: "a string", bool: "a bool"}


def infeed_options(kwargs: Any) -> dict[str, Any]:
    """Validated `set_infeed_queue_options` keyword arguments.

    Args:
        kwargs: The keyword arguments, as given.

    Returns:
        A copy of them, to store and save with the model.

    Raises:
        TypeError: When `kwargs` is not a mapping.
        ValueError: For the keys Keras sets (`dataset`, `infeed_spec`,
            `element_spec`), an unknown key (naming the closest valid one),
            a `prefetch_depth` that is not an integer in [1, 255], or a key
            without effect given a value not of the reference's type.

    Example:

    >>> infeed_options({"prefetch_depth": 3})
    {'prefetch_depth': 3}
    """
    return _checked("infeed", kwargs, INFEED_KWARGS, _INFEED_AUTOMATIC, ())


def outfeed_options(kwargs: Any) -> dict[str, Any]:
    """Validated `set_outfeed_queue_options` keyword arguments.

    Args:
        kwargs: The keyword arguments, as given.

    Returns:
        A copy of them, to store and save with the model.

    Raises:
        TypeError: When `kwargs` is not a mapping.
        ValueError: For `outfeed_mode` and `device_ordinal` (set by
            Keras), an unknown key (naming the closest valid one), a
            `buffer_depth` that is not an integer in [1, 255], or a key
            without effect given a value not of the reference's type.

    Example:

    >>> outfeed_options({"buffer_depth": 2})
    {'buffer_depth': 2}
    """
    return _checked("outfeed", kwargs, OUTFEED_KWARGS, (), _OUTFEED_INCOMPATIBLE)


def prefetch_depth(infeed_kwargs: Mapping[str, Any]) -> int:
    """The executions staged ahead of the running one (`DEFAULT_PREFETCH_DEPTH` unless set)."""
    return int(infeed_kwargs.get("prefetch_depth") or DEFAULT_PREFETCH_DEPTH)


def buffer_depth(outfeed_kwargs: Mapping[str, Any]) -> int | None:
    """The steps of results the device holds (`None` unless set: the stream picks)."""
    depth = outfeed_kwargs.get("buffer_depth")
    return int(depth) if depth is not None else None


def _checked(kind: str, kwargs: Any, valid: Mapping[str, str], automatic: tuple[str, ...],
             incompatible: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"The {kind} queue options must be keyword arguments, got {kwargs!r}.")
    for key in kwargs:
        if key in automatic:
            raise ValueError(
                f"Found `{key}` key in `kwargs`. This argument is automatically set by Keras."
            )
        if key in incompatible:
            raise ValueError(
                f"Found `{key}` key in `kwargs`. This argument is not compatible with Keras."
            )
        if key not in valid:
            close = difflib.get_close_matches(key, list(valid), n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise ValueError(
                f"Unknown {kind} queue option `{key}`.{hint} Valid options: "
                f"{', '.join(sorted(valid))}."
            )
    # NumPy scalars as Python values: the options are saved with the model as JSON.
    checked = {key: value.item() if isinstance(value, np.generic) else value
               for key, value in kwargs.items()}
    for key in _NO_EFFECT_TYPES.keys() & set(checked):
        value, kind_of_value = checked[key], _NO_EFFECT_TYPES[key]
        if value is not None and (not isinstance(value, kind_of_value)
                                  or (kind_of_value is not bool and isinstance(value, bool))):
            raise ValueError(
                f"The {kind} queue option `{key}` must be {_TYPE_NAMES[kind_of_value]} or None "
                f"(it has no effect, and is saved with the model), got {value!r}.")
    for key in _DEPTHS & set(kwargs):
        value = kwargs[key]
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                or not 1 <= value <= _MAX_DEPTH):
            raise ValueError(
                f"The {kind} queue option `{key}` must be an integer from 1 to {_MAX_DEPTH} "
                f"(or None for the default), got {value!r}."
            )
        checked[key] = int(value)  # NumPy integers saved as JSON numbers
    return checked


__all__ = ["infeed_options", "outfeed_options", "prefetch_depth", "buffer_depth"]
