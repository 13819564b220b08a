"""`ipu.rnn_ops`: the time-major Popnn layers equal Keras' own or a NumPy recurrence.

Seed 002 §18.14.9: `PopnnLSTM`, `PopnnGRU`, `PopnnDynamicGRU` and `PopnnAUGRU`,
called on `[time, batch, features]` and returning `(outputs, output_state)`.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.ops import rnn_ops

from conftest import assert_weights_close

T, B, F, U = 5, 3, 4, 6


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(T, B, F)).astype(np.float32), rng


def _batch_major(x):
    return np.swapaxes(np.asarray(x), 0, 1)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _numpy_augru(x, scores, lengths, kernel, recurrent, bias, reset_after):
    """Popnn's AUGRU step by step; `scores` of zero make it a GRU (Keras' gate layout)."""
    bias = np.stack([bias, np.zeros_like(bias)]) if bias.ndim == 1 else bias
    h = np.zeros((x.shape[1], U), np.float32)
    outputs = np.zeros((x.shape[0], x.shape[1], U), np.float32)
    for t in range(x.shape[0]):
        xz, xr, xh = np.split(x[t] @ kernel + bias[0], 3, axis=-1)
        rz, rr, rh = np.split(recurrent, 3, axis=-1)
        bz, br, bh = np.split(bias[1], 3)
        z = _sigmoid(xz + h @ rz + bz)
        r = _sigmoid(xr + h @ rr + br)
        c = np.tanh(xh + (r * (h @ rh + bh) if reset_after else (r * h) @ rh))
        z = (1 - scores[:, t:t + 1]) * z
        new = z * h + (1 - z) * c
        live = (t < lengths)[:, None]
        h = np.where(live, new, h)
        outputs[t] = np.where(live, new, 0)
    return outputs, h


def test_lstm_equals_keras_and_keeps_tensorflows_state_order():
    x, rng = _inputs()
    layer = rnn_ops.PopnnLSTM(U, seed=3)
    c0, h0 = (rng.normal(size=(B, U)).astype(np.float32) for _ in range(2))
    outputs, state = layer(x, rnn_ops.LSTMStateTuple(c0, h0))
    assert isinstance(state, rnn_ops.LSTMStateTuple) and outputs.shape == (T, B, U)

    reference = keras.layers.LSTM(U, return_sequences=True, return_state=True,
                                  unit_forget_bias=False)
    reference.build((B, T, F))
    reference.set_weights(layer.get_weights())
    expected, h, c = reference(_batch_major(x), initial_state=[h0, c0])
    np.testing.assert_allclose(outputs, _batch_major(expected), atol=1e-6)
    np.testing.assert_allclose(state.c, c, atol=1e-6)
    np.testing.assert_allclose(state.h, h, atol=1e-6)
    assert layer.state_shape(B) == ([B, U], [B, U])


@pytest.mark.parametrize("reset_after", [False, True])
def test_gru_equals_keras_with_the_same_reset_convention(reset_after):
    x, _ = _inputs(1)
    layer = rnn_ops.PopnnGRU(U, reset_after=reset_after)
    outputs, state = layer(x)
    reference = keras.layers.GRU(U, return_sequences=True, return_state=True,
                                 reset_after=reset_after)
    reference.build((B, T, F))
    reference.set_weights(layer.get_weights())
    expected, h = reference(_batch_major(x))
    np.testing.assert_allclose(outputs, _batch_major(expected), atol=1e-6)
    np.testing.assert_allclose(state, h, atol=1e-6)


@pytest.mark.parametrize("time_major", [True, False])
def test_dynamic_gru_stops_each_entry_at_its_length(time_major):
    x, _ = _inputs(2)
    lengths = np.array([5, 2, 3])
    layer = rnn_ops.PopnnDynamicGRU(U)
    inputs = x if time_major else _batch_major(x)
    outputs, state = layer(inputs, lengths, None, True, time_major)
    assert outputs.shape == (T, B, U)  # time-major either way, as IPU TensorFlow's
    kernel, recurrent, bias = layer.get_weights()
    np.testing.assert_array_equal(bias, [1] * 2 * U + [0] * U)  # Popnn's gate biases
    expected, h = _numpy_augru(x, np.zeros((B, T)), lengths, kernel, recurrent, bias, False)
    np.testing.assert_allclose(outputs, expected, atol=1e-5)
    np.testing.assert_allclose(state, h, atol=1e-5)
    assert (np.asarray(outputs)[2:, 1] == 0).all()  # entry 1 stops after two steps


@pytest.mark.parametrize("layer", [rnn_ops.PopnnDynamicGRU, rnn_ops.PopnnAUGRU])
def test_reset_after_starts_the_recurrent_gate_biases_as_the_input_ones(layer):
    # IPU TensorFlow duplicates the [3, U] biases: before, the recurrent row started at zeros.
    layer = layer(U, reset_after=True)
    x, _ = _inputs(2)
    args = (np.zeros((T, B), np.float32),) if isinstance(layer, rnn_ops.PopnnAUGRU) else ()
    layer(x, np.array([T] * B), *args)
    np.testing.assert_array_equal(layer.get_weights()[2], [[1] * 2 * U + [0] * U] * 2)


@pytest.mark.parametrize("reset_after", [False, True])
@pytest.mark.parametrize("time_major", [True, False])
def test_augru_scales_the_update_gate_by_the_attention(reset_after, time_major):
    x, rng = _inputs(3)
    lengths = np.array([5, 4, 1])
    scores = rng.random((B, T)).astype(np.float32)
    layer = rnn_ops.PopnnAUGRU(U, reset_after=reset_after,
                               bias_initializer=keras.initializers.RandomNormal(seed=1))
    # The scores are laid out as the inputs: [time, batch], or [batch, time].
    if time_major:
        outputs, state = layer(x, lengths, scores.T)
    else:
        outputs, state = layer(_batch_major(x), lengths, scores, time_major=False)
    expected, h = _numpy_augru(x, scores, lengths, *layer.get_weights(), reset_after)
    np.testing.assert_allclose(outputs, expected, atol=1e-5)
    np.testing.assert_allclose(state, h, atol=1e-5)

    # Zero attention is the plain (dynamic) GRU with the same weights.
    gru = rnn_ops.PopnnDynamicGRU(U, reset_after=reset_after)
    gru(x, lengths)
    gru.set_weights(layer.get_weights())
    np.testing.assert_allclose(layer(x, lengths, np.zeros((T, B)))[1], gru(x, lengths)[1],
                               atol=1e-6)
    # Scores laid out as the seed's [batch, time] for time-major inputs are named, not
    # refused by an unrelated concatenation error.
    with pytest.raises(ValueError, match=r"attention_score must be \[time, batch\], the "
                                         rf"inputs' leading axes \({T}, {B}\)"):
        layer(x, lengths, scores)


@pytest.mark.parametrize("kind, gates", [("LSTM", 4), ("AUGRU", 3)])
def test_input_and_recurrent_weights_are_one_packed_draw(kind, gates):
    # With as many inputs as units, two draws of one seeded initializer would be equal.
    # (The AUGRU drew two, with two fan-ins.)
    layer = getattr(rnn_ops, f"Popnn{kind}")(U, seed=5)
    x = np.zeros((T, B, U), np.float32)
    if kind == "AUGRU":
        layer(x, np.full(B, T, np.int32), np.zeros((T, B), np.float32))
    else:
        layer(x)
    kernel, recurrent = layer.get_weights()[:2]
    assert not np.allclose(kernel, recurrent)
    packed = keras.initializers.GlorotUniform(seed=5)((2 * U, gates * U))
    np.testing.assert_allclose(np.concatenate([kernel, recurrent]), packed, atol=1e-7)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a_keras_mask_on_the_inputs_is_not_applied(kind):
    # IPU TensorFlow's rnn_ops know no Keras masks: before, the mask of a dynamic GRU's
    # outputs (or an Embedding's) reached the Keras layer inside, which skipped steps.
    x, _ = _inputs()
    first = rnn_ops.PopnnDynamicGRU(F, seed=1)
    masked, _ = first(x, np.array([5, 2, 1], np.int32))
    second = getattr(rnn_ops, f"Popnn{kind}")(U, seed=2)
    fed_masked = second(masked)
    fed_plain = second(np.array(masked))
    for got, want in zip(keras.tree.flatten(fed_masked), keras.tree.flatten(fed_plain)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert getattr(masked, "_keras_mask", None) is None


def test_initial_states_are_checked():
    x, _ = _inputs()
    with pytest.raises(ValueError, match=r"initial state must be \[batch_size, num_units\] = "
                                         r"\[3, 6\], got \[3, 5\]"):
        rnn_ops.PopnnGRU(U)(x, np.zeros((B, 5), np.float32))
    with pytest.raises(ValueError, match="must be an LSTMStateTuple"):
        rnn_ops.PopnnLSTM(U)(x, np.zeros((B, U), np.float32))


@pytest.mark.parametrize("seq_len", [[5, 2, 1, 1], [[5, 2, 1]]])
def test_sequence_lengths_are_checked(seq_len):
    # Before: a broadcasting error from inside Keras' GRU, or scan's leading axis sizes.
    x, _ = _inputs()
    shape = list(np.shape(seq_len))
    with pytest.raises(ValueError, match=rf"seq_len must be \[batch_size\] = \[{B}\].* got "
                                         rf"{re.escape(str(shape))}"):
        rnn_ops.PopnnDynamicGRU(U)(x, np.array(seq_len, np.int32))
    with pytest.raises(ValueError, match=r"seq_len must be \[batch_size\]"):
        rnn_ops.PopnnAUGRU(U)(x, np.array(seq_len, np.int32), np.ones(x.shape[:2], np.float32))


@pytest.mark.parametrize("seq_len", [[2.7, 2, 1], [5, -1, 1]])
def test_sequence_lengths_are_whole_steps(seq_len):
    # Before: 2.7 ran as 2 steps, silently.
    x, _ = _inputs()
    with pytest.raises(ValueError, match=r"seq_len must be whole numbers of steps, 0 or more, "
                                         + re.escape(f"got [{', '.join(map(str, seq_len))}]")):
        rnn_ops.PopnnDynamicGRU(U)(x, np.array(seq_len, np.float32))
    outputs, _ = rnn_ops.PopnnDynamicGRU(U, seed=1)(x, np.array([2.0, 2.0, 1.0], np.float32))
    np.testing.assert_array_equal(outputs, rnn_ops.PopnnDynamicGRU(U, seed=1)(
        x, np.array([2, 2, 1], np.int32))[0])


def test_hard_sigmoid_is_poplars():
    x, _ = _inputs(4)
    layer = rnn_ops.PopnnGRU(U, recurrent_activation="hard_sigmoid")
    outputs, _ = layer(x)
    reference = keras.layers.GRU(U, return_sequences=True, reset_after=False,
                                 recurrent_activation=lambda v: keras.ops.clip(0.2 * v + 0.5, 0, 1))
    reference.build((B, T, F))
    reference.set_weights(layer.get_weights())
    np.testing.assert_allclose(outputs, _batch_major(reference(_batch_major(x))), atol=1e-6)


@pytest.mark.parametrize("make, message", [
    (lambda: rnn_ops.PopnnLSTM(0), "num_units must be a positive int, got 0"),
    (lambda: rnn_ops.PopnnGRU(4, activation="gelu"),
     "activation must be one of 'tanh', 'relu', 'softmax', 'sigmoid', 'hard_sigmoid'"),
    (lambda: rnn_ops.PopnnGRU(4, recurrent_activation="relu"), "recurrent_activation must be"),
    (lambda: rnn_ops.PopnnAUGRU(4, dtype="float64"), "dtype must be one of 'float16'"),
    (lambda: rnn_ops.PopnnGRU(4, partials_dtype="int8"), "partials_dtype must be one of"),
    (lambda: rnn_ops.PopnnLSTM(4)(np.zeros((3, 4), np.float32)),
     r"takes \[time, batch, input_size\] inputs"),
])
def test_bad_arguments_say_what_is_valid(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_float16_layers_compute_in_float16():
    x, _ = _inputs(5)
    outputs, state = rnn_ops.PopnnLSTM(U, dtype=np.float16)(x.astype(np.float16))
    assert outputs.dtype == "float16" and state.h.dtype == "float16"


def test_the_config_round_trips():
    layer = rnn_ops.PopnnAUGRU(U, partials_dtype="float16", seed=7, reset_after=True,
                               activation="relu", name="augru")
    again = rnn_ops.PopnnAUGRU.from_config(layer.get_config())
    assert again.get_config() == layer.get_config()
    assert keras.saving.get_registered_object("keras_ipu.rnn_ops>PopnnAUGRU") is \
        rnn_ops.PopnnAUGRU


class _Interest(keras.Model):
    """DIEN's interest evolution in miniature: an AUGRU over attention-scored behaviour."""

    def __init__(self):
        super().__init__()
        self.augru = ipu.rnn_ops.PopnnAUGRU(U, seed=2)
        self.head = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3))

    def call(self, inputs):
        sequences, scores, lengths = inputs
        _, state = self.augru(sequences, lengths, scores, time_major=False)
        return self.head(state)


