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
        ValueError: When the elements' arrays differ in shape (a partial last
            batch, say), naming the shapes.

    Example:

    >>> stacked([np.ones(3), np.zeros(3)]).shape
    (2, 3)
    """
    data = jax.tree_util.tree_map(_stacked_array, *elements)
    if synthetic_data():  # no host data reaches the device: it gets zeros
        return jax.tree_util.tree_map(np.zeros_like, data)
    return data


def _stacked_array(*parts: Any) -> np.ndarray:
    shapes = sorted({np.shape(part) for part in parts})
    if len(shapes) > 1:
        raise ValueError(
            f"The infeed's elements differ in shape ({', '.join(map(str, shapes))}): a loop's "
            f"iterations take elements of one shape, as a program has static shapes. Is the "
            f"last batch partial? Drop it (drop_remainder=True) or pad it.")
    return np.stack(parts)


__all__ = ["stacked"]
