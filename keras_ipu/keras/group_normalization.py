"""Poplar's group and instance normalisation: `ipu.keras.layers.GroupNormalization` and
`InstanceNormalization`, and the function both compute (`normalize_groups`, which
`ipu.normalization_ops` shares).

Poplar groups channels strided by default (`strided_channel_grouping=True`:
channel `c` is in group `c % groups`); the conventional grouping puts
consecutive channels together.

Example:

```python
layer = GroupNormalization(groups=4)
outputs = layer(images)   # [batch, height, width, channels], channels a multiple of 4
```
"""

from __future__ import annotations

import numbers
from typing import Any

import keras
from keras import ops

from keras_ipu import layer_registration
from keras_ipu.device import integers
from keras_ipu.keras.positional_call import PositionalArguments

_register = keras.saving.register_keras_serializable(package="keras_ipu")


def channel_axes(rank: int) -> list[int]:
    """The axes of a rank-`rank` input a normalisation may take as its channels: any but
    the batch (axis 0), whose statistics would mix the samples."""
    return [*range(1, rank), *range(-(rank - 1), 0)]


def normalize_groups(inputs: Any, groups: int, channels_axis: int, epsilon: float,
                     strided: bool, gamma: Any = None, beta: Any = None,
                     dtype: Any = None) -> Any:
    """Group normalisation of `inputs`, Poplar's strided grouping or the contiguous one.

    Each sample's channels are split into `groups`; each group is
    normalised over its channels and every other non-batch axis; then the
    per-channel `gamma` and `beta`, when given, apply.

    Args:
        inputs: `[batch, ..., channels, ...]`.
        groups: The number of groups; it divides the channels.
        channels_axis: The channels' axis.
        epsilon: Added to the variance.
        strided: Channel `c` in group `c % groups` (Poplar's), or in group
            `c // (channels / groups)`.
        gamma: Per-channel scales, or `None`.
        beta: Per-channel offsets, or `None`.
        dtype: The computation's type (`inputs`' when `None`); statistics
            are taken in at least float32.

    Returns:
        The normalised array, of `inputs`' shape and of type `dtype`.

    Example:

    >>> y = normalize_groups(x, groups=2, channels_axis=-1, epsilon=1e-6, strided=True)
    """
    dtype = dtype or keras.backend.standardize_dtype(inputs.dtype)
    x = ops.moveaxis(ops.cast(inputs, dtype), channels_axis, -1)  # [batch, spatial..., C]
    shape = ops.shape(x)
    rank, channels = len(shape), shape[-1]
    if strided:
        grouped = ops.reshape(x, (*shape[:-1], channels // groups, groups))
        members = rank - 1  # the axis of a group's channels
    else:
        grouped = ops.reshape(x, (*shape[:-1], groups, channels // groups))
        members = rank
    # Statistics in at least float32, as Keras' own normalisations.
    stats_dtype = "float32" if dtype in ("float16", "bfloat16") else None
    values = grouped if stats_dtype is None else ops.cast(grouped, stats_dtype)
    mean, variance = ops.moments(values, axes=(*range(1, rank - 1), members), keepdims=True)
    normalized = (values - mean) * ops.rsqrt(variance + epsilon)
    x = ops.reshape(ops.cast(normalized, dtype), shape)
    if gamma is not None:
        x = x * ops.cast(gamma, dtype)
    if beta is not None:
        x = x + ops.cast(beta, dtype)
    return ops.moveaxis(x, -1, channels_axis)


@_register
class GroupNormalization(PositionalArguments, keras.layers.Layer):
    """Group normalisation with IPU TensorFlow's arguments, Poplar's grouping included.

    Each sample's channels are split into `groups`; each group is normalised
    over its channels and the spatial axes; then a per-channel `gamma` and
    `beta` apply. No statistics are gathered (training and inference alike).

    Args:
        dtype: The type of the weights and of the computation.
        groups: The number of groups; it must divide the channels.
        channels_axis: The channels' axis.
        center: Whether to add the learned offset `beta`.
        scale: Whether to multiply by the learned `gamma`.
        epsilon: Added to the variance.
        beta_initializer: Initializer of `beta` (zeros when `None`).
        gamma_initializer: Initializer of `gamma` (ones when `None`).
        strided_channel_grouping: Poplar's grouping, channel `c` in group
            `c % groups` (`True`, IPU TensorFlow's default), or the usual
            contiguous groups, channel `c` in group `c // (channels / groups)`
            (`False`, as `keras.layers.GroupNormalization`).
        trainable: Whether the weights are trainable.
        name: The layer's name.
        **kwargs: Other Keras layer arguments.

    Raises:
        ValueError: When building, if `groups` does not divide the channels
            or the channels' axis has no static size.

    Example:

    >>> layer = GroupNormalization(groups=4, strided_channel_grouping=False)
    """

    def __init__(self, dtype="float32", groups=2, channels_axis=-1, center=True, scale=True,
                 epsilon=0.001, beta_initializer=None, gamma_initializer=None,
                 strided_channel_grouping=True, trainable=True, name=None, **kwargs):
        super().__init__(dtype=dtype, trainable=trainable, name=name, **kwargs)
        if isinstance(groups, bool) or not isinstance(groups, numbers.Integral) or groups < 1:
            raise ValueError(f"{type(self).__name__}: groups must be a positive integer, got "
                             f"{groups!r}.")
        self.groups = int(groups)
        self.channels_axis = channels_axis
        self.center, self.scale, self.epsilon = center, scale, epsilon
        self.beta_initializer = keras.initializers.get(beta_initializer or "zeros")
        self.gamma_initializer = keras.initializers.get(gamma_initializer or "ones")
        self.strided_channel_grouping = strided_channel_grouping
        self.supports_masking = True  # as keras.layers.GroupNormalization: per sample

    def _groups_for(self, channels: int) -> int:
        return self.groups

    def build(self, input_shape):
        rank = len(input_shape)
        valid = channel_axes(rank)
        given = integers.integer_of(self.channels_axis)  # a NumPy integer too, not a bool
        if given not in valid:
            raise ValueError(f"{type(self).__name__}: channels_axis {self.channels_axis!r} is "
                             f"not an axis of the rank-{rank} input {tuple(input_shape)} "
                             f"other than the batch: valid are {valid}.")
        self.channels_axis = given  # a Python int, for its config
        axis = self.channels_axis % rank
        channels = input_shape[axis]
        if channels is None:
            raise ValueError(f"{type(self).__name__} needs a static size for its channels' "
                             f"axis {self.channels_axis}; the input's shape is {input_shape}.")
        groups = self._groups_for(channels)
        if groups < 1 or channels % groups:
            raise ValueError(f"{type(self).__name__}: {channels} channels (axis "
                             f"{self.channels_axis} of {input_shape}) cannot be split into "
                             f"{groups} groups; use a number of groups that divides {channels}.")
        self._axis, self._groups = axis, groups
        self.gamma = self.add_weight(shape=(channels,), initializer=self.gamma_initializer,
                                     name="gamma") if self.scale else None
        self.beta = self.add_weight(shape=(channels,), initializer=self.beta_initializer,
                                    name="beta") if self.center else None

    def call(self, inputs):
        return normalize_groups(inputs, self._groups, self._axis, self.epsilon,
                                self.strided_channel_grouping, self.gamma, self.beta,
                                self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {
            **super().get_config(),
            "groups": self.groups,
            "channels_axis": self.channels_axis,
            "center": self.center,
            "scale": self.scale,
            "epsilon": self.epsilon,
            "beta_initializer": keras.initializers.serialize(self.beta_initializer),
            "gamma_initializer": keras.initializers.serialize(self.gamma_initializer),
            "strided_channel_grouping": self.strided_channel_grouping,
        }


@_register
class InstanceNormalization(GroupNormalization):
    """Instance normalisation with IPU TensorFlow's arguments: each channel its own group.

    Args:
        dtype: The type of the weights and of the computation.
        channels_axis: The channels' axis.
        center: Whether to add the learned offset `beta`.
        scale: Whether to multiply by the learned `gamma`.
        epsilon: Added to the variance.
        beta_initializer: Initializer of `beta` (zeros when `None`).
        gamma_initializer: Initializer of `gamma` (ones when `None`).
        trainable: Whether the weights are trainable.
        name: The layer's name.
        **kwargs: Other Keras layer arguments.

    Raises:
        ValueError: When building, if the channels' axis has no static size.

    Example:

    >>> layer = InstanceNormalization()
    """

    def __init__(self, dtype="float32", channels_axis=-1, center=True, scale=True,
                 epsilon=0.001, beta_initializer=None, gamma_initializer=None, trainable=True,
                 name=None, **kwargs):
        kwargs.pop("groups", None)  # from a saved config: always one group per channel
        kwargs.pop("strided_channel_grouping", None)
        super().__init__(dtype=dtype, groups=1, channels_axis=channels_axis, center=center,
                         scale=scale, epsilon=epsilon, beta_initializer=beta_initializer,
                         gamma_initializer=gamma_initializer, trainable=trainable, name=name,
                         **kwargs)

    def _groups_for(self, channels: int) -> int:
        return channels


# Keras' import may have come while this module was imported: the registration ends here.
layer_registration.complete(__name__)
