"""An elementwise optimizer applied to an IPU's weights as one flat vector.

A pipelined model holds each IPU's weights back to back in one vector per
dtype. Its optimizer clone updates them variable by variable: each weight,
gradient and slot (momentum, velocity, ...) sliced out of the flat vectors
and the results packed back, a hundred or more small kernels per IPU for a
convnet, each compiled on the first fit (about a second per IPU for
MobileNetV2 on a CPU). Optimizers whose update treats every value alone
(SGD, Adam, RMSprop, ...) give the same values when they update the whole
vector at once, so `FlatOptimizer` applies a clone built over one variable
the length of the IPU's weights. For it the IPU's optimizer state is stored
slot by slot (`FlatOptimizer.storage_order`): each slot of all the IPU's
variables lies back to back, in the weights' order, a slice of the packed
state.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras.src.backend.common import global_state

from keras_ipu.keras.pipelined import rebuilt_optimizer

# Optimizers whose update of a value reads only that value, its gradient,
# its own slots and scalars (exact classes: a subclass may do otherwise).
# Not Nadam: it builds a variable with a value, which a clone allocating
# nothing cannot.
ELEMENTWISE = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.Adamax,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.RMSprop,
    keras.optimizers.Lion,
)

# Settings under which an update reads more than one value (a norm over a
# variable or over all of them, averages kept per variable).
PER_VARIABLE_SETTINGS = ("clipnorm", "global_clipnorm", "use_ema", "gradient_accumulation_steps")

# Stand-ins are named so that a slot's name (Keras names it after its
# variable: `<variable>_<slot>`) says whose slot it is.
_STAND_IN = "keras_ipu_flat"
_SLOT_OF_VARIABLE = re.compile(rf"^{_STAND_IN}_(\d+)_(.+)$")


@dataclasses.dataclass(frozen=True)
class FlatOptimizer:
    """How one IPU's elementwise optimizer updates its weights as one vector.

    Made by `FlatOptimizer.of`, which returns `None` where it does not apply.

    Args:
        optimizer: The clone over one flat variable (its variables hold no
            values: they come from the packed state).
        dtype: The dtype of the IPU's weights.
        length: The number of weight values (the flat vector unpadded).
        storage_order: Positions in the IPU's per-variable clone's
            `variables` in the order the packed state holds them: first the
            variables that are not slots, then each slot's variables.
        sources: Per variable of `optimizer`, the `storage_order` entry it
            starts at (a slot spans one entry per weight).
    """

    optimizer: Any
    dtype: str
    length: int
    storage_order: tuple[int, ...]
    sources: tuple[int, ...]

    @classmethod
    def of(cls, optimizer: Any, variables: Sequence[Any]) -> FlatOptimizer | None:
        """The flat form of `optimizer`, a clone built over `variables`.

        Args:
            optimizer: A Keras optimizer built over `variables`.
            variables: The IPU's trainable variables, in its packed order.

        Returns:
            The `FlatOptimizer`, or `None` when the optimizer is not one of
            `ELEMENTWISE`, uses one of `PER_VARIABLE_SETTINGS`, excludes some
            variables from weight decay, a variable has a constraint or is
            overwritten with its gradient, or the variables have more than one
            dtype.

        Example:

        >>> flat = FlatOptimizer.of(clone, ipu_variables)
        >>> [clone.variables[p].name for p in flat.storage_order]
        ['iteration', 'learning_rate', 'kernel_momentum', 'bias_momentum', 'kernel_velocity', ...]
        """
        # The types JAX holds them in (float64 is float32 without x64), as the layouts.
        dtypes = {str(jax.dtypes.canonicalize_dtype(v.dtype)) for v in variables}
        if (type(optimizer) not in ELEMENTWISE or len(dtypes) != 1
                or any(getattr(optimizer, key, None) for key in PER_VARIABLE_SETTINGS)
                or _decays_some_only(optimizer, variables)
                or any(map(_updated_apart, variables))):
            return None
        length = sum(int(np.prod(v.shape)) for v in variables)
        per_variable = unallocated_clone(optimizer, [
            (f"{_STAND_IN}_{i}", v.shape, v.dtype) for i, v in enumerate(variables)])
        flat = unallocated_clone(optimizer, [(_STAND_IN, (length,), variables[0].dtype)])
        if _signature(per_variable.variables) != _signature(optimizer.variables):
            return None  # not built the way this module expects: keep the per-variable update
        mapping = _mapping(per_variable.variables, flat.variables, variables)
        return None if mapping is None else cls(flat, dtypes.pop(), length, *mapping)

    def apply(self, layout: Any, trainable: dict, optimizer_flats: dict,
              grads: Any) -> tuple[dict, dict]:
        """One update of the IPU's weights as one vector.

        Args:
            layout: The `FlatLayout` of the IPU's optimizer variables (in
                `storage_order`).
            trainable: The IPU's packed weights, per dtype (padded).
            optimizer_flats: The IPU's packed optimizer variables, per dtype.
            grads: The IPU's gradients as one vector (at least `length` long).

        Returns:
            The new packed weights and optimizer variables.
        """
        flat = trainable[self.dtype]
        weights = flat[:self.length]
        values = [self._read(layout, optimizer_flats, k) for k in range(len(self.sources))]
        [weights], values = self.optimizer.stateless_apply(
            values, [grads[:self.length].astype(weights.dtype)], [weights])
        return ({**trainable, self.dtype: jnp.concatenate([weights, flat[self.length:]])},
                self._written(layout, optimizer_flats, values))

    def _read(self, layout: Any, flats: dict, k: int) -> Any:
        shape = tuple(self.optimizer.variables[k].shape)
        first = self.sources[k]
        offset = layout.offsets[first]
        return flats[layout.dtypes[first]][offset:offset + int(np.prod(shape))].reshape(shape)

    def _written(self, layout: Any, flats: dict, values: list) -> dict:
        # Per dtype, the variables of the flat clone tile the packed vector
        # from its start in storage order; the padding stays.
        written = {}
        for dtype, flat in flats.items():
            mine = sorted((k for k, first in enumerate(self.sources)
                           if layout.dtypes[first] == dtype), key=self.sources.__getitem__)
            parts = [jnp.ravel(values[k]).astype(dtype) for k in mine]
            used = sum(int(part.shape[0]) for part in parts)
            written[dtype] = jnp.concatenate([*parts, flat[used:]])
        return written


def in_clone_order(stored: Sequence[Any], storage_order: Sequence[int]) -> list:
    """Optimizer values held in `storage_order` -> in the clone's `variables` order.

    Example:

    >>> in_clone_order(["it", "m_b", "m_a"], (0, 2, 1))
    ['it', 'm_a', 'm_b']
    """
    values: list = [None] * len(stored)
    for value, position in zip(stored, storage_order):
        values[position] = value
    return values


def in_storage_order(values: Sequence[Any], storage_order: Sequence[int]) -> list:
    """The inverse of `in_clone_order`."""
    return [values[position] for position in storage_order]


def _decays_some_only(optimizer: Any, variables: Sequence[Any]) -> bool:
    """Whether weight decay skips some of the variables (`exclude_from_weight_decay`)."""
    return optimizer.weight_decay is not None and not all(
        optimizer._use_weight_decay(v) for v in variables)


def _updated_apart(variable: Any) -> bool:
    """Whether Keras' update of `variable` is its own: a constraint applied to it after
    the step, or its gradient taken as its new value (float8 scales)."""
    return (getattr(variable, "constraint", None) is not None
            or bool(getattr(variable, "overwrite_with_gradient", False)))


def _signature(variables) -> list:
    return [(tuple(v.shape), str(v.dtype)) for v in variables]


def unallocated_clone(optimizer: Any, stand_ins: list[tuple]) -> Any:
    """A clone of `optimizer` built over stand-ins `(path, shape, dtype[, name])`, allocating
    nothing.

    Slots made in a `StatelessScope` wait for values; they are taken off
    Keras' list of variables to initialize, so that none ever is: their
    values always come from the packed state.
    """
    clone = rebuilt_optimizer.rebuilt(optimizer)
    pending = list(global_state.get_global_attribute("uninitialized_variables") or [])
    try:
        with keras.StatelessScope(initialize_variables=False):
            clone.build([stand_in_variable(*entry) for entry in stand_ins])
    finally:
        global_state.set_global_attribute("uninitialized_variables", pending)
    return clone


def stand_in_variable(path: str, shape: Any, dtype: Any, name: str | None = None
                      ) -> keras.Variable:
    """A zeros variable at `path` (`"model/layer/kernel"`): optimizers that choose by a
    variable's path (Muon's `exclude_layers`) choose for it as for the variable it stands in for.

    Args:
        path: The path of the variable it stands in for.
        shape: Its shape.
        dtype: Its dtype.
        name: A name other than the path's last part, for optimizers that name
            slots by a variable's name alone; the path stays `path`.

    Returns:
        A `keras.Variable` of zeros.

    Example:

    >>> stand_in_variable("functional/head/kernel", (8, 3), "float32").path
    'functional/head/kernel'
    """
    variable = keras.Variable(initializer="zeros", shape=shape, dtype=dtype,
                              name=name or path.split("/")[-1])
    # Set, not made by name scopes: a name scope's path ends in the variable's name.
    variable._path = path
    return variable


def _mapping(per_variable, flat, variables) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """`(storage_order, sources)`, or `None` where the slots do not map one to one."""
    plain: list[int] = []
    slots: dict[str, list[tuple[int, int]]] = {}
    for p, v in enumerate(per_variable):
        match = _SLOT_OF_VARIABLE.match(v.name)
        if match:
            slots.setdefault(match.group(2), []).append((p, int(match.group(1))))
        else:
            plain.append(p)
    for entries in slots.values():
        if ([i for _, i in entries] != list(range(len(variables))) or any(
                tuple(per_variable[p].shape) != tuple(variables[i].shape) for p, i in entries)):
            return None
    storage = plain + [p for entries in slots.values() for p, _ in entries]
    starts, position = {}, len(plain)
    for name, entries in slots.items():
        starts[f"{_STAND_IN}_{name}"] = position
        position += len(entries)
    unused = list(range(len(plain)))
    sources = []
    for v in flat:
        if v.name in starts:
            sources.append(starts.pop(v.name))
            continue
        twin = next((k for k in unused if per_variable[plain[k]].name == v.name
                     and _signature([per_variable[plain[k]]]) == _signature([v])), None)
        if twin is None:
            return None
        unused.remove(twin)
        sources.append(twin)
    return (tuple(storage), tuple(sources)) if not unused and not starts else None


__all__ = ["ELEMENTWISE", "PER_VARIABLE_SETTINGS", "FlatOptimizer", "in_clone_order",
           "in_storage_order"]
