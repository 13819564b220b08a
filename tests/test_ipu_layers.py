"""`ipu.keras.layers`: IPU TensorFlow's Keras layers, computed as they document, trained on IPUs."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.keras import layers as ipu_layers

from conftest import assert_weights_close, configure


def _images(shape=(3, 4, 5, 6), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 3 + 1


def test_the_module_is_ipu_keras_layers_with_the_seeds_aliases():
    assert ipu.keras.layers is ipu_layers
    assert ipu.keras.layers.LSTM is ipu.keras.layers.PopnnLSTM
    assert ipu.keras.layers.GRU is ipu.keras.layers.PopnnGRU


def test_contiguous_group_normalization_equals_keras():
    x = _images()
    ours = ipu_layers.GroupNormalization(groups=3, strided_channel_grouping=False)
    keras_own = keras.layers.GroupNormalization(groups=3, epsilon=0.001)
    np.testing.assert_allclose(ours(x), keras_own(x), atol=1e-5)


def test_strided_group_normalization_groups_every_groups_th_channel():
    # Channel c is in group c % groups: Keras' contiguous groups over channels reordered.
    x, groups = _images(), 3
    order = [c for g in range(groups) for c in range(g, 6, groups)]
    keras_own = keras.layers.GroupNormalization(groups=groups, epsilon=0.001)
    expected = np.empty_like(x)
    expected[..., order] = keras.ops.convert_to_numpy(keras_own(x[..., order]))
    strided = ipu_layers.GroupNormalization(groups=groups)  # Poplar's default grouping
    np.testing.assert_allclose(strided(x), expected, atol=1e-5)
    contiguous = ipu_layers.GroupNormalization(groups=groups, strided_channel_grouping=False)
    assert not np.allclose(contiguous(x), expected, atol=1e-3)


def test_instance_normalization_normalizes_each_channel_of_each_sample():
    x = _images()
    mean = x.mean(axis=(1, 2), keepdims=True)
    expected = (x - mean) / np.sqrt(x.var(axis=(1, 2), keepdims=True) + 0.001)
    np.testing.assert_allclose(ipu_layers.InstanceNormalization()(x), expected, atol=1e-5)
    # Channels first: the same numbers, transposed.
    first = ipu_layers.InstanceNormalization(channels_axis=1)(np.moveaxis(x, -1, 1))
    np.testing.assert_allclose(np.moveaxis(keras.ops.convert_to_numpy(first), 1, -1),
                               expected, atol=1e-5)


def test_group_normalization_that_cannot_split_the_channels_says_why():
    with pytest.raises(ValueError, match="6 channels .* cannot be split into 4 groups"):
        ipu_layers.GroupNormalization(groups=4)(_images())


def test_layer_normalization_takes_the_ipu_arguments_and_equals_keras():
    x = _images((4, 7))
    ours = ipu_layers.LayerNormalization("float32", -1, 1e-5)
    np.testing.assert_allclose(ours(x), keras.layers.LayerNormalization(epsilon=1e-5)(x),
                               atol=1e-6)


def test_dropout_takes_a_seed_pair():
    x = np.ones((64, 32), np.float32)
    first = keras.ops.convert_to_numpy(ipu_layers.Dropout(0.5, seed=[1, 2])(x, training=True))
    again = keras.ops.convert_to_numpy(ipu_layers.Dropout(0.5, seed=(1, 2))(x, training=True))
    other = keras.ops.convert_to_numpy(ipu_layers.Dropout(0.5, seed=[2, 1])(x, training=True))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert set(np.unique(first)) == {0.0, 2.0} and 0.4 < (first == 0).mean() < 0.6
    np.testing.assert_array_equal(ipu_layers.Dropout(0.5, seed=[1, 2])(x), x)  # inference
    with pytest.raises(ValueError, match="pair of 32-bit integers, got"):
        ipu_layers.Dropout(0.5, seed=[1, 2, 3])


@pytest.mark.parametrize("layer_class", [ipu_layers.PopnnLSTM, ipu_layers.PopnnGRU])
def test_time_major_recurrent_layers_equal_batch_major_ones_transposed(layer_class):
    x = _images((5, 3, 4))  # [batch, time, features]
    batch_major = layer_class(6, return_sequences=True, return_state=True)
    outputs = batch_major(x)
    time_major = layer_class(6, return_sequences=True, return_state=True, time_major=True)
    time_major.build(np.swapaxes(x, 0, 1).shape)
    time_major.set_weights(batch_major.get_weights())
    swapped = time_major(np.swapaxes(x, 0, 1))
    np.testing.assert_allclose(np.swapaxes(keras.ops.convert_to_numpy(swapped[0]), 0, 1),
                               outputs[0], atol=1e-6)
    for ours, theirs in zip(swapped[1:], outputs[1:]):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
    # In a functional model the output shapes are time-major too.
    inputs = keras.Input((5, 4), batch_size=3)  # [time, batch, features]
    shapes = [tuple(t.shape) for t in layer_class(6, return_sequences=True, return_state=True,
                                                    time_major=True)(inputs)]
    assert shapes[0] == (3, 5, 6) and all(s == (5, 6) for s in shapes[1:])


@pytest.mark.parametrize("layer_class, states", [(ipu_layers.PopnnLSTM, 2),
                                                  (ipu_layers.PopnnGRU, 1)])
def test_recurrent_layers_refuse_a_bad_input_shape_or_initial_state(layer_class, states):
    with pytest.raises(ValueError, match=r"the input shape must be \[time, batch, features\] "
                                         r"with a known number of features, got \(2, 3\)"):
        layer_class(4, time_major=True).build((2, 3))
    with pytest.raises(ValueError, match=r"with a known number of features"):
        layer_class(4).build((2, 5, None))
    x = _images((2, 5, 3))  # [batch, time, features]
    wrong = [np.zeros((2, 5), "float32")] * states
    with pytest.raises(ValueError, match=rf"initial_state must be {states} states? of shape "
                                         r"\[2, 4\] \(batch, units\), got shapes \[\[2, 5\]"):
        layer_class(4)(x, initial_state=wrong)
    if states == 2:
        with pytest.raises(ValueError, match=r"initial_state must be 2 states"):
            layer_class(4)(x, initial_state=np.zeros((2, 4), "float32"))
    layer = layer_class(4)  # a valid state is taken: zeros are the default state
    zeros = [np.zeros((2, 4), "float32")] * states
    np.testing.assert_allclose(layer(x, initial_state=zeros), layer(x), atol=1e-6)
    assert not np.allclose(layer(x, initial_state=[z + 1 for z in zeros]), layer(x))


_RECURRENT = [ipu_layers.PopnnLSTM, ipu_layers.PopnnGRU]


@pytest.mark.parametrize("layer_class", _RECURRENT)
def test_seed_seeds_the_kernel_and_recurrent_initializers(layer_class):
    x = _images((2, 5, 3))

    def weights(**kwargs):
        layer = layer_class(4, **kwargs)
        layer.build(x.shape)
        return [keras.ops.convert_to_numpy(w) for w in (layer.cell.kernel,
                                                         layer.cell.recurrent_kernel)]

    kernel, recurrent = weights(seed=7)
    gates = 4 if layer_class is ipu_layers.PopnnLSTM else 3
    np.testing.assert_array_equal(kernel, keras.initializers.GlorotUniform(seed=7)((3, 4 * gates)))
    np.testing.assert_array_equal(recurrent,
                                  keras.initializers.Orthogonal(seed=7)((4, 4 * gates)))
    for again, first in zip(weights(seed=7), (kernel, recurrent)):
        np.testing.assert_array_equal(again, first)
    assert not np.allclose(weights(seed=8)[0], kernel)
    # A user's own seeded initializer keeps its seed.
    own = weights(seed=7, kernel_initializer=keras.initializers.GlorotUniform(seed=1))[0]
    np.testing.assert_array_equal(own, keras.initializers.GlorotUniform(seed=1)((3, 4 * gates)))


@pytest.mark.parametrize("layer_class", _RECURRENT)
def test_dropout_seed_alone_seeds_the_dropout_masks(layer_class):
    x = _images((2, 5, 3))

    def trained_outputs(**kwargs):
        layer = layer_class(4, dropout=0.5, **kwargs)
        layer.build(x.shape)
        layer.set_weights(reference.get_weights())
        return keras.ops.convert_to_numpy(layer(x, training=True))

    reference = layer_class(4)
    reference.build(x.shape)
    first = trained_outputs(dropout_seed=[1, 2], seed=1)
    np.testing.assert_array_equal(trained_outputs(dropout_seed=[1, 2], seed=2), first)
    np.testing.assert_array_equal(trained_outputs(dropout_seed=(1, 2)), first)
    assert not np.allclose(trained_outputs(dropout_seed=[2, 1], seed=1), first)
    config = layer_class(4, dropout_seed=np.array([1, 2]), seed=3).get_config()
    assert (config["dropout_seed"], config["seed"]) == ([1, 2], 3)


def test_unit_forget_bias_forces_zero_biases_but_the_forget_gates():
    x = _images((2, 5, 3))
    forced = ipu_layers.PopnnLSTM(4, bias_initializer="ones")  # unit_forget_bias=True
    forced.build(x.shape)
    np.testing.assert_array_equal(forced.cell.bias, np.repeat([0.0, 1.0, 0.0, 0.0], 4))
    assert keras.initializers.get(forced.get_config()["bias_initializer"]).__class__ is (
        keras.initializers.Zeros)
    kept = ipu_layers.PopnnLSTM(4, bias_initializer="ones", unit_forget_bias=False)
    kept.build(x.shape)
    np.testing.assert_array_equal(kept.cell.bias, np.ones(16))


def test_state_shape_is_the_shape_an_initial_state_takes():
    x = _images((2, 5, 3))
    lstm, gru = ipu_layers.PopnnLSTM(4, return_state=True), ipu_layers.PopnnGRU(6)
    assert lstm.state_shape(2) == ([2, 4], [2, 4])
    assert gru.state_shape(7) == [7, 6]
    _, *state = lstm(x)
    assert tuple(list(s.shape) for s in state) == lstm.state_shape(2)
    zeros = [np.zeros(shape, "float32") for shape in lstm.state_shape(2)]
    np.testing.assert_allclose(lstm(x, initial_state=zeros)[0], lstm(x)[0])


def test_an_lstm_state_tuple_is_read_by_name_and_a_list_in_keras_order(tmp_path):
    # The IPU layer documents `initial_state` as an LSTMStateTuple(c, h); Keras' list is [h, c].
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 4)).astype("float32")
    c, h = (rng.normal(size=(3, 6)).astype("float32") for _ in range(2))
    ours = ipu_layers.PopnnLSTM(6, return_state=True)
    ours.build(x.shape)
    keras_own = keras.layers.LSTM(6, return_state=True, recurrent_activation="sigmoid")
    keras_own.build(x.shape)
    keras_own.set_weights(ours.get_weights())
    expected = keras_own(x, initial_state=[h, c])
    for state in (ipu.rnn_ops.LSTMStateTuple(c=c, h=h), [h, c]):
        for got, want in zip(ours(x, initial_state=state), expected):
            np.testing.assert_allclose(got, want, atol=1e-6)
    inputs = [keras.Input((5, 4)), keras.Input((6,)), keras.Input((6,))]
    outputs = ipu_layers.PopnnLSTM(6)(inputs[0], initial_state=ipu.rnn_ops.LSTMStateTuple(
        c=inputs[1], h=inputs[2]))
    model = keras.Model(inputs, outputs)
    model.layers[-1].set_weights(ours.get_weights())
    np.testing.assert_allclose(model([x, c, h]), expected[0], atol=1e-6)
    # Saved, the call keeps its meaning (the tuple is recorded as Keras' [h, c]).
    model.save(tmp_path / "lstm.keras")
    np.testing.assert_allclose(keras.models.load_model(tmp_path / "lstm.keras")([x, c, h]),
                               expected[0], atol=1e-6)
    # Positionally, as IPU TensorFlow's call(inputs, training, initial_state).
    np.testing.assert_allclose(ours(x, False, ipu.rnn_ops.LSTMStateTuple(c=c, h=h))[0],
                               expected[0], atol=1e-6)


@pytest.mark.parametrize("layer_class", [ipu_layers.PopnnLSTM, ipu_layers.PopnnGRU])
def test_a_float16_layer_builds_with_the_default_orthogonal_weights(layer_class):
    # Keras' Orthogonal has no float16 QR on CPUs (plain Keras' LSTM fails the same
    # way); Popnn runs these layers in float16, as the seed's dtype argument says.
    layer = layer_class(4, dtype="float16", seed=3)
    outputs = layer(np.ones((2, 5, 3), "float16"))
    assert outputs.dtype == "float16" and layer.cell.recurrent_kernel.dtype == "float16"
    recurrent = np.asarray(layer.cell.recurrent_kernel, "float32")  # [units, gates × units]
    np.testing.assert_allclose(recurrent @ recurrent.T, np.eye(4), atol=2e-3)  # orthonormal rows
    float32 = layer_class(4, seed=3)
    float32(np.ones((2, 5, 3), "float32"))
    np.testing.assert_allclose(recurrent, float32.cell.recurrent_kernel, atol=1e-3)
    with pytest.raises(ValueError, match="partials_dtype must be one of 'float16', 'float32', "
                                         "got 'int32'"):
        layer_class(4, partials_dtype="int32")


def _poplar_formula(x):
    return keras.ops.clip(x * 0.2 + 0.5, 0.0, 1.0)


@pytest.mark.parametrize("layer_class, keras_class", [
    (ipu_layers.PopnnLSTM, keras.layers.LSTM), (ipu_layers.PopnnGRU, keras.layers.GRU)])
def test_hard_sigmoid_is_poplars_and_survives_the_config(layer_class, keras_class):
    x = _images((2, 5, 3))  # large enough that Poplar's and Keras 3's formulas differ
    ours = layer_class(4, activation="hard_sigmoid", recurrent_activation="hard_sigmoid",
                       return_sequences=True)
    ours.build(x.shape)
    poplar = keras_class(4, activation=_poplar_formula,
                         recurrent_activation=_poplar_formula, return_sequences=True)
    poplar.build(x.shape)
    poplar.set_weights(ours.get_weights())
    expected = keras.ops.convert_to_numpy(poplar(x))
    np.testing.assert_allclose(ours(x), expected, atol=1e-6)
    keras_own = keras_class(4, activation="hard_sigmoid", recurrent_activation="hard_sigmoid",
                            return_sequences=True)
    keras_own.build(x.shape)
    keras_own.set_weights(ours.get_weights())
    assert not np.allclose(keras_own(x), expected, atol=1e-3)
    # The config names the IPU activation; loading it maps the name again.
    config = ours.get_config()
    assert (config["activation"], config["recurrent_activation"]) == ("hard_sigmoid",) * 2
    loaded = layer_class.from_config(config)
    loaded.build(x.shape)
    loaded.set_weights(ours.get_weights())
    np.testing.assert_allclose(loaded(x), expected, atol=1e-6)


def _text_model(scope):
    keras.utils.set_random_seed(11)
    with scope:
        model = keras.Sequential([
            keras.Input((6,), dtype="int32"),
            ipu_layers.Embedding(20, 8),
            ipu_layers.PopnnLSTM(8, return_sequences=True),
            ipu_layers.RecomputationCheckpoint(),
            ipu_layers.GroupNormalization(groups=2),
            ipu_layers.PopnnGRU(8),
            ipu_layers.LayerNormalization(),
            ipu_layers.Dropout(0.2, seed=[7, 8]),
            keras.layers.Dense(3),
        ])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                      steps_per_execution=4)
    return model


def _text_data():
    rng = np.random.default_rng(4)
    return rng.integers(0, 20, (32, 6)).astype(np.int32), rng.random((32, 3), np.float32)


def test_a_model_of_ipu_layers_trains_on_an_ipu_as_in_plain_keras(tmp_path):
    x, y = _text_data()
    plain = _text_model(keras.utils.custom_object_scope({}))
    on_ipu = _text_model(ipu.ipu_strategy.IPUStrategy().scope())
    on_ipu.set_weights(plain.get_weights())
    # Dropout draws from each model's own seed generator: the same seed, the same masks.
    plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    on_ipu.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)
    # Saved and loaded, the layers keep their classes and their arguments.
    path = str(tmp_path / "model.keras")
    on_ipu.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in on_ipu.layers]
    np.testing.assert_allclose(loaded.predict(x, batch_size=4, verbose=0),
                               on_ipu.predict(x, batch_size=4, verbose=0),
                               atol=1e-6)


def _pipelined_with_checkpoint(checkpointed: bool, mode, as_function: bool = False):
    """A 2-stage pipeline (3 Dense layers in stage 0), optionally checkpointing its middle;
    it recomputes, in `mode`, unless `mode` is `None`."""
    configure(2, allow_recompute=mode is not None)
    keras.utils.set_random_seed(2)
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((6,))
        with ipu.keras.PipelineStage(0):
            hidden = keras.layers.Dense(16, activation="tanh")(inputs)
            if checkpointed and as_function:
                hidden = ipu.pipelining_ops.recomputation_checkpoint(hidden)
            elif checkpointed:
                hidden = ipu_layers.RecomputationCheckpoint()(hidden)
            hidden = keras.layers.Dense(16, activation="tanh")(hidden)
            hidden = keras.layers.Dense(16, activation="tanh")(hidden)
        with ipu.keras.PipelineStage(1):
            outputs = keras.layers.Dense(3)(hidden)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
    kwargs = {} if mode is None else {"recomputation_mode": mode}
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4, **kwargs)
    return model


def _fit_report(model):
    """`(weights, stash bytes per stage, IPU 0's memory, loop form)` after one epoch."""
    rng = np.random.default_rng(3)
    x, y = rng.random((32, 6), np.float32), rng.random((32, 3), np.float32)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    report = ipu.utils.execution_report(model, "fit")
    return (model.get_weights(), report.pipeline.stash_bytes, report.ipus[0].memory_bytes,
            report.loop)


@pytest.mark.parametrize("as_function, loop", [(False, "scan"), (True, "host")],
                         ids=["layer-on-device", "op-host-dispatched"])
def test_recomputation_checkpoints_are_stashed_and_change_no_number(as_function, loop,
                                                                    monkeypatch):
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={loop}")
    configure(2)
    modes = ipu.pipelining_ops.RecomputationMode
    interleaved = modes.RecomputeAndBackpropagateInterleaved
    stashed = _fit_report(_pipelined_with_checkpoint(False, None))  # no recomputation
    recomputed = _fit_report(_pipelined_with_checkpoint(False, interleaved))
    checkpointed = _fit_report(_pipelined_with_checkpoint(True, interleaved, as_function))
    ignored = _fit_report(_pipelined_with_checkpoint(True, modes.RecomputeThenBackpropagate,
                                                     as_function))
    for run in (recomputed, checkpointed, ignored):
        assert_weights_close(stashed[0], run[0], atol=1e-6)
    # Stage 0 keeps its input (6 floats a sample), and under Interleaved recomputation
    # its checkpoint (16): 3 micro-batches in flight of 2 samples (Grouped, 2 stages).
    assert recomputed[1][0] == 3 * 2 * 4 * 6 == ignored[1][0]
    if not as_function:  # the report counts checkpoint layers
        assert checkpointed[1][0] == 3 * 2 * 4 * (6 + 16)
    # The program's memory holds the stash: more with the checkpoint, less than all of it.
    assert recomputed[2] < checkpointed[2] < stashed[2]
    assert ignored[2] == recomputed[2]
    assert checkpointed[3] == ("schedule" if loop == "scan" else "host")


def _group_norm_reference(x, groups, strided, epsilon):
    """NumPy: channels-last x, channel c in group c % groups (strided) or c // (C / groups)."""
    channels = x.shape[-1]
    group = np.arange(channels) % groups if strided else np.arange(channels) // (channels // groups)
    out = np.empty_like(x)
    for g in range(groups):
        members = x[..., group == g]
        axes = tuple(range(1, x.ndim))
        mean = members.mean(axis=axes, keepdims=True)
        variance = members.var(axis=axes, keepdims=True)
        out[..., group == g] = (members - mean) / np.sqrt(variance + epsilon)
    return out


