"""Whether a custom optimizer steps the same when each IPU of a pipeline has its own copy.

A pipeline steps each IPU's weights with its own copy of the model's
optimizer (`optimizer_copies`), over that IPU's weights alone. Keras' own
optimizers keep state per weight, or state that follows the steps alone (an
iteration count): split that way, they step as one optimizer does. A custom
one may not, and is refused before any step when it:

- updates a weight by the other weights' gradients (a global norm in an
  overridden `apply`, say); an override that only wraps Keras' trains;
- names the variables it makes per weight alike (`add_variable(name="acc")`),
  so that they cannot be told apart between the IPUs;
- keeps variables over all its weights that follow their gradients (a sum
  of squared gradients), follow the weights themselves (a norm of them), or
  advance once per weight it updates (a call count, a seed generator's
  state): each copy would keep its own over its IPU's weights only.

Found by building clones over one and two stand-in weights and stepping them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

_STAND_INS = [("w0", (2,), "float32"), ("w1", (2,), "float32")]


def check(optimizer: Any, named_clone: Callable[[Any, list], Any]) -> None:
    """Refuses a custom optimizer whose per-IPU copies would not step as it does.

    Args:
        optimizer: The optimizer (the one a `LossScaleOptimizer` wraps).
        named_clone: Builds a clone of it over stand-ins `(path, shape, dtype)`.

    Raises:
        NotImplementedError: Saying what the optimizer does that a split cannot.

    Example:

    >>> check(keras.optimizers.Adam(), optimizer_copies._named_clone)   # Keras': fine
    """
    kind = type(optimizer)
    if kind.__module__.startswith("keras."):
        return
    one, two = named_clone(optimizer, _STAND_INS[:1]), named_clone(optimizer, _STAND_INS)
    for clone in (one, two):
        # As the copies (`copy_for`): the pipeline clips by the norm over every IPU first.
        clone.global_clipnorm = None
    shared = [v.name for v in two.variables if not _per_weight(v)]
    if len(shared) != 2 * len(one.variables) - len(two.variables):
        _refuse(kind, "names the variables it makes per weight alike (not after their weight)",
                "Make them with `add_variable_from_reference(variable, name)`")
    try:
        # The first weight's update, and its own variables, when only the second's
        # gradient changes: the same unless the optimizer works over all its weights.
        alone = [_of_first(two, _step(two, 2, grads=(1.0, g))) for g in (1.0, 3.0)]
        stepped = {
            "follow their gradients": (_shared_after(two, 2, grads=(0.5, 0.5)),
                                       _shared_after(two, 2, grads=(2.0, 2.0))),
            "follow the weights themselves": (_shared_after(two, 2),
                                              _shared_after(two, 2, weights=3.0)),
            "advance once per weight": (_shared_after(one, 1), _shared_after(two, 2)),
        }
    except Exception:  # noqa: BLE001 - an optimizer this probe cannot step: not refused
        return
    if not all(np.array_equal(a, b, equal_nan=True) for a, b in zip(*alone)):
        _refuse(kind, "updates a weight by the other weights' gradients (a global norm, say, "
                      "in an overridden `apply`)", "Work per weight, in `update_step`")
    for what, (first, second) in stepped.items():
        differing = [name for name, a, b in zip(shared, first, second)
                     if not np.array_equal(a, b, equal_nan=True)]
        if differing:
            _refuse(kind, f"keeps variables over all the weights it updates that {what} "
                          f"({', '.join(differing)})", "Keep state per weight (made in "
                          "`build` for each variable)")


def _per_weight(variable: Any) -> bool:
    return any(name in variable.name for name, _, _ in _STAND_INS)


def _step(clone: Any, count: int, grads: tuple = (1.0, 1.0), weights: float = 1.0) -> tuple:
    """`(new weights, new variables)` of the clone after one step from its first state."""
    state = [_first_value(v) for v in clone.variables]
    values = [jnp.full(shape, weights, dtype) for _, shape, dtype in _STAND_INS[:count]]
    return clone.stateless_apply(state, [w * g for w, g in zip(values, grads)], values)


def _first_value(variable: Any) -> Any:
    # The learning rate and the step count have values; slots built without
    # allocating (`flat_optimizer.unallocated_clone`) start from zeros.
    try:
        return jnp.asarray(variable.value)
    except Exception:  # noqa: BLE001 - a variable waiting for its value
        return jnp.zeros(variable.shape, variable.dtype)


def _of_first(clone: Any, stepped: tuple) -> list:
    """The first stand-in's new value and its own variables' (`w0`'s)."""
    weights, after = stepped
    first = _STAND_INS[0][0]
    return [weights[0], *(value for v, value in zip(clone.variables, after) if first in v.name)]


def _shared_after(clone: Any, count: int, **step: Any) -> list:
    """The clone's variables over all its weights after one step."""
    _, after = _step(clone, count, **step)
    return [value for v, value in zip(clone.variables, after) if not _per_weight(v)]


def _refuse(kind: type, what: str, instead: str) -> None:
    raise NotImplementedError(
        f"{kind.__name__} {what}: a pipeline steps each IPU's weights with its own copy of "
        f"the optimizer, over that IPU's weights only, which would not step as "
        f"{kind.__name__} does. {instead}, or train without pipelining.")


__all__ = ["check"]