def test_a_model_with_an_augru_trains_on_an_ipu_as_in_plain_keras():
    rng = np.random.default_rng(6)
    sequences = rng.normal(size=(16, T, F)).astype(np.float32)
    scores = rng.random((16, T)).astype(np.float32)
    lengths = rng.integers(1, T + 1, 16).astype(np.int32)
    y = rng.normal(size=(16, 1)).astype(np.float32)

    def build():
        model = _Interest()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=2)
        return model

    plain = build()
    plain.fit((sequences, scores, lengths), y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = build()
    model.fit((sequences, scores, lengths), y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-5)


def test_a_stateful_layer_carries_its_state_in_strategy_run_not_in_predict_as_keras(strategy):
    # As docs/porting.md says: Keras' state variables are none of the model's, so fit and
    # predict start each batch from the traced state, in plain Keras 3 on JAX too.
    x = np.random.default_rng(0).random((2, 3, 2), np.float32)

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input(batch_shape=(2, 3, 2))
        return keras.Model(inputs, ipu.keras.layers.PopnnLSTM(4, stateful=True, name="rnn")(
            inputs))

    plain = build()
    with strategy.scope():
        model = build()
    run = [np.asarray(strategy.run(model, args=(x,))) for _ in range(3)]
    eager = [np.asarray(plain(x)) for _ in range(3)]  # Keras carries it eagerly
    np.testing.assert_allclose(run, eager, rtol=1e-5, atol=1e-6)
    assert not np.allclose(run[0], run[1])  # carried
    for m in (plain, model):
        m.get_layer("rnn").reset_state()
        m.compile(loss="mse", steps_per_execution=3)
    three = np.concatenate([x, x, x])
    expected = plain.predict(three, batch_size=2, verbose=0)
    got = model.predict(three, batch_size=2, verbose=0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:2], got[4:], rtol=1e-6)  # each batch from the start
