"""A new optimizer like the model's, made from its config, for one IPU of a pipeline.

A pipeline steps each IPU's weights with an optimizer of their own, made
from the model's optimizer's config (`get_config` / `from_config`), as Keras
makes one when it loads a model. Plain Keras never needs that round trip, so
`rebuilt` asks no more of it than Keras' own training does:

- a learning rate schedule or callable is shared, not serialized: a custom
  schedule needs neither `get_config` nor registration, a lambda works;
- a custom optimizer (or one a `LossScaleOptimizer` wraps) needs no
  registration;
- a setting the config leaves out (a subclass's extra `__init__` argument
  without a `get_config` that returns it, an attribute set after
  construction) is carried over from the optimizer's attributes, as long as
  it is a number, a string, a bool, `None`, a tuple or list of those, or a
  function (shared).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

# The values `rebuilt` carries from an optimizer to its copy: its settings.
_SCALARS = (bool, int, float, str, type(None))
# Set on a built optimizer only.
_BUILD_STATE = frozenset({"built"})
# Settings shared with the copy as they are: functions (they keep no optimizer state).
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, functools.partial)


def rebuilt(optimizer: Any, without_global_clipnorm: bool = False) -> Any:
    """A new, unbuilt optimizer made from `optimizer`'s config, with its learning rate.

    Args:
        optimizer: A Keras optimizer (a `LossScaleOptimizer` too).
        without_global_clipnorm: Whether the copy (and the optimizer it
            wraps) clips nothing by the global norm.

    Returns:
        The copy, not built.

    Example:

    >>> copy = rebuilt(keras.optimizers.Adam(MySchedule()))
    >>> copy.build(variables)
    """
    chain = _nested(optimizer)
    config = _config_without_learning_rates(chain)
    if without_global_clipnorm:
        config = _without_global_clipnorm(config)
    config = {**_required_settings(optimizer, config), **config}
    # The classes of the chain, registered or not (a LossScaleOptimizer looks its
    # inner optimizer's class up by name).
    custom = {type(each).__name__: type(each) for each in chain[1:]}
    try:
        copy = (type(optimizer).from_config(config, custom_objects=custom) if custom
                else type(optimizer).from_config(config))
    except TypeError as error:
        kind = type(optimizer).__name__
        raise TypeError(
            f"{kind} cannot be made again from its config: `{kind}.from_config("
            f"optimizer.get_config())` raised \"{error}\". A pipeline gives each IPU a copy "
            f"of the optimizer made that way: give {kind} a `get_config` that returns the "
            f"arguments of its `__init__` (only those).") from None
    copies = _nested(copy)
    for original, copied in zip(chain, copies):
        rate = original._learning_rate
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            copied.learning_rate = rate  # the schedule itself, given the copy's step
        elif callable(rate):
            copied.learning_rate = _reading_copy_steps(rate, chain, copies)
    _carry_settings(chain, _nested(copy),
                    {"global_clipnorm"} if without_global_clipnorm else set())
    return copy


def _required_settings(optimizer: Any, config: dict) -> dict:
    """The required `__init__` arguments the config leaves out, from the optimizer's
    attributes of their names (`self.factor = factor`)."""
    required = [p.name for p in inspect.signature(type(optimizer).__init__).parameters.values()
                if p.default is p.empty and p.name != "self"
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return {name: vars(optimizer)[name] for name in required
            if name not in config and _is_setting(vars(optimizer).get(name, object()), name)}


def _reading_copy_steps(rate: Any, chain: list, copies: list) -> Any:
    """The callable learning rate `rate`, reading the copy's `iterations` where it reads
    the original's (`lambda: 0.1 * 0.5 ** opt.iterations`).

    The copy's update maps only the copy's variables: the original's counter
    would be read as the constant it held when the program was traced.
    """
    def rate_of_copy():
        steps = [(original.iterations, made.iterations.value)
                 for original, made in zip(chain, copies)]
        with keras.StatelessScope(state_mapping=steps):
            return rate()

    return rate_of_copy


def _nested(optimizer: Any) -> list:
    """The optimizer, the one it wraps, and so on."""
    chain = [optimizer]
    while hasattr(chain[-1], "inner_optimizer"):
        chain.append(chain[-1].inner_optimizer)
    return chain


def _config_without_learning_rates(chain: list) -> dict:
    """The first optimizer's config, its (and its inner ones') schedules and callables left
    out: `get_config` would serialize them (a custom schedule may not serialize).

    Asked of shallow copies whose learning rate is `None` (Keras then writes `0.5`;
    `rebuilt` gives the copy the original one), so that the optimizer itself, which
    another thread may be reading, never changes.
    """
    copies = [_shallow_copy(each) for each in chain]
    for outer, inner in zip(copies, copies[1:]):
        object.__setattr__(outer, "inner_optimizer", inner)
    for each in copies:
        if _owns_learning_rate(each) and not isinstance(each._learning_rate, keras.Variable):
            object.__setattr__(each, "_learning_rate", None)
    return copies[0].get_config()


def _shallow_copy(optimizer: Any) -> Any:
    # Not `copy.copy`: Keras objects copy (and pickle) through their config.
    made = object.__new__(type(optimizer))
    made.__dict__.update(optimizer.__dict__)
    return made


def _owns_learning_rate(optimizer: Any) -> bool:
    # A LossScaleOptimizer's learning rate is its inner optimizer's.
    return "_learning_rate" in vars(optimizer)


def _without_global_clipnorm(config: dict) -> dict:
    """An optimizer's config with no `global_clipnorm` (nor its inner optimizer's)."""
    config = dict(config)
    if isinstance(config.get("inner_optimizer"), dict):
        inner = dict(config["inner_optimizer"])
        inner["config"] = _without_global_clipnorm(inner["config"])
        config["inner_optimizer"] = inner
    if "global_clipnorm" in config:
        config["global_clipnorm"] = None
    return config


def _carry_settings(chain: list, copies: list, changed: set) -> None:
    """Gives each copy its original's settings where they differ (but those `changed`).

    Also a public setting the copy lacks (set after construction: `opt.boost
    = 3.0`), and a public function where the copy has none (a `grad_fn` the
    config leaves out), shared. A function the copy made itself (a lambda of
    its `__init__`, which may read the optimizer it belongs to) stays its own.
    """
    for original, made in zip(chain, copies):
        ours, theirs = vars(original), vars(made)
        for name in ours.keys() - _BUILD_STATE - changed:
            value, public = ours[name], not name.startswith("_")
            if public and isinstance(value, _FUNCTIONS):
                if theirs.get(name) is None:
                    setattr(made, name, value)
            elif _is_setting(value, name) and (
                    name in theirs and not _same(value, theirs[name])
                    or name not in theirs and public):
                setattr(made, name, value)


def _is_setting(value: Any, name: str = "") -> bool:
    """Numbers, strings, and lists and tuples of them; under a public name (a
    subclass's own setting, not Keras' bookkeeping such as its variables'
    indices) also dicts and NumPy arrays of them."""
    if isinstance(value, (tuple, list)):
        return all(_is_setting(each, name) for each in value)
    if name.startswith("_"):
        return isinstance(value, _SCALARS)
    if isinstance(value, np.ndarray):
        return value.dtype != object
    if isinstance(value, Mapping):
        return all(isinstance(k, _SCALARS) and _is_setting(v, name) for k, v in value.items())
    return isinstance(value, _SCALARS)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    return type(a) is type(b) and (a == b or a != a and b != b)  # NaN is NaN


__all__ = ["rebuilt"]
