"""The sample weights of array data, checked and laid out as Keras' array adapter does them."""

from __future__ import annotations

from typing import Any

from keras import tree
from keras.src.trainers.data_adapters import data_adapter_utils


def packed_data(x: Any, y: Any, sample_weight: Any, class_weight: dict | None) -> tuple:
    """The data as a step unpacks it, with one weight array per target.

    As Keras' `ArrayDataAdapter`: several targets take a structure of
    weights like theirs, or one per-sample array shared by all; class
    weights need a single target; and without targets the weights are
    dropped (a step has no loss to weight).

    Args:
        x: The inputs.
        y: The targets, or `None`.
        sample_weight: The sample weights, or `None`.
        class_weight: Class weights (`{class: weight}`), or `None`.

    Returns:
        `(x,)`, `(x, y)` or `(x, y, sample_weight)`.

    Raises:
        ValueError: For weights that do not match the targets' structure, a
            single array of non-scalar weights for several targets, or class
            weights for several targets or none.

    Example:

    >>> packed_data(x, {"a": ya, "b": yb}, w, None)  # (x, y, {"a": w, "b": w})
    """
    if y is None:
        if class_weight is not None:
            raise ValueError("`class_weight` weighs the targets' classes: give the targets `y`.")
        return (x,)
    if sample_weight is not None and tree.is_nested(y):
        sample_weight = _per_target(y, sample_weight)
    if class_weight is not None:
        if tree.is_nested(y):
            raise ValueError("`class_weight` is only supported for Models with a single output.")
        sample_weight = data_adapter_utils.class_weight_to_sample_weights(y, class_weight)
    return (x, y) if sample_weight is None else (x, y, sample_weight)


def _per_target(y: Any, sample_weight: Any) -> Any:
    if isinstance(sample_weight, (list, tuple, dict)):
        try:
            tree.assert_same_structure(y, sample_weight)
        except ValueError:
            raise ValueError(
                f"You should provide one `sample_weight` array per output in `y`. The two "
                f"structures did not match:\n- y: {_shapes(y)}\n"
                f"- sample_weight: {_shapes(sample_weight)}") from None
        return sample_weight
    shape = sample_weight.shape
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
        raise ValueError(
            f"For a model with multiple outputs, when providing a single `sample_weight` array, "
            f"it should only have one scalar score per sample (i.e. shape `(num_samples,)`), "
            f"got shape {tuple(shape)}. If you want to use non-scalar sample weights, pass a "
            f"`sample_weight` argument with one array per model output.")
    return tree.map_structure(lambda _: sample_weight, y)


def _shapes(structure: Any) -> Any:
    """The structure with each array's shape in its place: readable, unlike the arrays."""
    return tree.map_structure(lambda leaf: getattr(leaf, "shape", leaf), structure)
