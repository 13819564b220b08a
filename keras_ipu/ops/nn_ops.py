"""Neural network operators of `tensorflow.python.ipu.nn_ops`, on JAX arrays: activations, CTC.

For a layer's `call` (Keras' JAX backend) or any JAX function.

Example:

```python
from keras_ipu.ops import nn_ops

y = nn_ops.gelu(x)
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def gelu(x: Any, approximate: bool = True, name: str | None = None) -> jax.Array:
    """The GELU activation: `x * Φ(x)`.

    Args:
        x: The input.
        approximate: Use the tanh-based approximation (`True`, the default)
            or the exact erf-based form.
        name: Accepted for compatibility.

    Returns:
        An array of the input's shape and type.

    Example:

    >>> gelu(jnp.array([0.0, 1.0]))
    Array([0.       , 0.8411920], dtype=float32)
    """
    return jax.nn.gelu(x, approximate=approximate)


def hard_sigmoid(x: Any, name: str | None = None) -> jax.Array:
    """The hard sigmoid, as Poplar computes it: `clip(0.2 * x + 0.5, 0, 1)`.

    Args:
        x: The input.
        name: Accepted for compatibility.

    Returns:
        An array of the input's shape and type.

    Example:

    >>> hard_sigmoid(jnp.array([-3.0, 0.0, 1.0]))
    Array([0. , 0.5, 0.7], dtype=float32)
    """
    x = jnp.asarray(x)
    return jnp.clip(x * 0.2 + 0.5, 0, 1).astype(x.dtype)


def swish(x: Any, name: str | None = None) -> jax.Array:
    """The swish activation: `x * sigmoid(x)`.

    Args:
        x: The input.
        name: Accepted for compatibility.

    Returns:
        An array of the input's shape and type.

    Example:

    >>> swish(jnp.array([0.0]))
    Array([0.], dtype=float32)
    """
    return jax.nn.swish(x)


# CTC: the loss and the beam search come from Keras 3's JAX backend
# (`keras.ops.ctc_loss`, `keras.ops.ctc_decode`), which already does them as
# on-device loops in JAX; these functions give them the IPU API's layout
# (time-major data), arguments and results. Keras normalises its input with
# log_softmax, which leaves log probabilities as they are: the logits and the
# log-probability forms share one path.


def _blank(blank_index: int, num_classes: int) -> int:
    if isinstance(blank_index, bool) or not isinstance(blank_index, (int, np.integer)):
        raise TypeError(f"blank_index must be an int, got {blank_index!r}.")
    if not -num_classes <= blank_index < num_classes:
        raise ValueError(f"blank_index={blank_index} is not a class of data with "
                         f"{num_classes} classes (valid: {-num_classes} to {num_classes - 1}).")
    return int(blank_index) % num_classes


def _time_major(data: Any, name: str) -> jax.Array:
    data = jnp.asarray(data)
    if data.ndim != 3:
        raise ValueError(f"{name} must be [max_time, batch_size, num_classes], got shape "
                         f"{data.shape}.")
    return data


def _ctc_loss(labels: Any, data: Any, label_length: Any, data_length: Any, blank_index: int,
              out_dtype: Any, name: str) -> jax.Array:
    import keras

    data = _time_major(data, name)
    labels = jnp.asarray(labels)
    if labels.ndim != 2 or labels.shape[0] != data.shape[1]:
        raise ValueError(f"labels must be [batch_size={data.shape[1]}, max_label_length], got "
                         f"shape {labels.shape}.")
    out_dtype = jnp.dtype(data.dtype if out_dtype is None else out_dtype)
    if out_dtype == jnp.float16 and data.dtype == jnp.float32:
        raise ValueError("out_dtype cannot be float16 when the data is float32.")
    loss = keras.ops.ctc_loss(labels, jnp.swapaxes(data, 0, 1), label_length, data_length,
                              mask_index=_blank(blank_index, data.shape[-1]))
    return loss.astype(out_dtype)


def ctc_loss_v2(labels: Any, logits: Any, label_length: Any, logit_length: Any,
                blank_index: int, out_dtype: Any = None, name: str | None = None) -> jax.Array:
    """The CTC (Connectionist Temporal Classification) loss of logits.

    The negative log-likelihood of each batch entry's label sequence,
    summed over every alignment of its labels to its time steps (the
    forward algorithm, an on-device `lax.scan`); differentiable.

    Args:
        labels: `[batch_size, max_label_length]` class indices (never the blank).
        logits: `[max_time, batch_size, num_classes]` logits.
        label_length: `[batch_size]` labels in each entry.
        logit_length: `[batch_size]` valid time steps in each entry.
        blank_index: The blank class; negative counts from the end.
        out_dtype: The loss's dtype (default: the logits'); float16 only
            for float16 logits.
        name: Accepted for compatibility.

    Returns:
        The loss, shape `[batch_size]`.

    Raises:
        ValueError: For mismatched shapes, a blank index outside the
            classes, or float16 out of float32 logits.
        TypeError: For a blank index that is not an int.

    Example:

    >>> loss = ctc_loss_v2(labels, logits, label_length, logit_length, blank_index=0)
    """
    return _ctc_loss(labels, logits, label_length, logit_length, blank_index, out_dtype,
                     "logits")


def ctc_loss_with_log_probs(labels: Any, data: Any, label_length: Any, data_length: Any,
                            blank_index: int, out_dtype: Any = None,
                            name: str | None = None) -> jax.Array:
    """The CTC loss of log probabilities: `ctc_loss_v2` for `log_softmax` output.

    Args:
        labels: `[batch_size, max_label_length]` class indices.
        data: `[max_time, batch_size, num_classes]` log probabilities.
        label_length: `[batch_size]` labels in each entry.
        data_length: `[batch_size]` valid time steps in each entry.
        blank_index: The blank class; negative counts from the end.
        out_dtype: The loss's dtype (default: the data's).
        name: Accepted for compatibility.

    Returns:
        The loss, shape `[batch_size]`.

    Raises:
        ValueError: As `ctc_loss_v2`.
        TypeError: As `ctc_loss_v2`.

    Example:

    >>> loss = ctc_loss_with_log_probs(labels, jax.nn.log_softmax(logits), ll, tl, 0)
    """
    return _ctc_loss(labels, data, label_length, data_length, blank_index, out_dtype, "data")


def ctc_loss(labels: Any, data: Any, label_length: Any, data_length: Any, blank_index: int,
             out_dtype: Any = None, name: str | None = None) -> jax.Array:
    """The CTC loss of log probabilities (deprecated: `ctc_loss_with_log_probs`).

    Args:
        labels: `[batch_size, max_label_length]` class indices.
        data: `[max_time, batch_size, num_classes]` log probabilities.
        label_length: `[batch_size]` labels in each entry.
        data_length: `[batch_size]` valid time steps in each entry.
        blank_index: The blank class.
        out_dtype: The loss's dtype (default: the data's).
        name: Accepted for compatibility.

    Returns:
        The loss, shape `[batch_size]`.

    Raises:
        ValueError: As `ctc_loss_v2`.
        TypeError: As `ctc_loss_v2`.

    Example:

    >>> loss = ctc_loss(labels, log_probs, label_length, data_length, blank_index=0)
    """
    return ctc_loss_with_log_probs(labels, data, label_length, data_length, blank_index,
                                   out_dtype)


def ctc_loss_with_logits(labels: Any, logits: Any, label_length: Any, logit_length: Any,
                         blank_index: int, out_dtype: Any = None,
                         name: str | None = None) -> jax.Array:
    """The CTC loss of logits (deprecated: `ctc_loss_v2`).

    Args:
        labels: `[batch_size, max_label_length]` class indices.
        logits: `[max_time, batch_size, num_classes]` logits.
        label_length: `[batch_size]` labels in each entry.
        logit_length: `[batch_size]` valid time steps in each entry.
        blank_index: The blank class.
        out_dtype: The loss's dtype (default: the logits').
        name: Accepted for compatibility.

    Returns:
        The loss, shape `[batch_size]`.

    Raises:
        ValueError: As `ctc_loss_v2`.
        TypeError: As `ctc_loss_v2`.

    Example:

    >>> loss = ctc_loss_with_logits(labels, logits, label_length, logit_length, 0)
    """
    return ctc_loss_v2(labels, logits, label_length, logit_length, blank_index, out_dtype)


def ctc_beam_search_decoder_with_log_probs(
    log_probs: Any, input_lengths: Any, beam_width: int = 100, top_paths: int = 1,
    blank_index: int = -1, name: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The most likely label sequences of log probabilities, by CTC prefix beam search.

    Args:
        log_probs: `[max_time, batch_size, num_classes]` log probabilities.
        input_lengths: `[batch_size]` valid time steps in each entry.
        beam_width: Prefixes kept at each step, at least 1.
        top_paths: Label sequences returned per entry, 1 to `beam_width`.
        blank_index: The blank class; negative counts from the end.
        name: Accepted for compatibility.

    Returns:
        `(neg_log_probs, lengths, predictions)`, best first: the negative
        log probability `[batch_size, top_paths]` and length
        `[batch_size, top_paths]` of each sequence, and the sequences
        `[batch_size, top_paths, max_time]`, padded with -1 after their
        length.

    Raises:
        ValueError: For a beam width below 1, `top_paths` outside 1 to
            `beam_width`, or a blank index outside the classes.
        TypeError: For a blank index that is not an int.

    Example:

    >>> probs, lengths, predictions = ctc_beam_search_decoder_with_log_probs(lp, lengths, 8)
    """
    import keras

    log_probs = _time_major(log_probs, "log_probs")
    for argument, value, low, high in (("beam_width", beam_width, 1, None),
                                       ("top_paths", top_paths, 1, beam_width)):
        if not isinstance(value, int) or value < low or high is not None and value > high:
            raise ValueError(f"{argument} must be an int from {low}"
                             + (f" to beam_width={high}" if high is not None else " up")
                             + f", got {value!r}.")
    paths, scores = keras.ops.ctc_decode(
        jnp.swapaxes(log_probs, 0, 1), jnp.asarray(input_lengths), strategy="beam_search",
        beam_width=beam_width, top_paths=top_paths,
        mask_index=_blank(blank_index, log_probs.shape[-1]))
    predictions = jnp.swapaxes(paths, 0, 1).astype(jnp.int32)
    lengths = jnp.sum(predictions >= 0, axis=-1).astype(jnp.int32)
    return -scores.astype(log_probs.dtype), lengths, predictions