@pytest.mark.parametrize("strided", [True, False])
def test_the_functional_normalisations_compute_the_seeds_operators(strided):
    from keras_ipu import normalization_ops  # was: from tensorflow.python.ipu import ...

    x = np.random.default_rng(0).normal(size=(2, 3, 3, 8)).astype(np.float32)
    np.testing.assert_allclose(
        normalization_ops.group_norm(x, groups=np.int64(4), strided_channel_grouping=strided),
        _group_norm_reference(x, 4, strided, 1e-6), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(normalization_ops.instance_norm(x),
                               _group_norm_reference(x, 8, True, 1e-6), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(normalization_ops.layer_norm(x),
                               _group_norm_reference(x, 1, True, 1e-6), rtol=1e-4, atol=1e-5)
    # Channels first, and gamma / beta as values or initializers.
    gamma = np.arange(1, 9, dtype=np.float32)
    first = normalization_ops.group_norm(np.moveaxis(x, -1, 1), groups=2, channels_axis=1,
                                         param_initializers={"gamma": gamma, "beta": "ones"})
    expected = _group_norm_reference(x, 2, True, 1e-6) * gamma + 1
    np.testing.assert_allclose(np.moveaxis(np.asarray(first), 1, -1), expected, rtol=1e-4,
                               atol=1e-5)
    # The layer computes the same (its epsilon given).
    layer = ipu.keras.layers.GroupNormalization(groups=2, epsilon=1e-6)
    layer.build(x.shape)
    layer.gamma.assign(gamma)
    np.testing.assert_allclose(
        layer(x), normalization_ops.group_norm(x, 2, param_initializers={"gamma": layer.gamma}),
        rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="8 channels .* cannot be split into 3 groups"):
        normalization_ops.group_norm(x, groups=3)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        normalization_ops.layer_norm(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="takes 'gamma' and 'beta', got \\['scale'\\]"):
        normalization_ops.layer_norm(x, param_initializers={"scale": gamma})
    # Before: JAX's "Incompatible shapes for broadcasting", or a [5, 8] gamma taken per element.
    with pytest.raises(ValueError, match="'gamma' must be of shape \\[8\\] .* got shape \\[3\\]"):
        normalization_ops.group_norm(x, 2, param_initializers={"gamma": gamma[:3]})
    with pytest.raises(ValueError, match="'beta' must be of shape \\[8\\] .* got shape \\[3, 8\\]"):
        normalization_ops.layer_norm(x[:, 0], param_initializers={"beta": np.ones((3, 8))})


def test_the_seeds_outlined_function_example_runs_with_layer_norm():
    # Seed 13.2.1: an outlined function of matmul, layer_norm and gelu, called twice in a loop.
    from keras_ipu import nn_ops, normalization_ops

    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.ones((8, 8), np.float32)] * 10)
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    w1 = np.random.default_rng(1).normal(size=(8, 8)).astype(np.float32)
    w2 = np.random.default_rng(2).normal(size=(8, 8)).astype(np.float32)

    @ipu.outlined_function
    def func(a, b):
        return nn_ops.gelu(normalization_ops.layer_norm(a @ b))

    def body(x):
        return outfeed.enqueue(func(func(x, w1), w2))

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        ipu.ipu_compiler.compile(lambda: ipu.loops.repeat(10, body, [], infeed), inputs=[])
    result = outfeed.dequeue()
    plain = np.asarray(nn_ops.gelu(normalization_ops.layer_norm(
        np.asarray(nn_ops.gelu(normalization_ops.layer_norm(np.ones((8, 8), np.float32) @ w1)))
        @ w2)))
    assert result.shape == (10, 8, 8)
    np.testing.assert_allclose(result[3], plain, rtol=1e-4, atol=1e-5)


