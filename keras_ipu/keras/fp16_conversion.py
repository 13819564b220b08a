"""A model's copy in float16: the `FP16` precision mode of `keras-ipu convert`.

Every float layer is recast to float16 (nested models' and wrappers' inner
layers too), but those whose names match the excluded patterns, as the
reference's converter recasts every float32 node but the excluded ones. The
copy takes the model's weights, cast: its own initial values are never used,
so its variables are made as zeros (an initializer such as `Orthogonal` has
no float16 form on CPUs or GPUs) and its layers keep their initializers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np
from keras.src.models.functional import Functional


def to_float16(model: Any, excluded: Sequence[re.Pattern]) -> Any:
    """The model cloned in float16, with its weights, but the layers `excluded` names.

    Args:
        model: A Functional or Sequential Keras model.
        excluded: Patterns of the layer names that stay as they are.

    Returns:
        The float16 model.

    Raises:
        ValueError: When a layer not excluded is quantized (Keras'
            `quantize()`): it has no float16 form.

    Example:

    >>> half = to_float16(model, [re.compile("^logits$")])
    >>> half.get_layer("dense").dtype_policy.name
    'float16'
    """
    quantized = [layer.name for layer in _converted_layers(model, excluded)
                 if getattr(layer.dtype_policy, "quantization_mode", None)]
    if quantized:
        raise ValueError(f"FP16 conversion recasts float layers, and the layers {quantized} "
                         f"are quantized (Keras' `quantize()`): convert this model with "
                         f"--precision_mode FP32, or convert the float model to FP16 and "
                         f"quantize it after.")

    def clone(layer):
        if _matches(layer.name, excluded):  # a nested model or a wrapper: all of it
            return layer.__class__.from_config(layer.get_config())
        if _is_graph_model(layer):  # its own layers are recast, each matched by its name
            return keras.models.clone_model(layer, clone_function=clone)
        return layer.__class__.from_config(_half_config(layer.get_config(), excluded))

    half = keras.models.clone_model(model, clone_function=clone)
    for layer in half._flatten_layers(include_self=True):
        for name, value in list(vars(layer).items()):
            if isinstance(value, _Zeros):
                setattr(layer, name, value.initializer)
    pairs = list(zip(model.get_weights(), half.weights))
    _check_in_range(pairs)
    half.set_weights([np.asarray(w, dtype=v.dtype) for w, v in pairs])
    # An adapted layer (Normalization, Discretization) computes from what its adapted
    # weights give once finalized, as Keras' loading finalizes it; `set_weights` does not.
    for layer in half._flatten_layers(include_self=False):
        finalize = getattr(layer, "finalize_state", None)
        if callable(finalize):
            finalize()
    return half


def _check_in_range(pairs: list) -> None:
    """Refuses finite weights that a 16-bit variable would hold as infinities."""
    too_big = []
    for value, variable in pairs:
        dtype = np.dtype(variable.dtype)
        if dtype.kind == "f" and dtype.itemsize == 2 and np.size(value):
            finite = np.where(np.isfinite(value), value, 0)
            # Not the largest float16 (65504): values up to 65520 round down to it.
            with np.errstate(over="ignore"):
                overflows = not np.isfinite(finite.astype(dtype)).all()
            if overflows:
                largest = float(np.max(np.abs(finite)))
                too_big.append(f"{variable.path} (|value| up to {largest:.4g})")
    if too_big:
        raise ValueError(
            f"FP16 conversion would make infinities of the weights {', '.join(too_big)}: "
            f"float16 holds at most 65504. Exclude their layers "
            f"(--precision_conversion_excluded_nodes '^LAYER$'), or convert with FP32.")


def _matches(name: str, excluded: Sequence[re.Pattern]) -> bool:
    return any(p.search(name) for p in excluded)


def _is_graph_model(layer: Any) -> bool:
    """A nested Functional or Sequential model (which `clone_model` can clone)."""
    return isinstance(layer, (keras.Sequential, Functional))


def _converted_layers(layer: Any, excluded: Sequence[re.Pattern]) -> Iterator[Any]:
    """The layers inside `layer` the conversion recasts (not under an excluded name)."""
    for inner in layer._layers if hasattr(layer, "_layers") else ():
        if not _matches(inner.name, excluded):
            yield inner
            yield from _converted_layers(inner, excluded)


def _half_config(config: dict, excluded: Sequence[re.Pattern]) -> dict:
    """A layer's config in float16, and a wrapper's inner layers' (a `Bidirectional`'s
    `forward_lstm`, say), but where a layer's name matches `excluded`."""
    if _matches(config.get("name", ""), excluded):
        return config
    config = dict(config)
    if "dtype" in config:
        config["dtype"] = "float16"
    for key, value in config.items():
        if key.endswith("_initializer") and value is not None:
            # Serialized: an inner layer's config is deserialized as a whole.
            config[key] = keras.saving.serialize_keras_object(_Zeros(value))
        elif (isinstance(value, dict) and isinstance(value.get("config"), dict)
              and "class_name" in value):  # a serialized inner layer
            config[key] = {**value, "config": _half_config(value["config"], excluded)}
    return config


@keras.saving.register_keras_serializable(package="keras_ipu", name="FP16ConversionZeros")
class _Zeros(keras.initializers.Initializer):
    """Zeros in place of `initializer` while the copy is made (its weights come after)."""

    def __init__(self, initializer: Any):
        self.initializer = keras.initializers.get(initializer)

    def __call__(self, shape, dtype=None):
        return keras.ops.zeros(shape, dtype=dtype)

    def get_config(self) -> dict:
        return {"initializer": keras.initializers.serialize(self.initializer)}
