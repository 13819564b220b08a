"""`ipu.embedding_ops` host embeddings: a table on the host, looked up and trained from programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.ops import embedding_ops

from conftest import configure

TOKENS, WIDTH = 6, 3


def _table(seed=0):
    return np.random.default_rng(seed).normal(size=(TOKENS, WIDTH)).astype(np.float32)


def _batches(steps, seed=1):
    """`steps` batches of 4 ids (repeats included, token 5 never) and targets."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, TOKENS - 1, (steps, 4)).astype(np.int32)
    return ids, rng.normal(size=(steps, 4)).astype(np.float32)


def _by_hand(table, w, ids, targets, lr, factor=1, w_lr=None):
    """The loop of `_train`, in NumPy: w by SGD each step, the table by SGD(+GA) on the host."""
    w_lr = lr if w_lr is None else w_lr
    table, w, pending = table.copy(), w.copy(), np.zeros_like(table)
    for step, (batch, target) in enumerate(zip(ids, targets)):
        rows = table[batch]                               # [4, WIDTH]
        error = rows @ w - target                         # loss = sum(error ** 2)
        grad_w = rows.T @ (2 * error)
        grad_rows = 2 * error[:, None] * w[None, :]
        np.add.at(pending, batch, grad_rows)
        w -= w_lr * grad_w
        if (step + 1) % factor == 0:
            table -= lr * pending
            pending[:] = 0
    return table, w


def _train(embedding, w, ids, targets, lr):
    """SGD on w and the host embedding, one `ipu.loops.repeat` iteration per batch."""
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(
        {"ids": i, "target": t} for i, t in zip(ids, targets))

    def loss(w, handle, ids, target):
        with keras.StatelessScope(state_mapping=[(embedding.variable, handle)]):
            rows = embedding.lookup(ids)
        return jnp.sum((rows @ w - target) ** 2)

    def body(w, handle, ids, target):
        grad_w, _ = jax.grad(loss, argnums=(0, 1))(w, handle, ids, target)
        return w - lr * grad_w, handle

    with ipu.scopes.ipu_scope("/device:IPU:0"), embedding.register():
        trained, _ = ipu.ipu_compiler.compile(
            lambda w: ipu.loops.repeat(len(ids), body, [w, jnp.zeros(())], infeed), [w])
    return embedding.get_embedding_tensor(), np.asarray(trained)


def test_a_lookup_gives_the_tables_rows_clipped_into_range():
    table = _table()
    embedding = embedding_ops.HostEmbedding("lookup", table)
    assert embedding.get_embedding_tensor() is table
    ids = np.array([[0, 5, 2], [7, -3, 2]], np.int32)
    with embedding.register() as registered:
        assert registered is embedding
        rows = jax.jit(embedding.lookup)(ids)
        unclipped = jax.jit(lambda i: embedding.lookup(i, clip_indices=False))
        np.testing.assert_array_equal(unclipped(ids[:1]), table[ids[:1]])
        with pytest.raises(Exception, match=r"indices \[7, -3\] outside \[0, 5\]"):
            jax.block_until_ready(unclipped(ids))
    assert rows.shape == (2, 3, WIDTH)
    np.testing.assert_array_equal(rows, table[np.clip(ids, 0, TOKENS - 1)])


