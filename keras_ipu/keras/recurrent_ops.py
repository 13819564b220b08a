"""`ipu.rnn_ops`: IPU TensorFlow's time-major Popnn recurrent layers, as Keras 3 layers.

Each layer is called as IPU TensorFlow's is, on `[time, batch, features]`
sequences, and returns `(outputs, output_state)`:

- `PopnnLSTM(num_units)(inputs, initial_state=None, training=True)`: the
  state is an `LSTMStateTuple(c, h)`, as TensorFlow's.
- `PopnnGRU(num_units)(inputs, initial_state=None, training=True)`.
- `PopnnDynamicGRU(num_units)(inputs, seq_len, initial_state=None,
  training=True, time_major=True)`: entry `b` runs its first `seq_len[b]`
  steps; its outputs after them are zeros and its state is the one of its
  last step. With `time_major=False` the inputs are `[batch, time,
  features]`; the outputs are `[time, batch, units]` either way, as IPU
  TensorFlow's.
- `PopnnAUGRU(num_units)(inputs, seq_len, attention_score, ...)`: the GRU
  whose update gate is scaled by an attention score per step (Popnn's
  AUGRU, built for the DIEN recommender): `u' = (1 - a_t) * u`,
  `h_t = u' * h_{t-1} + (1 - u') * c_t`, so a step with score 1 takes the
  candidate whole. The scores are laid out
  as the inputs: `[time, batch]`, or `[batch, time]` with
  `time_major=False`.

The gates follow Popnn's defaults (GRU reset gate applied before the
recurrent matmul unless `reset_after=True`; no forget-gate bias offset),
the weights start from `weights_initializer` (Glorot uniform, with `seed`)
and the biases from `bias_initializer` (by default zeros, and for the
dynamic GRU and the AUGRU ones for the update and reset gates, as IPU
TensorFlow's), and `"hard_sigmoid"` is Poplar's `clip(0.2 * x + 0.5, 0,
1)`. The weights are Keras' (`kernel`, `recurrent_kernel`, `bias`), not
Popnn's packed layout.

Example:

```python
lstm = ipu.rnn_ops.PopnnLSTM(64)
outputs, (c, h) = lstm(inputs)          # inputs: [time, batch, features]
```
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import keras
import numpy as np
from keras import ops
from keras.src.backend.common import masking

from keras_ipu import layer_registration
from keras_ipu.keras.layers import LSTMStateTuple, float_dtype_choice, poplar_hard_sigmoid
from keras_ipu.keras.layers import PopnnGRU as _KerasGRU
from keras_ipu.keras.layers import PopnnLSTM as _KerasLSTM

_register = keras.saving.register_keras_serializable(package="keras_ipu.rnn_ops")

_ACTIVATIONS = {"tanh": "tanh", "relu": "relu", "softmax": "softmax", "sigmoid": "sigmoid",
                "hard_sigmoid": poplar_hard_sigmoid}
_RECURRENT_ACTIVATIONS = ("tanh", "softmax", "sigmoid", "hard_sigmoid")


def _choice(argument: str, value: Any, valid: tuple) -> str:
    if not isinstance(value, str) or value not in valid:
        raise ValueError(f"{argument} must be one of {', '.join(map(repr, valid))}, got "
                         f"{value!r}.")
    return value



class _PackedWeights:
    """One `[input_size + units, gates * units]` draw of the weights initializer, cut in two.

    Popnn keeps a layer's input and recurrent weights as one matrix drawn
    once (a Glorot initializer's fan-in is `input_size + units`); Keras
    keeps two. Keras builds the input kernel first: its call draws the whole
    matrix, and the recurrent kernel is the rest of that draw.
    """

    def __init__(self, initializer: Any, units: int):
        self._initializer, self._units, self._rest = initializer, units, None

    def input_part(self, shape, dtype=None):
        packed = self._initializer((shape[0] + self._units, *shape[1:]), dtype=dtype)
        self._rest = packed[shape[0]:]
        return packed[: shape[0]]

    def state_part(self, shape, dtype=None):
        rest, self._rest = self._rest, None
        if rest is None or tuple(rest.shape) != tuple(shape):
            return self._initializer(shape, dtype=dtype)  # built on its own
        return rest


class _PopnnRecurrent(keras.layers.Layer):
    """The IPU TensorFlow constructor and checks shared by the four layers."""

    def __init__(self, num_units, dtype="float32", partials_dtype="float32", seed=None,
                 weights_initializer=None, bias_initializer=None, activation="tanh",
                 recurrent_activation="sigmoid", name=None, **kwargs):
        # Everything is checked before Layer.__init__ names the layer.
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"num_units must be a positive int, got {num_units!r}.")
        dtype = float_dtype_choice("dtype", dtype)
        partials_dtype = float_dtype_choice("partials_dtype", partials_dtype)
        activation = _choice("activation", activation, tuple(_ACTIVATIONS))
        recurrent_activation = _choice("recurrent_activation", recurrent_activation,
                                       _RECURRENT_ACTIVATIONS)
        super().__init__(dtype=dtype, name=name, **kwargs)
        self.num_units = num_units
        self.partials_dtype = partials_dtype
        self.seed = seed
        self.activation = activation
        self.recurrent_activation = recurrent_activation
        self.weights_initializer = keras.initializers.get(
            weights_initializer or keras.initializers.GlorotUniform(seed=seed))
        # None: the layer's own default (`_default_bias`).
        self.bias_initializer = (None if bias_initializer is None
                                 else keras.initializers.get(bias_initializer))

    def __call__(self, inputs, *args, **kwargs):
        # IPU TensorFlow's calls pass lengths, scores, states and flags
        # positionally; Keras 3 takes only tensors that way: pass them by name.
        names = list(inspect.signature(self.call).parameters)[1:]
        return super().__call__(inputs, **dict(zip(names, args)), **kwargs)

    _default_bias: Any = "zeros"

    def _biases(self) -> Any:
        """The initializer the biases start from."""
        return keras.initializers.get(self.bias_initializer or self._default_bias)

    def _recurrent_arguments(self) -> dict:
        """The keyword arguments of the Keras recurrent layer inside."""
        weights = _PackedWeights(self.weights_initializer, self.num_units)
        return dict(
            units=self.num_units, activation=_ACTIVATIONS[self.activation],
            recurrent_activation=_ACTIVATIONS[self.recurrent_activation],
            kernel_initializer=weights.input_part, recurrent_initializer=weights.state_part,
            bias_initializer=self._biases(), partials_dtype=self.partials_dtype,
            return_sequences=True, return_state=True, time_major=True,
            zero_output_for_mask=True, dtype=self.dtype_policy, name="recurrent")

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[-1] is None:
            raise ValueError(f"{type(self).__name__} takes [time, batch, input_size] inputs with "
                             f"a known input_size, got shape {tuple(input_shape)}.")
        self.recurrent.build(input_shape)

    def _unmasked(self, inputs, **kwargs):
        """The Keras layer inside on `inputs`, blind to a Keras mask they carry.

        IPU TensorFlow's `rnn_ops` know no Keras masks (a dynamic GRU takes
        `seq_len`): Keras would hand the layer inside the mask of an
        `Embedding(mask_zero=True)` or of a dynamic GRU's outputs, and skip
        steps. Their outputs carry no mask either.
        """
        results = self.recurrent(ops.copy(inputs), **kwargs)  # a copy: the caller's keeps it
        for value in keras.tree.flatten(results):
            masking.set_keras_mask(value, None)
        return results

    def _checked_state(self, state, inputs):
        """A state tensor, after checking it is `[batch_size, num_units]`."""
        state = ops.convert_to_tensor(state)
        batch = ops.shape(inputs)[1]
        if tuple(state.shape) != (batch, self.num_units):
            raise ValueError(f"{self.name}: an initial state must be [batch_size, num_units] = "
                             f"{[batch, self.num_units]}, got {list(state.shape)}.")
        return state

    def state_shape(self, batch_size: int) -> list[int]:
        """The shape of one state tensor, `[batch_size, num_units]`.

        Args:
            batch_size: The batch size.

        Returns:
            `[batch_size, num_units]`.
        """
        return [batch_size, self.num_units]

    def get_config(self):
        config = super().get_config()
        config.update(
            num_units=self.num_units, partials_dtype=self.partials_dtype, seed=self.seed,
            weights_initializer=keras.initializers.serialize(self.weights_initializer),
            bias_initializer=(None if self.bias_initializer is None
                              else keras.initializers.serialize(self.bias_initializer)),
            activation=self.activation, recurrent_activation=self.recurrent_activation)
        config["dtype"] = self.dtype_policy.name
        return config


def _gate_biases(shape, dtype=None):
    """Ones for the update and reset gates' biases, zeros for the candidate's (Keras' layout).

    With `reset_after`'s separate recurrent biases, both rows start so, as
    IPU TensorFlow's `rnn_ops` duplicate the biases.
    """
    units = shape[-1] // 3
    row = ops.concatenate([ops.ones((2 * units,), dtype), ops.zeros((units,), dtype)])
    return row if len(shape) == 1 else ops.stack([row, row])


def _sequence_mask(seq_len, steps: int):
    """`[time, batch]`: whether each step is within its entry's length."""
    return ops.arange(steps)[:, None] < ops.cast(seq_len, "int32")[None, :]


@_register
class PopnnLSTM(_PopnnRecurrent):
    """A time-major LSTM layer, as IPU TensorFlow's `rnn_ops.PopnnLSTM`.

    Args:
        num_units: Units of the LSTM.
        dtype: `"float16"` or `"float32"`, of the weights and computation.
        partials_dtype: Poplar's partial sums' type; checked and kept (the
            device model sums in the computation's type).
        seed: Seeds the default Glorot uniform `weights_initializer`.
        weights_initializer: Initializer of both weight matrices.
        bias_initializer: Initializer of the biases (zeros by default).
        activation: `"tanh"`, `"relu"`, `"softmax"`, `"sigmoid"` or
            `"hard_sigmoid"`.
        recurrent_activation: `"tanh"`, `"softmax"`, `"sigmoid"` or
            `"hard_sigmoid"`.
        name: The layer's name.
        **kwargs: Other `keras.layers.Layer` arguments.

    Raises:
        ValueError: For a value outside those listed.

    Example:

    >>> outputs, state = PopnnLSTM(16)(inputs)   # state.c, state.h: [batch, 16]
    """

    def __init__(self, num_units, dtype="float32", partials_dtype="float32", seed=None,
                 weights_initializer=None, bias_initializer=None, activation="tanh",
                 recurrent_activation="sigmoid", name=None, **kwargs):
        super().__init__(num_units, dtype, partials_dtype, seed, weights_initializer,
                         bias_initializer, activation, recurrent_activation, name, **kwargs)
        self.recurrent = _KerasLSTM(unit_forget_bias=False, **self._recurrent_arguments())

    def call(self, inputs, initial_state=None, training=True):
        if initial_state is not None:
            if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
                raise ValueError(f"{self.name}: initial_state must be an LSTMStateTuple(c, h), "
                                 f"got {type(initial_state).__name__}.")
            c, h = (self._checked_state(part, inputs) for part in initial_state)
            initial_state = [h, c]
        outputs, h, c = self._unmasked(inputs, initial_state=initial_state, training=training)
        return outputs, LSTMStateTuple(c, h)

    def state_shape(self, batch_size: int) -> tuple[list[int], list[int]]:
        """The shapes of the state's `c` and `h`, each `[batch_size, num_units]`.

        Args:
            batch_size: The batch size.

        Returns:
            A pair of shapes.
        """
        return (super().state_shape(batch_size), super().state_shape(batch_size))


class _GRUBase(_PopnnRecurrent):
    def __init__(self, num_units, dtype="float32", partials_dtype="float32", seed=None,
                 weights_initializer=None, bias_initializer=None, activation="tanh",
                 recurrent_activation="sigmoid", name=None, reset_after=False, **kwargs):
        if not isinstance(reset_after, bool):
            raise TypeError(f"reset_after must be a bool, got {reset_after!r}.")
        super().__init__(num_units, dtype, partials_dtype, seed, weights_initializer,
                         bias_initializer, activation, recurrent_activation, name, **kwargs)
        self.reset_after = reset_after
        self.recurrent = self._inner()

    def _inner(self) -> keras.layers.Layer:
        return _KerasGRU(reset_after=self.reset_after, **self._recurrent_arguments())

    def _run(self, inputs, seq_len, initial_state, training, time_major, extra=None):
        """Runs time-major; `extra`, a time-major per-step input, goes beside the features."""
        if not time_major:
            inputs = ops.swapaxes(inputs, 0, 1)
        mask = (None if seq_len is None
                else _sequence_mask(self._checked_lengths(seq_len, inputs), ops.shape(inputs)[0]))
        if extra is not None:
            inputs = ops.concatenate([inputs, ops.cast(extra, inputs.dtype)], axis=-1)
        if initial_state is not None:
            initial_state = [self._checked_state(initial_state, inputs)]
        outputs, state = self._unmasked(inputs, initial_state=initial_state, mask=mask,
                                        training=training)
        return outputs, state  # time-major whatever the inputs, as IPU TensorFlow's

    def _checked_lengths(self, seq_len, inputs):
        """`seq_len`, after checking it is `[batch_size]` (time-major `inputs`)."""
        seq_len = ops.convert_to_tensor(seq_len)
        batch = ops.shape(inputs)[1]
        if tuple(seq_len.shape) != (batch,):
            raise ValueError(f"{self.name}: seq_len must be [batch_size] = [{batch}], one length "
                             f"per sequence, got {list(seq_len.shape)}.")
        # Where the values are known (not traced): whole steps, as an int32 tensor holds.
        if isinstance(seq_len, jax.Array) and not isinstance(seq_len, jax.core.Tracer):
            lengths = np.asarray(seq_len)
            if (lengths != np.round(lengths)).any() or (lengths < 0).any():
                raise ValueError(f"{self.name}: seq_len must be whole numbers of steps, 0 or "
                                 f"more, got [{', '.join(f'{n:g}' for n in lengths.tolist())}].")
        return seq_len

    def get_config(self):
        return {**super().get_config(), "reset_after": self.reset_after}


_GRU_DOC_ARGS = """
    Args:
        num_units: Units of the GRU.
        dtype: `"float16"` or `"float32"`, of the weights and computation.
        partials_dtype: Poplar's partial sums' type; checked and kept.
        seed: Seeds the default Glorot uniform `weights_initializer`.
        weights_initializer: Initializer of both weight matrices.
        bias_initializer: Initializer of the biases (by default zeros; for
            the dynamic GRU and the AUGRU, ones for the update and reset
            gates and zeros for the candidate).
        activation: `"tanh"`, `"relu"`, `"softmax"`, `"sigmoid"` or
            `"hard_sigmoid"`.
        recurrent_activation: `"tanh"`, `"softmax"`, `"sigmoid"` or
            `"hard_sigmoid"`.
        name: The layer's name.
        reset_after: Apply the reset gate after the recurrent matmul
            (Keras' default) instead of before it (TensorFlow's and Popnn's).
        **kwargs: Other `keras.layers.Layer` arguments.

    Raises:
        ValueError: For a value outside those listed.
"""


@_register
class PopnnGRU(_GRUBase):
    __doc__ = f"""A time-major GRU layer, as IPU TensorFlow's `rnn_ops.PopnnGRU`.
{_GRU_DOC_ARGS}
    Example:

    >>> outputs, state = PopnnGRU(16)(inputs)   # state: [batch, 16]
    """

    def call(self, inputs, initial_state=None, training=True):
        return self._run(inputs, None, initial_state, training, True)


@_register
class PopnnDynamicGRU(_GRUBase):
    __doc__ = f"""A time-major GRU with a length per sequence (`rnn_ops.PopnnDynamicGRU`).

    Steps after an entry's `seq_len` do not change its state; their outputs
    are zeros.
{_GRU_DOC_ARGS}
    Example:

    >>> outputs, state = PopnnDynamicGRU(16)(inputs, seq_len=[5, 3])
    """

    _default_bias = staticmethod(lambda shape, dtype=None: _gate_biases(shape, dtype))

    def call(self, inputs, seq_len, initial_state=None, training=True, time_major=True):
        return self._run(inputs, seq_len, initial_state, training, time_major)


@_register
class PopnnAUGRU(_GRUBase):
    __doc__ = f"""A GRU with attentional update gate (Popnn's AUGRU; `rnn_ops.PopnnAUGRU`).

    With the attention score `a_t` of each step, the update gate `u`
    becomes `u' = (1 - a_t) * u` and `h_t = u' * h_(t-1) + (1 - u') * c_t`.
    Steps after an entry's `seq_len` do not change its state; their
    outputs are zeros.
{_GRU_DOC_ARGS}
    Example:

    >>> outputs, state = PopnnAUGRU(16)(inputs, seq_len, attention_score)
    """

    _default_bias = staticmethod(lambda shape, dtype=None: _gate_biases(shape, dtype))

    def _inner(self) -> keras.layers.Layer:
        weights = _PackedWeights(self.weights_initializer, self.num_units)
        cell = AttentionGRUCell(
            self.num_units, activation=_ACTIVATIONS[self.activation],
            recurrent_activation=_ACTIVATIONS[self.recurrent_activation],
            # One packed draw, as the other layers' (`_PackedWeights`).
            kernel_initializer=weights.input_part, recurrent_initializer=weights.state_part,
            bias_initializer=self._biases(), reset_after=self.reset_after,
            dtype=self.dtype_policy)
        return _TimeMajorRNN(cell, return_sequences=True, return_state=True,
                             zero_output_for_mask=True, dtype=self.dtype_policy,
                             name="recurrent")

    def build(self, input_shape):
        super().build((*input_shape[:-1], input_shape[-1] + 1))  # + the attention score

    def call(self, inputs, seq_len, attention_score, initial_state=None, training=True,
             time_major=True):
        _check_attention_layout(inputs, attention_score, time_major)
        # The score goes in beside each step's features, laid out as they are.
        scores = attention_score if time_major else ops.swapaxes(attention_score, 0, 1)
        scores = ops.expand_dims(scores, -1)
        return self._run(inputs, seq_len, initial_state, training, time_major, extra=scores)


def _check_attention_layout(inputs, attention_score, time_major: bool) -> None:
    """Raises `ValueError` unless the scores are `[time, batch]` (`[batch, time]` when
    `time_major=False`), the inputs' leading axes."""
    expected = tuple(inputs.shape[:2])
    given = tuple(attention_score.shape)
    if len(given) != 2 or any(a is not None and b is not None and a != b
                              for a, b in zip(given, expected)):
        layout = "[time, batch]" if time_major else "[batch, time]"
        raise ValueError(
            f"attention_score must be {layout}, the inputs' leading axes {expected} "
            f"(time_major={time_major}), got shape {given}.")


class _TimeMajorRNN(keras.layers.RNN):
    """`keras.layers.RNN` on `[time, batch, ...]` sequences and `[time, batch]` masks."""

    def build(self, sequences_shape, initial_state_shape=None):
        super().build((sequences_shape[1], sequences_shape[0], *sequences_shape[2:]))

    def call(self, sequences, initial_state=None, mask=None, training=False):
        outputs, *states = super().call(
            ops.swapaxes(sequences, 0, 1), initial_state=initial_state,
            mask=None if mask is None else ops.swapaxes(mask, 0, 1), training=training)
        return [ops.swapaxes(outputs, 0, 1), *states]


@_register
class AttentionGRUCell(keras.layers.GRUCell):
    """A GRU cell whose last input feature is the step's attention score (for `PopnnAUGRU`).

    Args:
        units: Units of the cell.
        **kwargs: `keras.layers.GRUCell` arguments.

    Example:

    >>> keras.layers.RNN(AttentionGRUCell(8))(concatenated_features_and_scores)
    """

    def build(self, input_shape):
        super().build((*input_shape[:-1], input_shape[-1] - 1))

    def call(self, inputs, states, training=False):
        features, score = inputs[..., :-1], inputs[..., -1:]
        h_prev = states[0] if isinstance(states, (list, tuple)) else states
        x_z, x_r, x_h = ops.split(ops.matmul(features, self.kernel), 3, axis=-1)
        recurrent_z, recurrent_r, recurrent_h = ops.split(self.recurrent_kernel, 3, axis=-1)
        # As [input bias, recurrent bias], whatever the cell keeps.
        if not self.use_bias:
            bias = ops.zeros((2, 3 * self.units), features.dtype)
        elif not self.reset_after:
            bias = ops.stack([self.bias, ops.zeros((3 * self.units,), features.dtype)])
        else:
            bias = ops.convert_to_tensor(self.bias)
        (b_z, b_r, b_h), (rb_z, rb_r, rb_h) = (ops.split(bias[i], 3) for i in range(2))
        z = self.recurrent_activation(x_z + b_z + ops.matmul(h_prev, recurrent_z) + rb_z)
        r = self.recurrent_activation(x_r + b_r + ops.matmul(h_prev, recurrent_r) + rb_r)
        if self.reset_after:
            candidate_recurrent = r * (ops.matmul(h_prev, recurrent_h) + rb_h)
        else:
            candidate_recurrent = ops.matmul(r * h_prev, recurrent_h)
        candidate = self.activation(x_h + b_h + candidate_recurrent)
        z = (1.0 - score) * z
        h = z * h_prev + (1.0 - z) * candidate
        return h, [h]


__all__ = ["AttentionGRUCell", "LSTMStateTuple", "PopnnAUGRU", "PopnnDynamicGRU", "PopnnGRU",
           "PopnnLSTM"]

# Keras' import may have come while this module was imported: the registration ends here.
layer_registration.complete(__name__)
