"""Popnn normalisation operators of `tensorflow.python.ipu.normalization_ops`.

`group_norm`, `instance_norm` and `layer_norm` take IPU TensorFlow's
arguments and compute its normalisations (Poplar's strided channel grouping
by default) on JAX arrays, in a layer's `call` or a compiled computation.

A JAX function creates no variables: where IPU TensorFlow's functional
forms create `gamma` and `beta` in the variable scope, these take them from
`param_initializers`, as values (arrays, or Keras variables a layer owns
and trains) or as initializers evaluated for the channels (ones and zeros
by default, fixed in the program). For trained parameters use
`ipu.keras.layers.GroupNormalization`, `InstanceNormalization` or
`LayerNormalization`, or pass a layer's variables.

Example:

```python
from keras_ipu.ops import normalization_ops

y = normalization_ops.layer_norm(x)
z = normalization_ops.group_norm(x, groups=4, param_initializers={"gamma": layer.gamma})
```
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

_PARAMETERS = {"gamma": "ones", "beta": "zeros"}


def group_norm(inputs: Any, groups: int = 2, channels_axis: int = -1, center: bool = True,
               scale: bool = True, epsilon: float = 1e-6, param_initializers: Any = None,
               reuse: Any = None, variables_collections: Any = None, training: bool = True,
               trainable: bool = True, scope: Any = None,
               strided_channel_grouping: bool = True) -> Any:
    """Group normalisation: each group of channels normalised over it and the spatial axes.

    Args:
        inputs: An array of at least 2 dimensions, one of them the channels,
            all of static size.
        groups: The number of groups; it must divide the channels.
        channels_axis: The channels' axis (negative counts from the end).
        center: Whether to add `beta`.
        scale: Whether to multiply by `gamma`.
        epsilon: Added to the variance.
        param_initializers: `{"gamma": ..., "beta": ...}` (either may be
            left out): a value of shape `[channels]` (an array or a Keras
            variable) or an initializer (a Keras initializer, its name, or
            `fn(shape, dtype)`); ones and zeros by default.
        reuse: Accepted for compatibility (no variable scope).
        variables_collections: Accepted for compatibility.
        training: Accepted for compatibility: no statistics are kept.
        trainable: Accepted for compatibility.
        scope: Accepted for compatibility.
        strided_channel_grouping: Poplar's grouping, channel `c` in group
            `c % groups` (the default), or the conventional contiguous groups.

    Returns:
        The normalised array, of `inputs`' shape and type.

    Raises:
        ValueError: For fewer than 2 dimensions, a channels' axis outside
            them or of unknown size, `groups` that do not divide the
            channels, unknown `param_initializers` keys, or a value of theirs
            not of shape `[channels]`.

    Example:

    >>> y = group_norm(np.ones((2, 8, 8, 4), "float32"), groups=2)
    """
    import keras

    from keras_ipu.keras.layers import normalize_groups

    axis, channels = _channels(inputs, channels_axis)
    if not isinstance(groups, numbers.Integral) or isinstance(groups, bool) or groups < 1 \
            or channels % groups:
        raise ValueError(f"{channels} channels (axis {channels_axis} of {tuple(inputs.shape)}) "
                         f"cannot be split into {groups!r} groups; use a number of groups "
                         f"that divides {channels}.")
    dtype = keras.backend.standardize_dtype(inputs.dtype)
    gamma, beta = _parameters(param_initializers, channels, dtype, scale, center)
    return normalize_groups(inputs, int(groups), axis, epsilon, strided_channel_grouping, gamma,
                            beta, dtype)


def instance_norm(inputs: Any, channels_axis: int = -1, center: bool = True, scale: bool = True,
                  epsilon: float = 1e-6, param_initializers: Any = None, reuse: Any = None,
                  variables_collections: Any = None, training: bool = True,
                  trainable: bool = True, scope: Any = None) -> Any:
    """Instance normalisation: each channel normalised over the spatial axes (a group each).

    Args:
        inputs: An array of at least 2 dimensions, one of them the channels.
        channels_axis: The channels' axis.
        center: Whether to add `beta`.
        scale: Whether to multiply by `gamma`.
        epsilon: Added to the variance.
        param_initializers: As for `group_norm`.
        reuse: Accepted for compatibility.
        variables_collections: Accepted for compatibility.
        training: Accepted for compatibility.
        trainable: Accepted for compatibility.
        scope: Accepted for compatibility.

    Returns:
        The normalised array, of `inputs`' shape and type.

    Raises:
        ValueError: As `group_norm`.

    Example:

    >>> y = instance_norm(np.ones((2, 8, 8, 4), "float32"))
    """
    _, channels = _channels(inputs, channels_axis)
    return group_norm(inputs, channels, channels_axis, center, scale, epsilon,
                      param_initializers)


def layer_norm(inputs: Any, channels_axis: int = -1, center: bool = True, scale: bool = True,
               epsilon: float = 1e-6, param_initializers: Any = None, reuse: Any = None,
               variables_collections: Any = None, training: bool = True,
               trainable: bool = True, scope: Any = None) -> Any:
    """Layer normalisation: each sample normalised over all its channels and spatial axes.

    Args:
        inputs: An array of at least 2 dimensions, one of them the channels.
        channels_axis: The channels' axis (`gamma` and `beta` are per channel).
        center: Whether to add `beta`.
        scale: Whether to multiply by `gamma`.
        epsilon: Added to the variance.
        param_initializers: As for `group_norm`.
        reuse: Accepted for compatibility.
        variables_collections: Accepted for compatibility.
        training: Accepted for compatibility.
        trainable: Accepted for compatibility.
        scope: Accepted for compatibility.

    Returns:
        The normalised array, of `inputs`' shape and type.

    Raises:
        ValueError: As `group_norm`.

    Example:

    >>> y = layer_norm(np.ones((2, 16), "float32"))
    """
    return group_norm(inputs, 1, channels_axis, center, scale, epsilon, param_initializers)


def _channels(inputs: Any, channels_axis: int) -> tuple[int, int]:
    """The channels' axis (non-negative) and size, checked."""
    from keras_ipu.keras.group_normalization import channel_axes

    shape = tuple(inputs.shape)
    if len(shape) < 2:
        raise ValueError(f"The normalisation needs an input of at least 2 dimensions (batch "
                         f"and channels), got shape {shape}.")
    valid = channel_axes(len(shape))
    if channels_axis not in valid:
        raise ValueError(f"channels_axis {channels_axis} is not an axis of shape {shape} "
                         f"other than the batch: valid are {valid}.")
    axis = channels_axis % len(shape)
    if shape[axis] is None:
        raise ValueError(f"The channels' axis {channels_axis} of shape {shape} needs a static "
                         f"size.")
    return axis, shape[axis]


def _parameters(param_initializers: Any, channels: int, dtype: str, scale: bool,
                center: bool) -> tuple[Any, Any]:
    """`(gamma, beta)`: values or initializers' values of shape `[channels]`, or `None`."""
    import keras

    given = dict(param_initializers or {})
    unknown = sorted(set(given) - set(_PARAMETERS))
    if unknown:
        raise ValueError(f"param_initializers takes 'gamma' and 'beta', got {unknown}.")
    values = []
    for name, wanted in (("gamma", scale), ("beta", center)):
        source = given.get(name, _PARAMETERS[name])
        if not wanted:
            values.append(None)
        elif isinstance(source, str) or (callable(source) and not hasattr(source, "shape")):
            values.append(keras.initializers.get(source)((channels,), dtype))
        elif tuple(np.shape(source)) != (channels,):
            raise ValueError(f"param_initializers' {name!r} must be of shape [{channels}] "
                             f"(the channels), got shape {list(np.shape(source))}.")
        else:
            values.append(source)
    return values[0], values[1]


__all__ = ["group_norm", "instance_norm", "layer_norm"]
