"""`tensorflow.python.ipu.nn_ops` on JAX arrays: activations, CTC, sampled losses.

For a layer's `call` (Keras' JAX backend) or any JAX function.

Example:

```python
from keras_ipu.ops import nn_ops

y = nn_ops.gelu(x)
```
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
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

    Raises:
        TypeError: For an input that is not floating point.

    Example:

    >>> gelu(jnp.array([0.0, 1.0]))
    Array([0.      , 0.841192], dtype=float32)
    """
    return jax.nn.gelu(_floating(x, "gelu"), approximate=approximate)


def hard_sigmoid(x: Any, name: str | None = None) -> jax.Array:
    """The hard sigmoid, as Poplar computes it: `clip(0.2 * x + 0.5, 0, 1)`.

    Args:
        x: The input.
        name: Accepted for compatibility.

    Returns:
        An array of the input's shape and type.

    Raises:
        TypeError: For an input that is not floating point (its result
            would be truncated to 0 or 1).

    Example:

    >>> hard_sigmoid(jnp.array([-3.0, 0.0, 1.0]))
    Array([0. , 0.5, 0.7], dtype=float32)
    """
    x = _floating(x, "hard_sigmoid")
    return jnp.clip(x * 0.2 + 0.5, 0, 1).astype(x.dtype)


def swish(x: Any, name: str | None = None) -> jax.Array:
    """The swish activation: `x * sigmoid(x)`.

    Args:
        x: The input.
        name: Accepted for compatibility.

    Returns:
        An array of the input's shape and type.

    Raises:
        TypeError: For an input that is not floating point.

    Example:

    >>> swish(jnp.array([0.0]))
    Array([0.], dtype=float32)
    """
    return jax.nn.swish(_floating(x, "swish"))