def test_sgd_in_a_compiled_loop_trains_the_host_table_as_by_hand():
    ids, targets = _batches(5)
    w, table = np.array([0.5, -1.0, 2.0], np.float32), _table()
    embedding = embedding_ops.HostEmbedding(
        "sgd", table.copy(), optimizer_spec=embedding_ops.HostEmbeddingOptimizerSpec(0.05))
    trained_table, trained_w = _train(embedding, w, ids, targets, 0.05)
    expected_table, expected_w = _by_hand(table, w, ids, targets, 0.05)
    np.testing.assert_allclose(trained_table, expected_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trained_w, expected_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(trained_table[5], table[5])  # never looked up: unchanged
    assert not np.allclose(trained_table[ids[0]], table[ids[0]])


def test_sgd_with_gradient_accumulation_updates_every_factor_steps():
    ids, targets = _batches(6)
    w, table = np.array([0.5, -1.0, 2.0], np.float32), _table()

    def trained(steps):
        spec = embedding_ops.HostEmbeddingSGDGAOptimizerSpec(0.05, accumulation_factor=3)
        embedding = embedding_ops.HostEmbedding("sgdga", table.copy(), optimizer_spec=spec)
        return _train(embedding, w, ids[:steps], targets[:steps], 0.05)[0]

    np.testing.assert_array_equal(trained(2), table)  # accumulating: nothing applied yet
    for steps in (3, 6):
        expected, _ = _by_hand(table, w, ids[:steps], targets[:steps], 0.05, factor=3)
        np.testing.assert_allclose(trained(steps), expected, rtol=1e-5, atol=1e-6)
    plain, _ = _by_hand(table, w, ids[:3], targets[:3], 0.05)
    assert not np.allclose(trained(3), plain)  # lookups saw the table as it was


class _HostLookup(keras.layers.Layer):
    """Looks ids up in a host embedding; keeps its handle so that the model trains it."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding
        self.handle = embedding.variable

    def call(self, ids):
        return self.embedding.lookup(ids)


def test_a_keras_model_fit_on_an_ipu_trains_the_host_table_as_by_hand():
    ids, targets = _batches(4)
    w, table = np.array([0.5, -1.0, 2.0], np.float32), _table()
    embedding = embedding_ops.create_host_embedding(
        "fit", (TOKENS, WIDTH), np.float32,
        optimizer_spec=embedding_ops.HostEmbeddingOptimizerSpec(0.05),
        initializer=lambda shape, dtype=None: table)
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((4,), dtype="int32")
        rows = _HostLookup(embedding)(inputs)
        outputs = keras.layers.Dense(1, use_bias=False, name="dense")(rows)[..., 0]
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=lambda y, p: keras.ops.sum((p - y) ** 2), steps_per_execution=2)
    model.get_layer("dense").set_weights([w[:, None]])
    with embedding.register():
        model.fit(ids, targets, batch_size=1, epochs=1, shuffle=False, verbose=0)
    expected_table, expected_w = _by_hand(table, w, ids, targets, 0.05)
    np.testing.assert_allclose(embedding.get_embedding_tensor(), expected_table, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(model.get_layer("dense").get_weights()[0][:, 0], expected_w,
                               rtol=1e-5, atol=1e-6)
    # Predicting computes no gradient: the table stays.
    before = embedding.get_embedding_tensor().copy()
    with embedding.register():
        model.predict(ids, batch_size=2, verbose=0)
    np.testing.assert_array_equal(embedding.get_embedding_tensor(), before)


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=4.0),
    lambda: keras.optimizers.SGD(0.05, loss_scale_factor=4.0),
])
def test_a_scaled_loss_is_refused_before_the_host_table_changes(optimizer):
    # Before: the table moved by the scaled gradients (32768x under mixed_float16), and on the
    # steps a LossScaleOptimizer skips.
    ids, targets = _batches(2)
    table = _table()
    embedding = embedding_ops.create_host_embedding(
        "scaled", (TOKENS, WIDTH), np.float32,
        optimizer_spec=embedding_ops.HostEmbeddingOptimizerSpec(0.05),
        initializer=lambda shape, dtype=None: table.copy())
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((4,), dtype="int32")
        outputs = keras.layers.Dense(1, use_bias=False)(_HostLookup(embedding)(inputs))[..., 0]
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=optimizer(), loss="mse")
    weights = model.get_weights()
    with embedding.register(), pytest.raises(ValueError, match=r"Host embeddings \['scaled'\]"):
        model.fit(ids, targets, batch_size=1, verbose=0)
    np.testing.assert_array_equal(embedding.get_embedding_tensor(), table)
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)


def test_replicas_look_up_and_update_the_one_host_table():
    configure(2)
    ids, targets = _batches(3)
    # Samples alternate between rows 0-2 and rows 3-4: the two replicas of a step look up
    # different rows, so the table does not depend on which replica's update comes first.
    ids[:, :2] %= 3
    ids[:, 2:] = 3 + ids[:, 2:] % 2
    w, table = np.array([0.5, -1.0, 2.0], np.float32), _table()
    embedding = embedding_ops.HostEmbedding(
        "replicas", table.copy(), optimizer_spec=embedding_ops.HostEmbeddingOptimizerSpec(0.05))
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((2,), dtype="int32")
        rows = _HostLookup(embedding)(inputs)
        dense = keras.layers.Dense(1, use_bias=False, trainable=False)
        model = keras.Model(inputs, dense(rows)[..., 0])
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=lambda y, p: keras.ops.sum((p - y) ** 2))
    dense.set_weights([w[:, None]])
    with embedding.register():  # each step: one sample of 2 ids per replica
        model.fit(ids.reshape(-1, 2), targets.reshape(-1, 2), batch_size=1, epochs=1,
                  shuffle=False, verbose=0)
    # Each replica's updates reach the table: it moves by their sum.
    expected, _ = _by_hand(table, w, ids, targets, 0.05, w_lr=0.0)
    np.testing.assert_allclose(embedding.get_embedding_tensor(), expected, rtol=1e-5, atol=1e-6)


class _UnclippedLookup(_HostLookup):
    def call(self, ids):
        return self.embedding.lookup(ids, clip_indices=False)


def test_an_index_out_of_range_in_one_replica_fails_every_replica_at_once():
    # Before: only that replica's host callback raised, the other waited in the gradients'
    # all-reduce, and XLA ended the whole process a minute later.
    configure(2)
    table = _table()
    embedding = embedding_ops.HostEmbedding(
        "one_replica", table.copy(),
        optimizer_spec=embedding_ops.HostEmbeddingOptimizerSpec(0.05))
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((2,), dtype="int32")
        model = keras.Model(inputs, keras.layers.Dense(1)(
            keras.layers.Flatten()(_UnclippedLookup(embedding)(inputs))))
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    ids = np.zeros((8, 2), np.int32)
    ids[5, 0] = TOKENS + 2  # the second replica's sample of the third step
    with embedding.register():
        # One replica's own message, or the other's: "another replica looked up indices".
        with pytest.raises(Exception, match=rf"indices (\[{TOKENS + 2}\] )?outside "
                                            rf"\[0, {TOKENS - 1}\]"):
            model.fit(ids, np.ones((8, 1), np.float32), batch_size=1, shuffle=False,
                      verbose=0)
    # The process goes on (the model's state, with the embedding's handle, is lost, as
    # documented for a failed execution): another embedding's registration and lookups run.
    other = embedding_ops.HostEmbedding("after_the_failure", table.copy())
    with other.register():
        rows = jax.jit(other.lookup)(ids[:2])
    np.testing.assert_array_equal(rows, table[ids[:2]])


def test_lookups_outside_register_and_bad_arguments_say_what_is_valid():
    embedding = embedding_ops.HostEmbedding("outside", _table())
    with pytest.raises(Exception, match=r"'outside' is not registered: look it up inside "
                                        r"`with embedding.register\(\):`"):
        jax.block_until_ready(jax.jit(embedding.lookup)(np.array([1])))
    program = jax.jit(embedding.lookup)
    with embedding.register():
        program(np.array([1]))
        namesake = embedding_ops.HostEmbedding("outside", _table())
        with pytest.raises(ValueError, match="'outside' is registered already"):
            namesake.register().__enter__()
        with pytest.raises(Exception, match="Another host embedding named 'outside'"):
            jax.block_until_ready(jax.jit(namesake.lookup)(np.array([1])))
        with pytest.raises(ValueError, match="indices must be integers, got float32"):
            embedding.lookup(np.array([1.0], np.float32))
    with pytest.raises(Exception, match="'outside' is not registered"):
        jax.block_until_ready(program(np.array([1])))  # compiled inside, run after
    with pytest.raises(ValueError, match=r"partition_strategy must be one of \('TOKEN', "
                                         r"'ENCODING'\), got 'ROWS'"):
        embedding_ops.HostEmbedding("e", _table(), partition_strategy="ROWS")
    with pytest.raises(ValueError, match="rank two, \\[tokens, width\\], got shape \\(6,\\)"):
        embedding_ops.HostEmbedding("e", np.zeros(6, np.float32))
    with pytest.raises(ValueError, match="optimizer_spec must be a HostEmbeddingOptimizerSpec"):
        embedding_ops.HostEmbedding("e", _table(), optimizer_spec=keras.optimizers.SGD())
    with pytest.raises(ValueError, match="learning_rate must be 0 or more, got -0.1"):
        embedding_ops.HostEmbeddingOptimizerSpec(-0.1)
    with pytest.raises(ValueError, match="optimizer_name must be one of"):
        embedding_ops.HostEmbeddingOptimizerSpec(0.1, "Adam")
    with pytest.raises(ValueError, match="accumulation_factor must be a positive int, got 0"):
        embedding_ops.HostEmbeddingSGDGAOptimizerSpec(0.1, 0)
    with pytest.raises(ValueError, match=r"shape must be two positive ints"):
        embedding_ops.create_host_embedding("e", (6, 0), np.float32)
    with pytest.raises(ValueError, match="needs a floating-point table, got int32"):
        embedding_ops.create_host_embedding(
            "e", (6, 3), np.int32, optimizer_spec=embedding_ops.HostEmbeddingOptimizerSpec(0.1),
            initializer="zeros")


def test_the_specs_and_embeddings_have_the_reference_members():
    spec = embedding_ops.HostEmbeddingSGDGAOptimizerSpec(0.25, 4)
    assert (spec.get_learning_rate(), spec.get_accumulation_factor()) == (0.25, 4)
    assert embedding_ops.HostEmbeddingOptimizerSpec(0.1).get_learning_rate() == 0.1
    assert ipu.embedding_ops.create_host_embedding is embedding_ops.create_host_embedding
    untrained = embedding_ops.create_host_embedding("u", [4, 2], "float16", initializer="ones")
    assert untrained.variable is None
    np.testing.assert_array_equal(untrained.get_embedding_tensor(), np.ones((4, 2), np.float16))
    assert embedding_ops.HostEmbeddingOptimizerSpec(0.1).create_slot_variables(
        np.zeros((2, 2)), "s")[0].trainable