def _masked_lstm_output(middle):
    """An LSTM's output after `middle` on Embedding(mask_zero=True) sequences (None: none)."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)
    if middle is not None:
        hidden = middle(hidden)
    model = keras.Model(inputs, keras.layers.LSTM(3)(hidden))
    tokens = np.array([[1, 2, 0, 0, 0], [3, 4, 5, 6, 0]])
    return model.predict(tokens, verbose=0)


@pytest.mark.parametrize("middle, plain", [
    (lambda: ipu.keras.layers.RecomputationCheckpoint(), lambda: None),
    (lambda: ipu.keras.layers.GroupNormalization(groups=2, strided_channel_grouping=False),
     lambda: keras.layers.GroupNormalization(groups=2)),
    (lambda: ipu.keras.layers.InstanceNormalization(), lambda: keras.layers.GroupNormalization(
        groups=-1)),
], ids=["checkpoint", "group", "instance"])
def test_layers_that_keep_the_samples_apart_pass_the_mask_on(middle, plain):
    # Before, the LSTM after them ran unmasked (the checkpoint's numbers were the model's
    # without any mask at all).
    np.testing.assert_allclose(_masked_lstm_output(middle()), _masked_lstm_output(plain()),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [0, 3, 5, -4])
def test_a_channels_axis_that_is_not_a_non_batch_axis_is_refused(axis):
    # Before, it wrapped silently (InstanceNormalization(channels_axis=3) normalised the batch).
    for layer in (ipu.keras.layers.GroupNormalization(groups=2, channels_axis=axis),
                  ipu.keras.layers.InstanceNormalization(channels_axis=axis)):
        with pytest.raises(ValueError, match=rf"channels_axis {axis} is not an axis .* valid "
                                             r"are \[1, 2, -2, -1\]"):
            layer(np.ones((2, 3, 8), np.float32))


def test_a_numpy_channels_axis_is_an_axis_and_a_bool_is_not():
    # Before: np.int64(-1) was "not an axis ... valid are [1, 2, -2, -1]", True was axis 1.
    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32)
    for numpy_axis, layer_class in ((np.int64(-1), ipu.keras.layers.GroupNormalization),
                                    (np.int32(2), ipu.keras.layers.InstanceNormalization)):
        kwargs = {"groups": 2} if layer_class is ipu.keras.layers.GroupNormalization else {}
        np.testing.assert_allclose(layer_class(channels_axis=numpy_axis, **kwargs)(x),
                                   layer_class(channels_axis=-1, **kwargs)(x), rtol=1e-6)
    with pytest.raises(ValueError, match=r"channels_axis True is not an axis"):
        ipu.keras.layers.GroupNormalization(groups=2, channels_axis=True)(x)


@pytest.mark.parametrize("layer_class", [ipu.keras.layers.PopnnGRU, ipu.keras.layers.PopnnLSTM])
def test_recurrent_layers_take_the_seeds_positional_order(layer_class):
    # The seed's call(inputs, training=None, initial_state=None): before, a ported
    # gru(x, None, h0) used h0 as the mask.
    layer = layer_class(4, seed=3)
    x = np.random.default_rng(0).normal(size=(2, 4, 3)).astype(np.float32)
    states = [np.full((2, 4), 0.5, np.float32)] * (2 if layer_class is ipu.keras.layers.PopnnLSTM
                                                    else 1)
    state = states if len(states) > 1 else states[0]
    np.testing.assert_allclose(layer(x, None, state), layer(x, initial_state=state), rtol=1e-6)
    assert not np.allclose(layer(x, None, state), layer(x))
    with pytest.raises(TypeError, match="given positionally and by name"):
        layer(x, None, state, initial_state=state)
    with pytest.raises(TypeError, match=r"\(inputs, training, initial_state\)"):
        layer(x, None, state, None)
    # Bidirectional would reverse time-major outputs along their batch: refused.
    with pytest.raises(ValueError, match="go_backwards=True with time_major=True"):
        keras.layers.Bidirectional(layer_class(4, time_major=True, return_sequences=True))


@pytest.mark.parametrize("groups", [2.0, 0, True, None])
def test_a_group_count_that_is_not_a_positive_integer_is_refused_at_once(groups):
    with pytest.raises(ValueError, match=f"groups must be a positive integer, got {groups!r}"):
        ipu.keras.layers.GroupNormalization(groups=groups)
    assert ipu.keras.layers.GroupNormalization(groups=np.int64(2)).groups == 2


@pytest.mark.parametrize("make, x", [
    (lambda: ipu_layers.Dropout(0.5, seed=[1, 2]), np.ones((4, 6), "float32")),
    (lambda: ipu_layers.Embedding(5, 3), np.array([[0, 4, 2]], "int32")),
    (lambda: ipu_layers.LayerNormalization(), np.arange(12, dtype="float32").reshape(2, 6)),
    (lambda: ipu_layers.GroupNormalization(groups=2), np.arange(12, dtype="float32").reshape(2, 6)),
    (lambda: ipu_layers.InstanceNormalization(), np.arange(12, dtype="float32").reshape(2, 6)),
])
def test_a_layer_takes_training_by_position_as_ported_calls_pass_it(make, x):
    # `self.drop(h, training)` in a ported model raised: Keras takes tensors only by position.
    for training in (True, False):
        keras.utils.set_random_seed(0)
        by_name = make()
        expected = np.asarray(by_name(x, training=training))
        keras.utils.set_random_seed(0)
        layer = make()
        np.testing.assert_array_equal(np.asarray(layer(x, training)), expected)
    with pytest.raises(TypeError, match=r"takes \(inputs, training\), the rest by name"):
        layer(x, True, None)


def test_the_embedding_takes_ipu_tensorflows_arguments_in_their_order():
    # Later IPU TensorFlow releases: Keras' arguments, then serialization_factor (refused before).
    layer = ipu_layers.Embedding(100, 8, "zeros", None, None, None, True, None, 4)
    assert layer.mask_zero and layer.serialization_factor == 4
    again = ipu_layers.Embedding.from_config(layer.get_config())
    assert again.serialization_factor == 4 and again.mask_zero
    ids = np.array([[0, 7, 99]])
    np.testing.assert_array_equal(layer(ids), np.zeros((1, 3, 8)))  # the same lookup
    with pytest.raises(ValueError, match="serialization_factor must be a positive integer "
                                         "dividing input_dim 100, got 3"):
        ipu_layers.Embedding(100, 8, serialization_factor=3)
    # Before: "must be a positive integer dividing input_dim 100, got np.int64(4)".
    numpy_factor = ipu_layers.Embedding(100, 8, serialization_factor=np.int64(4))
    assert numpy_factor.get_config()["serialization_factor"] == 4
    with pytest.raises(ValueError, match="serialization_factor must be .* got True"):
        ipu_layers.Embedding(100, 8, serialization_factor=True)


def test_the_ipu_embedding_quantizes_as_kerases(strategy):
    # Keras' Embedding refuses to quantize a subclass: the IPU layer stayed float32.
    ids = np.array([[0, 4, 2], [1, 3, 3]], "int32")
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(5, 8)])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,), dtype="int32"), ipu_layers.Embedding(5, 8)])
    model.set_weights(plain.get_weights())
    for each in (plain, model):
        each.quantize("int8")
    assert model.layers[0].quantization_mode == "int8"
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(plain(ids)))


def test_a_normalisation_op_refuses_the_batch_axis_as_channels():
    # Its statistics would mix the samples of the batch.
    from keras_ipu import normalization_ops

    x = np.arange(24, dtype="float32").reshape(4, 6)
    for op in (lambda: normalization_ops.group_norm(x, 2, channels_axis=0),
               lambda: normalization_ops.layer_norm(x, channels_axis=-2)):
        with pytest.raises(ValueError, match=r"other than the batch: valid are \[1, -1\]"):
            op()