def ctc_beam_search_decoder(
    logits: Any, logits_lengths: Any, beam_width: int = 100, top_paths: int = 1,
    blank_index: int = -1, name: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The most likely label sequences of logits, by CTC prefix beam search.

    `ctc_beam_search_decoder_with_log_probs` of `log_softmax(logits)`.

    Args:
        logits: `[max_time, batch_size, num_classes]` logits.
        logits_lengths: `[batch_size]` valid time steps in each entry.
        beam_width: Prefixes kept at each step, at least 1.
        top_paths: Label sequences returned per entry, 1 to `beam_width`.
        blank_index: The blank class; negative counts from the end.
        name: Accepted for compatibility.

    Returns:
        `(neg_log_probs, lengths, predictions)` as
        `ctc_beam_search_decoder_with_log_probs` returns them.

    Raises:
        ValueError: As `ctc_beam_search_decoder_with_log_probs`.
        TypeError: As `ctc_beam_search_decoder_with_log_probs`.

    Example:

    >>> probs, lengths, predictions = ctc_beam_search_decoder(logits, lengths, top_paths=2)
    """
    return ctc_beam_search_decoder_with_log_probs(logits, logits_lengths, beam_width, top_paths,
                                                  blank_index)


__all__ = ["ctc_beam_search_decoder", "ctc_beam_search_decoder_with_log_probs", "ctc_loss",
           "ctc_loss_v2", "ctc_loss_with_log_probs", "ctc_loss_with_logits", "gelu",
           "hard_sigmoid", "swish"]
