"""Whether a custom optimizer steps the same when each IPU of a pipeline has its own copy.

A pipeline steps each IPU's weights with its own copy of the model's
optimizer (`optimizer_copies`), over that IPU's weights alone. Keras' own
optimizers keep state per weight, or state that follows the steps alone (an
iteration count): split that way, they step as one optimizer does. A custom
one may not, and is refused before any step when it:

- overrides `apply`, `stateless_apply` or `apply_gradients` (it may work
  over all its weights at once: a global norm, say; the reference refuses an
  overridden `minimize` under pipelining too);
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

# The methods an optimizer steps all its weights through at once.
_WHOLE_UPDATE = ("apply", "stateless_apply", "apply_gradients")
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
    own = [k for k in kind.__mro__ if not k.__module__.startswith(("keras.", "builtins"))]
    overridden = [name for name in _WHOLE_UPDATE if any(name in vars(k) for k in own)]
    if overridden:
        _refuse(kind, f"overrides `{overridden[0]}`, which may work over all the weights it "
                      f"updates at once (a global norm, say)", "Override `update_step`, which "
                      "Keras calls per weight")
    one, two = named_clone(optimizer, _STAND_INS[:1]), named_clone(optimizer, _STAND_INS)
    shared = [v.name for v in two.variables if not _per_weight(v)]
    if len(shared) != 2 * len(one.variables) - len(two.variables):
        _refuse(kind, "names the variables it makes per weight alike (not after their weight)",
                "Make them with `add_variable_from_reference(variable, name)`")
    if not shared:
        return
    try:
        stepped = {
            "follow their gradients": (_shared_after(two, 2, grads=0.5),
                                       _shared_after(two, 2, grads=2.0)),
            "follow the weights themselves": (_shared_after(two, 2),
                                              _shared_after(two, 2, weights=3.0)),
            "advance once per weight": (_shared_after(one, 1), _shared_after(two, 2)),
        }
    except Exception:  # noqa: BLE001 - an optimizer this probe cannot step: not refused
        return
    for what, (first, second) in stepped.items():
        differing = [name for name, a, b in zip(shared, first, second)
                     if not np.array_equal(a, b, equal_nan=True)]
        if differing:
            _refuse(kind, f"keeps variables over all the weights it updates that {what} "
                          f"({', '.join(differing)})", "Keep state per weight (made in "
                          "`build` for each variable)")


def _per_weight(variable: Any) -> bool:
    return any(name in variable.name for name, _, _ in _STAND_INS)


def _shared_after(clone: Any, count: int, grads: float = 1.0, weights: float = 1.0) -> list:
    """The clone's variables over all its weights after one step from zeros."""
    state = [jnp.zeros(v.shape, v.dtype) for v in clone.variables]
    values = [jnp.full(shape, weights, dtype) for _, shape, dtype in _STAND_INS[:count]]
    _, after = clone.stateless_apply(state, [w * grads for w in values], values)
    return [value for v, value in zip(clone.variables, after) if not _per_weight(v)]


def _refuse(kind: type, what: str, instead: str) -> None:
    raise NotImplementedError(
        f"{kind.__name__} {what}: a pipeline steps each IPU's weights with its own copy of "
        f"the optimizer, over that IPU's weights only, which would not step as "
        f"{kind.__name__} does. {instead}, or train without pipelining.")


__all__ = ["check"]