def _floating(x: Any, activation: str) -> jax.Array:
    """`x` as an array, refused unless floating point (as the IPU's activation ops)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{activation} takes a floating point input, got {x.dtype}.")
    return x


def multi_conv(func: Callable | None = None,
               options: Mapping[str, Any] | None = None) -> Callable:
    """Marks a function whose convolutions are independent of each other.

    On the IPU Poplar runs such convolutions in parallel on separate tiles.
    XLA already schedules independent operations of a program as it sees
    fit, so the decorated function computes what it did, its convolutions
    and their gradients unchanged; the PopLibs `options` must be a dictionary
    and have no other effect.

    Args:
        func: The function, taking positional arguments only; or `None`
            when the decorator is called with `options`.
        options: A dictionary of PopLibs multi-convolution options.

    Returns:
        The decorated function, or a decorator when `func` is `None`.

    Raises:
        TypeError: For options that are not a dictionary, or keyword
            arguments in a call of the decorated function.

    Example:

    >>> @multi_conv(options={"perConvReservedTiles": "50"})
    ... def convs(x, y):
    ...     return conv_a(x), conv_b(y)
    """
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"multi_conv's options must be a dictionary of PopLibs option names "
                        f"to values, got {options!r}.")

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def convolutions(*args, **kwargs):
            if kwargs:
                raise TypeError(f"A multi_conv function takes positional arguments only, got "
                                f"keyword arguments {sorted(kwargs)}.")
            return function(*args)

        return convolutions

    return decorate if func is None else decorate(func)


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
    lengths = {}
    data_length_name = {"logits": "logit_length", "data": "data_length"}[name]
    for argument, value, most in (("label_length", label_length, labels.shape[1]),
                                  (data_length_name, data_length, data.shape[0])):
        lengths[argument] = _checked_lengths(value, argument, data.shape[1], most)
    if out_dtype is None:  # the data's type, float32 for bfloat16 (no IPU type of the reference)
        out_dtype = data.dtype if data.dtype in (jnp.float16, jnp.float32) else jnp.float32
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.float16, jnp.float32):
        raise ValueError(f"out_dtype must be float16 or float32, got {out_dtype}.")
    if out_dtype == jnp.float16 and data.dtype == jnp.float32:
        raise ValueError("out_dtype cannot be float16 when the data is float32.")
    blank = _blank(blank_index, data.shape[-1])
    _check_label_values(labels, lengths["label_length"], data.shape[-1], blank)
    loss = keras.ops.ctc_loss(labels, jnp.swapaxes(data, 0, 1), *lengths.values(),
                              mask_index=blank)
    return loss.astype(out_dtype)


def _checked_lengths(value: Any, argument: str, batch_size: int, most: int) -> jax.Array:
    """A length per batch entry: integers from 0 to `most`, checked where the values are known."""
    lengths = jnp.asarray(value)
    if lengths.shape != (batch_size,):
        raise ValueError(f"{argument} must be [batch_size={batch_size}], got shape "
                         f"{lengths.shape}.")
    if not jnp.issubdtype(lengths.dtype, jnp.integer) and \
            not jnp.issubdtype(lengths.dtype, jnp.floating):
        raise TypeError(f"{argument} must be integers, got {lengths.dtype}.")
    if not isinstance(lengths, jax.core.Tracer):
        known = np.asarray(lengths)
        if known.size and (known.min() < 0 or known.max() > most
                           or (known != np.round(known)).any()):
            raise ValueError(f"{argument} must be whole numbers from 0 to {most}, got "
                             f"[{', '.join(f'{n:g}' for n in known.tolist())}].")
    return lengths.astype(jnp.int32)


def _check_label_values(labels: jax.Array, label_length: jax.Array, num_classes: int,
                        blank: int) -> None:
    """Refuses labels the loss would silently score wrong: checked where the values are known.

    An out-of-range class would read as probability 1 and the blank as a
    free step; a length past the labels would be clamped. Inside a compiled
    program the values are not known until it runs, as on the IPU.
    """
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integer class indices, got {labels.dtype}.")
    if isinstance(label_length, jax.core.Tracer) or isinstance(labels, jax.core.Tracer):
        return
    lengths = np.asarray(label_length)
    used = np.arange(labels.shape[1])[None, :] < lengths[:, None]
    bad = np.asarray(labels)[used]
    bad = bad[(bad < 0) | (bad >= num_classes) | (bad == blank)]
    if bad.size:
        raise ValueError(f"labels must be classes 0 to {num_classes - 1} other than the blank "
                         f"({blank}), got {sorted(set(bad.tolist()))}.")


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
        out_dtype: The loss's dtype (default: the logits', float32 for
            bfloat16 logits); float16 only for 16-bit logits.
        name: Accepted for compatibility.

    Returns:
        The loss, shape `[batch_size]`. An entry whose labels cannot be
        aligned to its steps (more labels and repeats than steps) gets about
        1e5 rather than infinity, as Keras' CTC loss gives.

    Raises:
        ValueError: For mismatched shapes, a blank index outside the
            classes, float16 out of float32 logits, or (where their values
            are known, outside a compiled program) labels outside the
            classes or equal to the blank, or lengths that are not whole
            numbers from 0 to the labels' (the steps').
        TypeError: For a blank index that is not an int, labels that are not
            integers, or lengths that are not numbers.

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
        out_dtype: The loss's dtype (default: the data's, float32 for bfloat16).
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
        out_dtype: The loss's dtype (default: the data's, float32 for bfloat16).
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
        out_dtype: The loss's dtype (default: the logits', float32 for bfloat16).
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
        length. An entry of length 0 decodes to the empty sequence (its
        other paths have an infinite negative log probability).

    Raises:
        ValueError: For a beam width below 1, `top_paths` outside 1 to
            `beam_width`, a blank index outside the classes, or
            `input_lengths` not `[batch_size]` or (where known) outside 0 to
            `max_time`.
        TypeError: For a blank index that is not an int, or lengths that are
            not numbers.

    Example:

    >>> probs, lengths, predictions = ctc_beam_search_decoder_with_log_probs(lp, lengths, 8)
    """
    import keras

    log_probs = _time_major(log_probs, "log_probs")
    for argument, value, low, high in (("beam_width", beam_width, 1, None),
                                       ("top_paths", top_paths, 1, beam_width)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low \
                or high is not None and value > high:
            raise ValueError(f"{argument} must be an int from {low}"
                             + (f" to beam_width={high}" if high is not None else " up")
                             + f", got {value!r}.")
    input_lengths = _checked_lengths(input_lengths, "input_lengths", log_probs.shape[1],
                                     log_probs.shape[0])
    paths, scores = keras.ops.ctc_decode(
        jnp.swapaxes(log_probs, 0, 1), input_lengths, strategy="beam_search",
        beam_width=int(beam_width), top_paths=int(top_paths),
        mask_index=_blank(blank_index, log_probs.shape[-1]))
    predictions = jnp.swapaxes(paths, 0, 1).astype(jnp.int32)
    neg_log_probs = -scores.astype(log_probs.dtype)
    # An entry of no time step decodes to the empty sequence, surely (Keras' search
    # takes a step of it anyway); its other paths are impossible.
    empty = (input_lengths == 0)[:, None]
    predictions = jnp.where(empty[..., None], -1, predictions)
    neg_log_probs = jnp.where(empty, jnp.where(jnp.arange(top_paths) == 0, 0.0, jnp.inf),
                              neg_log_probs).astype(log_probs.dtype)
    lengths = jnp.sum(predictions >= 0, axis=-1).astype(jnp.int32)
    return neg_log_probs, lengths, predictions


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


# Sampled losses, as TensorFlow's `nn_impl` computes them: the true classes and
# one shared sample of other classes are scored, each logit corrected by the
# log of how often the sampler is expected to pick its class.


def _log_uniform_probability(classes: jax.Array, range_max: int) -> jax.Array:
    # log1p keeps the precision that log((k + 2) / (k + 1)) loses for large k.
    return jnp.log1p(1.0 / (classes.astype(jnp.float32) + 1.0)) / np.log(range_max + 1.0)


def _check_counts(num_sampled: Any, num_classes: Any, num_true: Any) -> None:
    for argument, value in (("num_sampled", num_sampled), ("num_classes", num_classes),
                            ("num_true", num_true)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{argument} must be a positive int, got {value!r}.")


def log_uniform_candidate_sampler(true_classes: Any, num_true: int, num_sampled: int,
                                  unique: bool, range_max: int,
                                  seed: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Samples classes from the log-uniform (Zipfian) distribution, as TensorFlow does.

    Class `k` of `[0, range_max)` has probability
    `log((k + 2) / (k + 1)) / log(range_max + 1)`: low class IDs are
    frequent. With `unique`, draws are repeated until `num_sampled`
    different classes came (an on-device `lax.while_loop`), and a class's
    expected count is `1 - (1 - p) ** tries`, or `num_sampled * p` when
    the first `num_sampled` draws were all different (TensorFlow's range
    sampler); without `unique`, it is `num_sampled * p`.

    Args:
        true_classes: `[batch_size, num_true]` target classes.
        num_true: Target classes per example.
        num_sampled: Classes to sample.
        unique: Sample without repetition.
        range_max: The number of classes.
        seed: An int, a pair of ints or a `keras.random.SeedGenerator`
            (inside a compiled step, a layer's `SeedGenerator`, so that each
            step draws anew); `None` uses Keras' global seed generator,
            which only works outside compiled steps.

    Returns:
        `(sampled_candidates [num_sampled], true_expected_count
        [batch_size, num_true], sampled_expected_count [num_sampled])`,
        the `sampled_values` of `nce_loss` and `sampled_softmax_loss`.

    Raises:
        ValueError: For counts below 1, or `unique` with more samples than
            classes.

    Example:

    >>> sampled_values = log_uniform_candidate_sampler(labels, 1, 64, True, 10_000, seed=1)
    """
    import keras

    from keras_ipu.keras.layers import keras_seed

    _check_counts(num_sampled, range_max, num_true)
    if unique and num_sampled > range_max:
        raise ValueError(f"num_sampled={num_sampled} unique classes cannot come from "
                         f"range_max={range_max} classes.")
    try:
        bits = keras.random.randint((2,), 0, 2**31 - 1, dtype="int32", seed=keras_seed(seed))
    except ValueError as error:
        if seed is not None:
            raise
        # Keras' global seed generator cannot advance inside a traced step.
        raise ValueError("Sampling classes inside a compiled step needs seed=: a "
                         "keras.random.SeedGenerator created in the layer or model (it draws "
                         "a new sample each step), or an int for the same sample every step."
                         ) from error
    key = jax.random.wrap_key_data(jnp.asarray(bits).astype(jnp.uint32))
    samples, tries = (_draw_unique if unique else _draw_repeated)(key, num_sampled, range_max)
    true_classes = jnp.asarray(true_classes).astype(jnp.int32)

    def expected(classes):
        p = _log_uniform_probability(classes, range_max)
        at_least_once = -jnp.expm1(tries.astype(jnp.float32) * jnp.log1p(-p))
        # TensorFlow's range sampler: p × num_sampled when no draw was repeated.
        return jnp.where(tries == num_sampled, p * num_sampled, at_least_once)

    return samples, expected(true_classes), expected(samples)


def _draw(key: jax.Array, count: Any, range_max: int) -> jax.Array:
    uniform = jax.random.uniform(key, (count,) if isinstance(count, int) else count)
    draws = jnp.floor(jnp.exp(uniform * np.log(range_max + 1.0))).astype(jnp.int32) - 1
    return jnp.clip(draws, 0, range_max - 1)


def _draw_repeated(key, num_sampled, range_max):
    return _draw(key, num_sampled, range_max), jnp.int32(num_sampled)


def _draw_unique(key: jax.Array, num_sampled: int, range_max: int) -> tuple:
    def more_needed(state):
        return state[2] < num_sampled

    def draw_one(state):
        key, samples, found, tries = state
        key, this = jax.random.split(key)
        candidate = _draw(this, (), range_max)
        new = ~jnp.any(samples == candidate)
        samples = jnp.where(new, samples.at[found].set(candidate), samples)
        return key, samples, found + new.astype(jnp.int32), tries + 1

    start = (key, jnp.full((num_sampled,), -1, jnp.int32), jnp.int32(0), jnp.int32(0))
    _, samples, _, tries = jax.lax.while_loop(more_needed, draw_one, start)
    return samples, tries


def _sampled_logits(weights, biases, labels, inputs, num_sampled, num_classes, num_true,
                    sampled_values, seed):
    _check_counts(num_sampled, num_classes, num_true)
    if isinstance(weights, (list, tuple)):
        weights = jnp.concatenate([jnp.asarray(w) for w in weights], axis=0)
    weights, biases, inputs = jnp.asarray(weights), jnp.asarray(biases), jnp.asarray(inputs)
    labels = jnp.asarray(labels).astype(jnp.int32)
    # Checked before the sampler draws (and a seed generator advances).
    if weights.shape[0] != num_classes or biases.shape != (num_classes,):
        raise ValueError(f"weights must be [num_classes={num_classes}, dim] and biases "
                         f"[num_classes], got {weights.shape} and {biases.shape}.")
    if inputs.ndim != 2 or inputs.shape[1] != weights.shape[1]:
        raise ValueError(f"inputs must be [batch_size, dim={weights.shape[1]}], got shape "
                         f"{inputs.shape}.")
    if labels.size != inputs.shape[0] * num_true:
        raise ValueError(f"labels must be [batch_size={inputs.shape[0]}, num_true={num_true}], "
                         f"got shape {labels.shape}.")
    labels = labels.reshape(inputs.shape[0], num_true)
    if sampled_values is None:
        sampled_values = log_uniform_candidate_sampler(labels, num_true, num_sampled, True,
                                                       num_classes, seed)
    sampled, true_expected, sampled_expected = (
        jax.lax.stop_gradient(jnp.asarray(v)) for v in sampled_values)
    sampled = sampled.astype(jnp.int32)
    true_logits = jnp.einsum("bd,btd->bt", inputs, weights[labels]) + biases[labels]
    sampled_logits = inputs @ weights[sampled].T + biases[sampled]
    logits = jnp.concatenate([true_logits - jnp.log(true_expected).astype(true_logits.dtype),
                              sampled_logits - jnp.log(sampled_expected).astype(
                                  sampled_logits.dtype)], axis=1)
    targets = jnp.concatenate([jnp.full_like(true_logits, 1.0 / num_true),
                               jnp.zeros_like(sampled_logits)], axis=1)
    return logits, targets


def nce_loss(weights: Any, biases: Any, labels: Any, inputs: Any, num_sampled: int,
             num_classes: int, num_true: int = 1, sampled_values: Any = None,
             name: str = "nce_loss", seed: Any = None) -> jax.Array:
    """The noise-contrastive estimation loss, as IPU TensorFlow's `nce_loss`.

    The true classes and `num_sampled` sampled ones (shared by the batch,
    log-uniform and unique unless `sampled_values` says otherwise) are
    scored by `inputs @ weights.T + biases`, corrected by the log of their
    expected sample counts; the loss is the sum of the sigmoid cross
    entropies against targets `1 / num_true` (true) and 0 (sampled).

    Args:
        weights: `[num_classes, dim]` class embeddings, or a list of parts
            to concatenate.
        biases: `[num_classes]` class biases.
        labels: `[batch_size, num_true]` target classes.
        inputs: `[batch_size, dim]` activations.
        num_sampled: Classes to sample per batch.
        num_classes: The number of classes.
        num_true: Target classes per example.
        sampled_values: `(sampled_candidates, true_expected_count,
            sampled_expected_count)`, as `log_uniform_candidate_sampler`
            returns; sampled here when `None`.
        name: Accepted for compatibility.
        seed: The sampler's seed (see `log_uniform_candidate_sampler`); a
            keras_ipu addition, as TensorFlow's op seed came from the graph.

    Returns:
        The per-example losses, `[batch_size]`.

    Raises:
        ValueError: For counts below 1 or weights of the wrong shape.

    Example:

    >>> loss = nce_loss(weights, biases, labels, inputs, 64, 10_000, seed=generator)
    """
    logits, targets = _sampled_logits(weights, biases, labels, inputs, num_sampled,
                                      num_classes, num_true, sampled_values, seed)
    losses = jnp.maximum(logits, 0) - logits * targets + jnp.log1p(jnp.exp(-jnp.abs(logits)))
    return jnp.sum(losses, axis=1)


def sampled_softmax_loss(weights: Any, biases: Any, labels: Any, inputs: Any, num_sampled: int,
                         num_classes: int, num_true: int = 1, sampled_values: Any = None,
                         name: str = "sampled_softmax_loss", seed: Any = None) -> jax.Array:
    """The sampled softmax loss, as IPU TensorFlow's `sampled_softmax_loss`.

    As `nce_loss`, but the loss is the softmax cross entropy over the true
    and sampled classes. As in IPU TensorFlow (unlike TensorFlow's CPU
    version), a sampled class that is also a true class is not removed.

    Args:
        weights: `[num_classes, dim]` class embeddings, or a list of parts.
        biases: `[num_classes]` class biases.
        labels: `[batch_size, num_true]` target classes.
        inputs: `[batch_size, dim]` activations.
        num_sampled: Classes to sample per batch.
        num_classes: The number of classes.
        num_true: Target classes per example.
        sampled_values: As for `nce_loss`.
        name: Accepted for compatibility.
        seed: The sampler's seed (see `log_uniform_candidate_sampler`).

    Returns:
        The per-example losses, `[batch_size]`.

    Raises:
        ValueError: For counts below 1 or weights of the wrong shape.

    Example:

    >>> loss = sampled_softmax_loss(weights, biases, labels, inputs, 64, 10_000, seed=1)
    """
    logits, targets = _sampled_logits(weights, biases, labels, inputs, num_sampled,
                                      num_classes, num_true, sampled_values, seed)
    return -jnp.sum(targets * jax.nn.log_softmax(logits, axis=1), axis=1)


__all__ = ["ctc_beam_search_decoder", "ctc_beam_search_decoder_with_log_probs", "ctc_loss",
           "ctc_loss_v2", "ctc_loss_with_log_probs", "ctc_loss_with_logits", "gelu",
           "hard_sigmoid", "log_uniform_candidate_sampler", "multi_conv", "nce_loss",
           "sampled_softmax_loss", "swish"]
