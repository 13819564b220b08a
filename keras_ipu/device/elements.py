"""Infeed elements as a program's input: stacked on a leading axis, one per iteration."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from keras_ipu.device.queues import synthetic_data


def stacked(elements: list) -> Any:
    """Infeed elements stacked on a leading axis (zeros under `--use_synthetic_data`).

    Args:
        elements: Elements of one structure (arrays, tuples or dicts of them).

    Returns:
        The structure with each array stacked, `[len(elements), ...]`.

    Raises:
        ValueError: When an element's structure differs from the first's (a
            tuple for an array, a dict for a tuple, another length), naming
            both, or when the elements' arrays differ in shape (a partial
            last batch, say), naming the shapes.

    Example:

    >>> stacked([np.ones(3), np.zeros(3)]).shape
    (2, 3)
    """
    structure = jax.tree_util.tree_structure(elements[0])
    for index, element in enumerate(elements[1:], start=1):
        if jax.tree_util.tree_structure(element) != structure:
            raise ValueError(
                f"The infeed's element {index} is {_described(element)} where the first is "
                f"{_described(elements[0])}: a loop's iterations take elements of one "
                f"structure (an array, or a tuple or dict of arrays), as a program's inputs "
                f"are fixed.")
    data = jax.tree_util.tree_map(_stacked_array, *elements)
    if synthetic_data():  # no host data reaches the device: it gets zeros
        return jax.tree_util.tree_map(np.zeros_like, data)
    return data


def _described(element: Any) -> str:
    """An element's structure, its arrays by shape: `(array (4, 3), array (4,))`."""
    return str(jax.tree_util.tree_map(lambda leaf: _Shape(np.shape(leaf)), element))


class _Shape(tuple):
    def __repr__(self) -> str:
        return f"array {tuple(self)}"


def _stacked_array(*parts: Any) -> np.ndarray:
    shapes = sorted({np.shape(part) for part in parts})
    if len(shapes) > 1:
        raise ValueError(
            f"The infeed's elements differ in shape ({', '.join(map(str, shapes))}): a loop's "
            f"iterations take elements of one shape, as a program has static shapes. Is the "
            f"last batch partial? Drop it (drop_remainder=True) or pad it.")
    return np.stack(parts)


__all__ = ["stacked"]
