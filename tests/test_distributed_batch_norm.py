"""Distributed batch normalisation: `norms.experimental.distributed_batch_norm_replica_group_size`.

With a group size G > 1, a replicated `fit` computes every training
`BatchNormalization`'s batch statistics over the G consecutive replicas of
each group, for the batch and the moving statistics alike.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.keras import batch_norm_groups, context

from conftest import assert_weights_close


def _configure(num_ipus: int, group: int) -> None:
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = num_ipus
    config.norms.experimental.distributed_batch_norm_replica_group_size = group
    config.configure_ipu_system()


def _norm_only(features: int = 3, momentum: float = 0.0) -> keras.Model:
    return keras.Sequential([keras.Input((features,)),
                             keras.layers.BatchNormalization(momentum=momentum)])


class _LastReplicaStates(keras.callbacks.Callback):
    """Every replica's non-trainable state after the last batch (`[replicas, ...]` each)."""

    def __init__(self, model):
        super().__init__()
        self._watched = model
        self.states = None

    def on_train_batch_end(self, batch, logs=None):
        state, codec = context.state_of(self._watched).pending_state
        self.states = codec.replicas.replica_slices(state[1])


@pytest.mark.parametrize("group, expected", [(2, 0.5), (1, 0.0)])
def test_two_replicas_share_their_batch_statistics(group, expected, strategy):
    # Replica 0 sees zeros, replica 1 ones: grouped, both see the mean of the two.
    _configure(2, group)
    with strategy.scope():
        model = _norm_only()
    model.compile(keras.optimizers.SGD(0.0), "mse", steps_per_execution=1)
    x = np.concatenate([np.zeros((4, 3)), np.ones((4, 3))]).astype("float32")
    model.fit(x, x, batch_size=4, shuffle=False, verbose=0)
    norm = model.layers[0]
    np.testing.assert_allclose(norm.moving_mean.numpy(), np.full(3, expected), atol=1e-6)
    np.testing.assert_allclose(norm.moving_variance.numpy(), np.full(3, expected / 2),
                               atol=1e-6)


def _mlp() -> keras.Model:
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.BatchNormalization(momentum=0.5),
                             keras.layers.Dense(2)])


def _masked() -> keras.Model:
    return keras.Sequential([keras.Input((6,), dtype="int32"),
                             keras.layers.Embedding(10, 4, mask_zero=True),
                             keras.layers.BatchNormalization(momentum=0.5),
                             keras.layers.GlobalAveragePooling1D(),
                             keras.layers.Dense(2)])


def _data(kind: str, samples: int):
    rng = np.random.default_rng(3)
    if kind == "masked":
        x = rng.integers(1, 10, (samples, 6)).astype("int32")
        x[rng.random(x.shape) < 0.3] = 0  # padding, masked out of the statistics
    else:
        x = rng.normal(size=(samples, 5)).astype("float32") * 2 + 1
    return x, rng.normal(size=(samples, 2)).astype("float32")


@pytest.mark.parametrize("num_ipus, kind", [(4, "mlp"), (4, "masked"), (16, "mlp")])
def test_one_group_of_all_replicas_trains_as_the_big_batch(num_ipus, kind, strategy):
    # Gradients are summed over replicas (learning rate / R) and the statistics are
    # the big batch's: R replicas of batch 2 are plain Keras with batch 2R. With 16
    # IPUs, two share each of the suite's 8 devices (batched).
    _configure(num_ipus, num_ipus)
    build = _masked if kind == "masked" else _mlp
    keras.utils.set_random_seed(0)
    plain = build()
    with strategy.scope():
        on_ipu = build()
    on_ipu.set_weights(plain.get_weights())
    lr, batch = 0.1, 2
    plain.compile(keras.optimizers.SGD(lr), "mse")
    on_ipu.compile(keras.optimizers.SGD(lr / num_ipus), "mse", steps_per_execution=2)
    x, y = _data(kind, 4 * batch * num_ipus)
    plain.fit(x, y, batch_size=batch * num_ipus, epochs=2, shuffle=False, verbose=0)
    on_ipu.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=2e-5)


def test_without_groups_the_replicas_statistics_differ_from_the_big_batch(strategy):
    # The control of the test above: each replica's own statistics are not the big batch's.
    _configure(4, 1)
    keras.utils.set_random_seed(0)
    plain = _mlp()
    with strategy.scope():
        on_ipu = _mlp()
    on_ipu.set_weights(plain.get_weights())
    plain.compile(keras.optimizers.SGD(0.1), "mse")
    on_ipu.compile(keras.optimizers.SGD(0.1 / 4), "mse", steps_per_execution=2)
    x, y = _data("mlp", 32)
    plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    on_ipu.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    moving_mean = 2  # Dense kernel, bias, gamma, beta, moving mean, moving variance
    assert not np.allclose(plain.get_weights()[moving_mean + 2],
                           on_ipu.get_weights()[moving_mean + 2], atol=1e-3)


