"""IPU Keras layers: `ipu.keras.layers` of IPU TensorFlow, as Keras 3 layers.

IPU TensorFlow offers these layers as IPU-optimised replacements of Keras'
own (Poplar's dropout, embedding, normalisations and recurrent cells). On
keras_ipu every Keras layer runs on the virtual IPUs, so each layer here
takes the IPU layer's arguments, in its order and with its defaults, and
computes what it documents with Keras 3 operations. Ported code runs after
changing its imports:

- `Dropout(rate, noise_shape=None, seed=None)`: `seed` may be IPU
  TensorFlow's pair of 32-bit integers.
- `Embedding(input_dim, output_dim, embeddings_initializer="uniform")`.
- `LayerNormalization`, `GroupNormalization`, `InstanceNormalization`: with
  `dtype` (float32 by default, the weights' and the computation's type)
  first, and for group normalisation Poplar's strided channel grouping
  (`strided_channel_grouping=True`, the default: channel `c` is in group
  `c % groups`) or the conventional contiguous one.
- `PopnnLSTM` / `LSTM`, `PopnnGRU` / `GRU`: Keras' recurrent layers with the
  IPU layers' `seed` (of the weight initializers), `dropout_seed` (of the
  dropout masks), `time_major`, `partials_dtype` (the precision of
  Poplar's partial sums: accepted and kept; the device model sums in the
  computation's type) and Poplar's `"hard_sigmoid"`.
- `RecomputationCheckpoint`: marks values a recomputing pipeline stage
  keeps, under `RecomputeAndBackpropagateInterleaved`, so that its backward
  op recomputes only what follows them.

Every layer is registered for Keras serialization (package `keras_ipu`),
so saved models load with them.

Example:

```python
import keras
import keras_ipu as ipu

model = keras.Sequential([
    keras.Input((16,), dtype="int32"),
    ipu.keras.layers.Embedding(1000, 32),
    ipu.keras.layers.PopnnLSTM(64),
    ipu.keras.layers.Dropout(0.1, seed=[1, 2]),
    keras.layers.Dense(10),
])
```
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import ops

from keras_ipu import layer_registration
from keras_ipu.device import checkpoints, integers
from keras_ipu.keras.group_normalization import (  # noqa: F401 (ipu.keras.layers' names)
    GroupNormalization,
    InstanceNormalization,
    normalize_groups,
)
from keras_ipu.keras.positional_call import PositionalArguments

_register = keras.saving.register_keras_serializable(package="keras_ipu")


def keras_seed(seed: Any) -> Any:
    """A Keras seed (an integer) from an IPU layer's or operator's seed.

    Args:
        seed: `None`, an integer, IPU TensorFlow's pair of 32-bit integers
            (a list, tuple or array of two, or a pair computed inside the
            program), or a `keras.random.SeedGenerator` (which operators
            drawing inside a compiled step need).

    Returns:
        `None`, the integer itself, one non-negative integer below 2**31
        that the pair determines (for a computed pair, Keras' seed array
        `[that integer, 0]`), or the `SeedGenerator` unchanged.

    Raises:
        ValueError: For anything else.

    Example:

    >>> keras_seed([1, 2]) == keras_seed((1, 2))
    True
    """
    if seed is None or isinstance(seed, keras.random.SeedGenerator):
        return seed
    if isinstance(seed, (int, np.integer)):
        return int(seed)
    if isinstance(seed, jax.core.Tracer):  # a pair computed inside the program
        return _traced_pair_seed(seed)
    pair = np.asarray(seed)
    if pair.shape != (2,) or not np.issubdtype(pair.dtype, np.integer):
        raise ValueError(
            f"A seed must be an integer or a pair of 32-bit integers, got {seed!r}.")
    high, low = (int(v) & 0xFFFFFFFF for v in pair)
    return (high * 0x9E3779B1 + low) % (1 << 31)


def _traced_pair_seed(seed: Any) -> jax.Array:
    """Keras' seed array for a pair known only on the device: the integer a fixed pair maps to.

    Modulo 2**31 the 32-bit wrapping arithmetic equals the exact one, so
    the mask is the one the same pair gives as Python integers.
    """
    if tuple(seed.shape) != (2,) or not jnp.issubdtype(seed.dtype, jnp.integer):
        raise ValueError(f"A seed must be an integer or a pair of 32-bit integers, got an "
                         f"array of shape {tuple(seed.shape)} and type {seed.dtype}.")
    high, low = seed.astype(jnp.uint32)
    mixed = (high * jnp.uint32(0x9E3779B1) + low) & jnp.uint32(0x7FFFFFFF)
    return jnp.stack([mixed, jnp.uint32(0)])


@_register
class Dropout(PositionalArguments, keras.layers.Dropout):
    """Dropout with IPU TensorFlow's arguments (`seed` may be a pair of integers).

    Randomly sets a fraction `rate` of the inputs to 0 in training, scaling
    the rest by `1 / (1 - rate)`; does nothing in inference.

    Args:
        rate: Fraction of the input units to drop, in [0, 1] (1 drops all, as
            in Keras).
        noise_shape: The shape of the dropout mask (Keras' `noise_shape`).
        seed: An integer or a pair of 32-bit integers seeding the mask.
        **kwargs: Keras layer arguments (`name`, `dtype`, ...).

    Raises:
        ValueError: For a `rate` outside [0, 1] or a malformed `seed`.

    Example:

    >>> layer = Dropout(0.5, seed=[3, 4])
    """

    def __init__(self, rate, noise_shape=None, seed=None, **kwargs):
        super().__init__(rate, noise_shape=noise_shape, seed=keras_seed(seed), **kwargs)


@_register
class Embedding(PositionalArguments, keras.layers.Embedding):
    """An embedding lookup, as IPU TensorFlow's `Embedding`.

    Its arguments come in the order of IPU TensorFlow's layer (that of its
    later releases too, which added Keras' own and `serialization_factor`).

    Args:
        input_dim: Size of the vocabulary (the largest index + 1).
        output_dim: Dimension of the embedding.
        embeddings_initializer: Initializer of the embedding matrix.
        embeddings_regularizer: Regularizer of the embedding matrix.
        activity_regularizer: Regularizer of the output.
        embeddings_constraint: Constraint of the embedding matrix.
        mask_zero: Whether index 0 is padding, masked out.
        input_length: Accepted for compatibility (Keras 3 warns and drops it).
        serialization_factor: Poplar looks the ids up in this many slices of
            the table, to save memory; kept and checked (a positive divisor of
            `input_dim`). The lookup's values are the same.
        **kwargs: Keras `Embedding` arguments.

    Raises:
        ValueError: For a `serialization_factor` that does not divide `input_dim`.

    Example:

    >>> layer = Embedding(1000, 32)  # (batch, length) ids -> (batch, length, 32)
    """

    def __init__(self, input_dim, output_dim, embeddings_initializer="uniform",
                 embeddings_regularizer=None, activity_regularizer=None,
                 embeddings_constraint=None, mask_zero=False, input_length=None,
                 serialization_factor=1, **kwargs):
        factor = integers.integer_of(serialization_factor)  # a NumPy integer too
        if factor is None or factor < 1 or input_dim % factor:
            raise ValueError(f"serialization_factor must be a positive integer dividing "
                             f"input_dim {input_dim}, got {serialization_factor!r}.")
        serialization_factor = factor
        if input_length is not None:
            kwargs["input_length"] = input_length  # Keras' own warning
        super().__init__(input_dim, output_dim, embeddings_initializer=embeddings_initializer,
                         embeddings_regularizer=embeddings_regularizer,
                         activity_regularizer=activity_regularizer,
                         embeddings_constraint=embeddings_constraint, mask_zero=mask_zero,
                         **kwargs)
        self.serialization_factor = serialization_factor

    def get_config(self):
        return {**super().get_config(), "serialization_factor": self.serialization_factor}

    def quantize(self, mode=None, type_check=True, config=None):
        # Keras' `Embedding.quantize` refuses subclasses (their weights may differ): this
        # one's are Keras' own, so `model.quantize()` quantizes it as a Keras Embedding.
        super().quantize(mode, type_check=False, config=config)


@_register
class LayerNormalization(PositionalArguments, keras.layers.LayerNormalization):
    """Layer normalisation with IPU TensorFlow's arguments (`dtype` first).

    Args:
        dtype: The type of the weights and of the computation.
        axis: The axis or axes normalised.
        epsilon: Added to the variance.
        center: Whether to add the learned offset `beta`.
        scale: Whether to multiply by the learned `gamma`.
        beta_initializer: Initializer of `beta`.
        gamma_initializer: Initializer of `gamma`.
        trainable: Whether the weights are trainable.
        name: The layer's name.
        **kwargs: Other Keras `LayerNormalization` arguments.

    Example:

    >>> layer = LayerNormalization(epsilon=1e-5)
    """

    def __init__(self, dtype="float32", axis=-1, epsilon=0.001, center=True, scale=True,
                 beta_initializer="zeros", gamma_initializer="ones", trainable=True, name=None,
                 **kwargs):
        super().__init__(axis=axis, epsilon=epsilon, center=center, scale=scale,
                         beta_initializer=beta_initializer, gamma_initializer=gamma_initializer,
                         trainable=trainable, name=name, dtype=dtype, **kwargs)


LSTMStateTuple = collections.namedtuple("LSTMStateTuple", ("c", "h"))
LSTMStateTuple.__doc__ = """An LSTM's state, `(c, h)`, as TensorFlow's `LSTMStateTuple`.

Example:

>>> state = LSTMStateTuple(c=cell_state, h=hidden_state)
"""


class _IPURecurrent(PositionalArguments):
    """The IPU recurrent layers' own arguments over Keras' layer.

    With `time_major=True` sequences come and go as `[time, batch, ...]`.
    """

    # The IPU layers' `call(inputs, training=None, initial_state=None)`: ported
    # calls pass those positionally, where Keras' order is (initial_state, mask, ...).
    _POSITIONAL = ("training", "initial_state")

    def call(self, sequences, initial_state=None, mask=None, training=False):
        self._check_initial_state(initial_state, sequences)
        if not self.time_major:
            return super().call(sequences, initial_state=initial_state, mask=mask,
                                training=training)
        if mask is not None:
            mask = _swap_leading(mask)
        outputs = super().call(_swap_leading(sequences), initial_state=initial_state,
                               mask=mask, training=training)
        if not self.return_sequences:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return [_swap_leading(outputs[0]), *outputs[1:]]
        return _swap_leading(outputs)

    def build(self, sequences_shape, initial_state_shape=None):
        shape = tuple(sequences_shape)
        if len(shape) != 3 or shape[2] is None:
            layout = "[time, batch, features]" if self.time_major else "[batch, time, features]"
            raise ValueError(f"{self.name}: the input shape must be {layout} with a known "
                             f"number of features, got {shape}.")
        if self.time_major:
            sequences_shape = (sequences_shape[1], sequences_shape[0], *sequences_shape[2:])
        with _orthogonal_drawn_in_float32(self.cell):
            super().build(sequences_shape, initial_state_shape)

    def state_shape(self, batch_size: int) -> list[int] | tuple[list[int], ...]:
        """The shape of the state: `[batch_size, units]`, a pair of them for an LSTM.

        Args:
            batch_size: The batch size.

        Returns:
            A GRU's `[batch_size, units]`; an LSTM's `(c, h)` shapes, each that.
        """
        sizes = self.cell.state_size
        if isinstance(sizes, (list, tuple)):
            return tuple([batch_size, size] for size in sizes)
        return [batch_size, sizes]

    def _check_initial_state(self, initial_state, sequences) -> None:
        """Raises `ValueError` unless `initial_state` holds one `[batch, units]` per state."""
        if initial_state is None:
            return
        states = initial_state if isinstance(initial_state, (list, tuple)) else [initial_state]
        sizes = self.cell.state_size
        sizes = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes]
        batch = tuple(sequences.shape)[1 if self.time_major else 0]
        shapes = [tuple(getattr(state, "shape", ())) for state in states]
        expected = [(batch, size) for size in sizes]

        def fits(shape, wanted):
            return len(shape) == len(wanted) and all(
                a is None or b is None or a == b for a, b in zip(shape, wanted))

        if len(shapes) != len(expected) or not all(map(fits, shapes, expected)):
            raise ValueError(f"{self.name}: initial_state must be {len(expected)} "
                             f"state{'s' if len(expected) > 1 else ''} of shape "
                             f"{list(expected[0])} (batch, units), got shapes "
                             f"{[list(shape) for shape in shapes]}.")

    def compute_output_shape(self, sequences_shape, initial_state_shape=None):
        if not self.time_major:
            return super().compute_output_shape(sequences_shape, initial_state_shape)
        batch_major = (sequences_shape[1], sequences_shape[0], *sequences_shape[2:])
        shapes = super().compute_output_shape(batch_major, initial_state_shape)
        if not self.return_sequences:
            return shapes
        if self.return_state:
            first = shapes[0]
            return [(first[1], first[0], *first[2:]), *shapes[1:]]
        return (shapes[1], shapes[0], *shapes[2:])

    def _init_recurrent(self, keras_class: type, arguments: dict, kwargs: dict) -> None:
        """Keras' `__init__` with the IPU layer's arguments; keeps the IPU-only ones.

        `seed` seeds the weight initializers and `dropout_seed` the dropout
        masks (Keras' own `seed`), each only that, as the IPU layers document.
        """
        self.time_major = arguments.pop("time_major")
        if self.time_major and arguments.get("go_backwards"):
            # keras.layers.Bidirectional makes its backward layer so, and reverses that
            # layer's sequences along axis 1: the batch of time-major sequences.
            raise ValueError(f"{type(self).__name__}: go_backwards=True with time_major=True "
                             f"is not supported (as IPU TensorFlow's layer refuses "
                             f"go_backwards): keras.layers.Bidirectional would reverse the "
                             f"batch of the time-major outputs. Use time_major=False.")
        self.partials_dtype = float_dtype_choice("partials_dtype", arguments.pop("partials_dtype"))
        self.implementation = arguments.pop("implementation")
        self.dropout_seed = _plain_seed(arguments.pop("dropout_seed"))
        self.initializer_seed = _plain_seed(arguments.pop("seed"))
        for name in ("kernel_initializer", "recurrent_initializer"):
            arguments[name] = seeded_initializer(arguments[name], self.initializer_seed)
        for name in ("activation", "recurrent_activation"):
            arguments[name] = ipu_activation(arguments[name])
        if arguments.get("unit_forget_bias"):
            # The forget gate's biases start at one, every other bias at zero.
            arguments["bias_initializer"] = "zeros"
        keras_class.__init__(self, seed=keras_seed(self.dropout_seed), **arguments, **kwargs)

    def get_config(self):
        config = {**super().get_config(), "time_major": self.time_major,
                  "partials_dtype": self.partials_dtype, "implementation": self.implementation,
                  "seed": self.initializer_seed, "dropout_seed": self.dropout_seed}
        for name in ("activation", "recurrent_activation"):
            if getattr(self, name) is poplar_hard_sigmoid:
                config[name] = "hard_sigmoid"  # the IPU layer's name, mapped again on loading
        return config


@_register
def poplar_hard_sigmoid(x: Any) -> Any:
    """The hard sigmoid as Poplar computes it: `clip(0.2 * x + 0.5, 0, 1)`.

    Keras 3's `hard_sigmoid` is `clip(x / 6 + 0.5, 0, 1)`; the IPU recurrent
    layers, `ipu.nn_ops.hard_sigmoid` and `ipu.rnn_ops` use this one.

    Args:
        x: A tensor.

    Returns:
        A tensor of `x`'s shape and type.

    Example:

    >>> poplar_hard_sigmoid(np.array([-3.0, 0.0, 1.0], "float32"))  # [0, 0.5, 0.7]
    """
    return ops.clip(x * 0.2 + 0.5, 0.0, 1.0)


def ipu_activation(activation: Any) -> Any:
    """The Keras activation an IPU layer's `activation` argument names.

    Args:
        activation: An activation name, function or `None` (linear).

    Returns:
        `poplar_hard_sigmoid` for `"hard_sigmoid"` (or Keras' own
        `hard_sigmoid` function), as Poplar computes it; `activation`
        unchanged otherwise.

    Example:

    >>> ipu_activation("hard_sigmoid") is poplar_hard_sigmoid
    True
    """
    if (isinstance(activation, str) and activation == "hard_sigmoid") or (
            activation is keras.activations.hard_sigmoid):
        return poplar_hard_sigmoid
    return activation


POPLAR_FLOAT_DTYPES = ("float16", "float32")


def float_dtype_choice(argument: str, value: Any) -> str:
    """A Popnn dtype argument's name: `"float16"` or `"float32"`, however it is given.

    Args:
        argument: The argument's name, for the error.
        value: A dtype: a name, a NumPy or JAX type.

    Returns:
        The dtype's name.

    Raises:
        ValueError: For any other dtype, naming the valid ones.

    Example:

    >>> float_dtype_choice("partials_dtype", np.float16)
    'float16'
    """
    try:
        name = keras.backend.standardize_dtype(value)
    except (TypeError, ValueError):
        name = None
    if name not in POPLAR_FLOAT_DTYPES:
        raise ValueError(f"{argument} must be one of {', '.join(map(repr, POPLAR_FLOAT_DTYPES))}"
                         f", got {value!r}.")
    return name


@contextlib.contextmanager
def _orthogonal_drawn_in_float32(cell: Any) -> Any:
    """Draws a 16-bit cell's orthogonal weights in float32, then casts them.

    Keras' `Orthogonal` needs a QR decomposition, which JAX has in no 16-bit
    type on CPUs: the seed's default `recurrent_initializer` failed to build
    a layer of `dtype="float16"`, which Popnn runs.
    """
    initializer = getattr(cell, "recurrent_initializer", None)
    dtype = keras.backend.standardize_dtype(cell.dtype_policy.variable_dtype)
    if not isinstance(initializer, keras.initializers.Orthogonal) or dtype not in (
            "float16", "bfloat16"):
        yield
        return
    cell.recurrent_initializer = lambda shape, dtype=None: ops.cast(
        initializer(shape, dtype="float32"), dtype)
    try:
        yield
    finally:
        cell.recurrent_initializer = initializer


def seeded_initializer(initializer: Any, seed: Any) -> Any:
    """`initializer`, drawing from `seed` when it is random and has no seed of its own.

    Args:
        initializer: A Keras initializer, its name or config, or a callable.
        seed: `None` (no change), an integer or a pair of 32-bit integers.

    Returns:
        The initializer: a seeded copy of a random Keras initializer that
        was not seeded (a name such as `"glorot_uniform"` included), the
        initializer itself otherwise (a seeded one keeps its own seed).

    Example:

    >>> kernel = seeded_initializer("glorot_uniform", 7)((3, 4))  # the same for every call
    """
    initializer = keras.initializers.get(initializer)
    if seed is None or not isinstance(initializer, keras.initializers.Initializer):
        return initializer
    config = initializer.get_config()
    if "seed" not in config or config["seed"] is not None:
        return initializer  # not random, or seeded by the user
    return type(initializer).from_config({**config, "seed": keras_seed(seed)})


def _plain_seed(seed: Any) -> Any:
    """A seed argument as a config keeps it: a pair as a list of ints, checked."""
    keras_seed(seed)  # raises for a malformed seed
    if seed is None or isinstance(seed, keras.random.SeedGenerator):
        return seed
    if isinstance(seed, (int, np.integer)):
        return int(seed)
    return [int(v) for v in np.asarray(seed)]


def _arguments(names: dict) -> dict:
    """An `__init__`'s named arguments, from its `locals()`."""
    return {k: v for k, v in names.items() if k not in ("self", "kwargs", "__class__")}


def _swap_leading(x):
    return ops.swapaxes(x, 0, 1)


@_register
class PopnnLSTM(_IPURecurrent, keras.layers.LSTM):
    """Long short-term memory with IPU TensorFlow's arguments (alias `LSTM`).

    Keras' `LSTM`, with the IPU layer's defaults (`recurrent_activation`
    `"sigmoid"`) and its extra arguments. `"hard_sigmoid"` is Poplar's,
    `clip(0.2 * x + 0.5, 0, 1)`, not Keras 3's.

    Args:
        units: Dimension of the output space.
        unit_forget_bias: Whether the forget gate's biases start at one; it
            also forces `bias_initializer="zeros"` for the other biases.
        dropout_seed: A seed for the dropout masks (an integer or a pair of
            32-bit integers); `None` draws unseeded masks.
        implementation: Accepted for compatibility (Keras 3 has one).
        partials_dtype: The type of Poplar's partial sums; accepted and kept
            (the device model sums in the computation's type).
        seed: An integer seeding `kernel_initializer` and
            `recurrent_initializer` (those that are random and not seeded
            already): the same seed, the same weights.
        time_major: Whether sequences are `[time, batch, features]` (inputs
            and sequence outputs) instead of `[batch, time, features]`.
        **kwargs: The other arguments of `keras.layers.LSTM`, with its
            meanings (`activation`, initializers, regularizers, constraints,
            `dropout`, `recurrent_dropout`, `return_sequences`,
            `return_state`, `go_backwards`, `stateful`, `unroll`, ...).
            `stateful` state is carried in eager calls and `strategy.run`
            programs, not in `fit`/`evaluate`/`predict` (as plain Keras 3
            on JAX; docs/porting.md).

    Example:

    >>> layer = PopnnLSTM(64, return_sequences=True, time_major=True)
    """

    def __init__(self, units, activation="tanh", recurrent_activation="sigmoid", use_bias=True,
                 kernel_initializer="glorot_uniform", recurrent_initializer="orthogonal",
                 bias_initializer="zeros", unit_forget_bias=True, kernel_regularizer=None,
                 recurrent_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, recurrent_constraint=None, bias_constraint=None,
                 dropout=0.0, dropout_seed=None, recurrent_dropout=0.0, implementation=1,
                 return_sequences=False, return_state=False, go_backwards=False,
                 stateful=False, unroll=False, partials_dtype="float32", seed=None,
                 time_major=False, **kwargs):
        self._init_recurrent(keras.layers.LSTM, _arguments(locals()), kwargs)

    def __call__(self, inputs, *args, **kwargs):
        # The IPU layer documents an `LSTMStateTuple(c, h)`: read by name, since
        # Keras' own order is `[h, c]` (a list keeps Keras' meaning). Turned into
        # Keras' list before Keras records the call, so a saved model keeps its meaning.
        state = kwargs.get("initial_state", args[1] if len(args) > 1 else None)
        if isinstance(state, LSTMStateTuple):
            if len(args) > 1:
                args = (args[0], [state.h, state.c], *args[2:])
            else:
                kwargs["initial_state"] = [state.h, state.c]
        return super().__call__(inputs, *args, **kwargs)


@_register
class PopnnGRU(_IPURecurrent, keras.layers.GRU):
    """Gated recurrent unit with IPU TensorFlow's arguments (alias `GRU`).

    Keras' `GRU` (`reset_after=True` by default, as the IPU layer), with the
    IPU layer's extra arguments. `"hard_sigmoid"` is Poplar's,
    `clip(0.2 * x + 0.5, 0, 1)`, not Keras 3's.

    Args:
        units: Dimension of the output space.
        dropout_seed: A seed for the dropout masks (an integer or a pair of
            32-bit integers); `None` draws unseeded masks.
        implementation: Accepted for compatibility (Keras 3 has one).
        partials_dtype: The type of Poplar's partial sums; accepted and kept
            (the device model sums in the computation's type).
        seed: An integer seeding `kernel_initializer` and
            `recurrent_initializer` (those that are random and not seeded
            already): the same seed, the same weights.
        time_major: Whether sequences are `[time, batch, features]` (inputs
            and sequence outputs) instead of `[batch, time, features]`.
        **kwargs: The other arguments of `keras.layers.GRU`, with its
            meanings.

    Example:

    >>> layer = PopnnGRU(32, return_state=True)
    """

    def __init__(self, units, activation="tanh", recurrent_activation="sigmoid", use_bias=True,
                 kernel_initializer="glorot_uniform", recurrent_initializer="orthogonal",
                 bias_initializer="zeros", kernel_regularizer=None, recurrent_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None, kernel_constraint=None,
                 recurrent_constraint=None, bias_constraint=None, dropout=0.0,
                 dropout_seed=None, recurrent_dropout=0.0, implementation=1,
                 return_sequences=False, return_state=False, go_backwards=False,
                 stateful=False, unroll=False, reset_after=True, seed=None,
                 partials_dtype="float32", time_major=False, **kwargs):
        self._init_recurrent(keras.layers.GRU, _arguments(locals()), kwargs)


LSTM = PopnnLSTM
GRU = PopnnGRU


@_register
class RecomputationCheckpoint(keras.layers.Layer):
    """Marks values a recomputing pipeline stage keeps instead of recomputing.

    In a pipeline that recomputes (`IPUConfig.allow_recompute`) under
    `RecomputationMode.RecomputeAndBackpropagateInterleaved` (the Sequential
    schedule's `Auto`),
    a stage's forward op keeps its input and these values, and its backward
    op recomputes the rest from them: less recomputation for more stashed
    memory (the execution report's `stash_bytes` counts them). Under
    `RecomputeThenBackpropagate` (the Grouped and Interleaved schedules'
    `Auto`) and without recomputation the layer changes nothing. The values
    pass through unchanged: the numbers are the same either way.

    Args:
        **kwargs: Keras layer arguments (`name`, ...).

    Example:

    >>> outputs = RecomputationCheckpoint()(hidden)
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True  # the values pass through, and so does their mask

    def call(self, inputs, **kwargs):
        return checkpoints.checkpoint(inputs)

    def compute_output_shape(self, input_shape):
        return input_shape


__all__ = [
    "Dropout",
    "Embedding",
    "GRU",
    "GroupNormalization",
    "InstanceNormalization",
    "LSTM",
    "LayerNormalization",
    "PopnnGRU",
    "PopnnLSTM",
    "RecomputationCheckpoint",
    "ipu_activation",
    "keras_seed",
    "poplar_hard_sigmoid",
    "seeded_initializer",
]

# Keras' import may have come while this module was imported: the registration ends here.
layer_registration.complete(__name__)