@pytest.mark.parametrize("num_ipus, group, accumulation", [(4, 2, 1), (4, 2, 2), (16, 4, 1)])
def test_each_group_has_the_statistics_of_its_own_replicas(num_ipus, group, accumulation,
                                                           strategy):
    # Replica r's data is centred on 3r: each group's moving statistics (momentum 0: the
    # last batch's) are those of its replicas' batches together, the same on each of
    # them, and differ between groups; with gradient accumulation, per micro-batch.
    _configure(num_ipus, group)
    with strategy.scope():
        model = _norm_only()
    model.compile(keras.optimizers.SGD(0.0), "mse", steps_per_execution=2)
    model.set_gradient_accumulation_options(accumulation)
    batch, rng = 4, np.random.default_rng(1)
    steps = [[rng.normal(3.0 * r + s, 1.0 + r, (batch, 3)).astype("float32")
              for r in range(num_ipus)] for s in range(2)]
    x = np.concatenate([b for step in steps for b in step])  # batch i: replica i % R
    watcher = _LastReplicaStates(model)
    model.fit(x, x, batch_size=batch, shuffle=False, verbose=0, callbacks=[watcher])
    last = steps[-1]
    for r, (mean, variance) in enumerate(watcher.states):
        first = r - r % group
        union = np.concatenate(last[first : first + group])
        np.testing.assert_allclose(np.asarray(mean), union.mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(variance), union.var(0), rtol=1e-5, atol=1e-5)
    # Keras' variables get replica 0's, its group's.
    np.testing.assert_allclose(model.layers[0].moving_mean.numpy(),
                               np.concatenate(last[:group]).mean(0), rtol=1e-5)


def test_a_group_size_that_does_not_divide_the_replicas_is_refused_before_training(strategy):
    _configure(4, 3)
    with strategy.scope():
        model = _mlp()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    before = model.get_weights()
    x, y = _data("mlp", 16)
    with pytest.raises(ValueError, match=r"replica_group_size \(3\) must divide the "
                                         r"replication factor \(4\).*: 1, 2, 4"):
        model.fit(x, y, batch_size=2, verbose=0)
    assert_weights_close(before, model.get_weights(), atol=0)
    # A model without BatchNormalization has nothing for the option to act on.
    with strategy.scope():
        dense = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    dense.compile(keras.optimizers.SGD(0.1), "mse")
    dense.fit(x, y, batch_size=2, verbose=0)


def test_pipelined_models_with_batch_norm_are_refused(strategy):
    _configure(4, 2)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1])
    model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    before = model.get_weights()
    x, y = _data("mlp", 32)
    with pytest.raises(ValueError, match="not supported with pipelining"):
        model.fit(x, y, batch_size=2, verbose=0)
    assert_weights_close(before, model.get_weights(), atol=0)


def test_evaluate_and_predict_use_the_moving_statistics(strategy):
    # Inference batch normalisation has no batch statistics: nothing to group.
    _configure(2, 2)
    with strategy.scope():
        model = _norm_only(momentum=0.5)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    x = np.concatenate([np.zeros((4, 3)), np.ones((4, 3))]).astype("float32")
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0), x / np.sqrt(1.001),
                               rtol=1e-6)
    model.evaluate(x, x, batch_size=4, verbose=0)
    np.testing.assert_array_equal(model.layers[0].moving_mean.numpy(), np.zeros(3))


def test_a_group_of_one_leaves_the_step_as_it_is():
    def step(state, data):
        return data, state

    assert batch_norm_groups.grouped(step, 1) is step
    assert batch_norm_groups.grouped(step, 2) is not step


@pytest.mark.parametrize("how", ["strategy.run", "ipu_compiler.compile"])
def test_computations_of_their_own_share_batch_statistics_too(how, strategy):
    # The option is the system's: a custom loop's training BatchNormalization is grouped
    # as `fit`'s (before: each replica its own statistics, a moving mean of 0 here).
    _configure(2, 2)
    with strategy.scope():
        model = _norm_only()
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.zeros((4, 3), "float32"),
                                                  np.ones((4, 3), "float32")])
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def loop():
        return ipu.loops.repeat(1, lambda x: outfeed.enqueue(model(x, training=True)), [],
                                infeed)

    if how == "strategy.run":
        strategy.run(loop)
    else:
        with ipu.scopes.ipu_scope("/device:IPU:0"):
            ipu.ipu_compiler.compile(loop)
    np.testing.assert_allclose(model.layers[0].moving_mean.numpy(), np.full(3, 0.5), atol=1e-6)
    outputs = np.asarray(outfeed.dequeue())[0]  # [replicas, batch, features]
    np.testing.assert_allclose(outputs[:, 0, 0], [-1.0, 1.0], atol=5e-3)  # eps: 0.998


def test_a_computations_replicas_that_the_group_does_not_divide_are_refused(strategy):
    _configure(4, 4)
    with strategy.scope():
        model = _norm_only()

    def sharded(x):  # two shards of 4 IPUs: 2 replicas
        with ipu.scopes.ipu_shard(0):
            x = x * 1.0
        with ipu.scopes.ipu_shard(1):
            return model(x, training=True)

    with pytest.raises(ValueError, match=r"replica_group_size \(4\) must divide the 2 "
                                         r"replicas of the computation that runs "
                                         r"batch_normalization"):
        strategy.run(sharded, args=(np.ones((4, 3), "float32"),))
