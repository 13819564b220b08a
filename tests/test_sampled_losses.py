"""`ipu.nn_ops.nce_loss`, `sampled_softmax_loss` and their log-uniform sampler.

Seed 002 §18.14.7 (TensorFlow's `nn_impl` versions): checked against the
formulas written out in NumPy, and the sampler against its distribution.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.ops import nn_ops

from conftest import assert_weights_close

CLASSES, DIM, BATCH = 20, 4, 5
GENERATOR = keras.random.SeedGenerator(11)


def _log_uniform(k, range_max=CLASSES):
    return np.log((k + 2.0) / (k + 1.0)) / np.log(range_max + 1.0)


def _problem(seed=0, num_true=2):
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(CLASSES, DIM)).astype(np.float32)
    biases = rng.normal(size=(CLASSES,)).astype(np.float32)
    labels = np.stack([rng.choice(CLASSES, num_true, replace=False) for _ in range(BATCH)])
    inputs = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    return weights, biases, labels, inputs


def _numpy_logits(weights, biases, labels, inputs, sampled, true_count, sampled_count):
    true_logits = np.einsum("bd,btd->bt", inputs, weights[labels]) + biases[labels]
    sampled_logits = inputs @ weights[sampled].T + biases[sampled]
    logits = np.concatenate([true_logits - np.log(true_count),
                             sampled_logits - np.log(sampled_count)], axis=1)
    targets = np.concatenate([np.full_like(true_logits, 1 / labels.shape[1]),
                              np.zeros_like(sampled_logits)], axis=1)
    return logits, targets


def _sampled_values(labels):
    sampled = np.array([0, 3, 7, 11], np.int32)  # 3 is also a true class: an accidental hit
    labels = labels.copy()
    labels[0, 0] = 3
    return labels, (sampled, _log_uniform(labels) * 4, _log_uniform(sampled) * 4)


def test_nce_loss_is_tensorflows_formula():
    weights, biases, labels, inputs = _problem()
    labels, values = _sampled_values(labels)
    loss = nn_ops.nce_loss(weights, biases, labels, inputs, 4, CLASSES, num_true=2,
                           sampled_values=values)
    logits, targets = _numpy_logits(weights, biases, labels, inputs, *values)
    expected = np.sum(np.maximum(logits, 0) - logits * targets
                      + np.log1p(np.exp(-np.abs(logits))), axis=1)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_sampled_softmax_loss_keeps_accidental_hits_as_ipu_tensorflow_does():
    weights, biases, labels, inputs = _problem(1)
    labels, values = _sampled_values(labels)
    parts = [weights[:8], weights[8:]]  # a partitioned embedding is concatenated
    loss = nn_ops.sampled_softmax_loss(parts, biases, labels, inputs, 4, CLASSES, num_true=2,
                                       sampled_values=values)
    logits, targets = _numpy_logits(weights, biases, labels, inputs, *values)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(loss, -np.sum(targets * log_softmax, axis=1), rtol=1e-5)


def test_the_unique_sampler_draws_distinct_classes_with_tensorflows_expected_counts():
    labels = np.array([[0], [5]])
    seen = set()
    for seed in range(15):
        sampled, true_count, sampled_count = nn_ops.log_uniform_candidate_sampler(
            labels, 1, 4, True, CLASSES, seed=seed)
        sampled = np.asarray(sampled)
        assert len(set(sampled.tolist())) == 4 and sampled.min() >= 0
        assert sampled.max() < CLASSES
        if np.allclose(sampled_count, 4 * _log_uniform(sampled), rtol=1e-5):
            # No draw repeated: TensorFlow's range sampler gives p * n, not 1 - (1 - p) ** n.
            np.testing.assert_allclose(true_count, 4 * _log_uniform(labels), rtol=1e-5)
            seen.add("no repeat")
            continue
        # 1 - (1 - p) ** tries, with the same tries for every class.
        tries = np.log1p(-np.asarray(sampled_count)) / np.log1p(-_log_uniform(sampled))
        np.testing.assert_allclose(tries, tries[0], rtol=1e-3)
        assert tries[0] >= 5 - 1e-3
        np.testing.assert_allclose(true_count, 1 - (1 - _log_uniform(labels)) ** tries[0],
                                   rtol=1e-3)
        seen.add("repeats")
    assert seen == {"no repeat", "repeats"}

    # Draws follow the log-uniform distribution; with repetition the count is n * p.
    repeated, _, counts = nn_ops.log_uniform_candidate_sampler(labels, 1, 20_000, False,
                                                                 CLASSES, seed=0)
    frequencies = np.bincount(np.asarray(repeated), minlength=CLASSES) / 20_000
    np.testing.assert_allclose(frequencies, _log_uniform(np.arange(CLASSES)), atol=0.01)
    np.testing.assert_allclose(counts, 20_000 * _log_uniform(np.asarray(repeated)), rtol=1e-5)


def test_an_unseeded_sampler_in_a_compiled_step_says_what_to_pass():
    weights, biases, labels, inputs = _problem()
    step = jax.jit(lambda w: nn_ops.nce_loss(w, biases, labels, inputs, 4, CLASSES, num_true=2))
    with pytest.raises(ValueError, match="needs seed=: a keras.random.SeedGenerator"):
        step(weights)


@pytest.mark.parametrize("call, message", [
    (lambda p: nn_ops.nce_loss(*p, 0, CLASSES), "num_sampled must be a positive int, got 0"),
    (lambda p: nn_ops.nce_loss(*p, 4, CLASSES + 1), r"weights must be \[num_classes=21, dim\]"),
    (lambda p: nn_ops.log_uniform_candidate_sampler(p[2], 2, 30, True, CLASSES, 1),
     "num_sampled=30 unique classes cannot come from range_max=20"),
    (lambda p: nn_ops.sampled_softmax_loss(*p, 4, CLASSES, num_true=3, seed=GENERATOR),
     r"labels must be \[batch_size=5, num_true=3\], got shape \(5, 2\)"),
    (lambda p: nn_ops.nce_loss(*p[:3], p[3][:, :2], 4, CLASSES, num_true=2, seed=GENERATOR),
     r"inputs must be \[batch_size, dim=4\], got shape \(5, 2\)"),
])
def test_bad_arguments_say_what_is_wrong_before_the_sampler_draws(call, message):
    state = np.asarray(GENERATOR.state.value).copy()
    with pytest.raises(ValueError, match=message):
        call(_problem())
    np.testing.assert_array_equal(GENERATOR.state.value, state)  # no draw was used up


class _SampledSoftmaxModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.encoder = keras.layers.Dense(
            DIM, kernel_initializer=keras.initializers.GlorotUniform(1))
        self.classes = self.add_weight(shape=(CLASSES, DIM), name="classes",
                                       initializer=keras.initializers.RandomNormal(seed=2))
        self.biases = self.add_weight(shape=(CLASSES,), name="biases", initializer="zeros")
        self.sampler_seed = keras.random.SeedGenerator(3)

    def call(self, x):
        return self.encoder(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(nn_ops.sampled_softmax_loss(
            self.classes, self.biases, y, y_pred, 6, CLASSES, seed=self.sampler_seed))


def test_a_model_trained_with_sampled_softmax_on_an_ipu_equals_plain_keras():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    y = rng.integers(0, CLASSES, (16, 1)).astype(np.int32)

    def build():
        model = _SampledSoftmaxModel()
        model.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=2)
        return model

    plain = build()
    plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = build()
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-5)
    initial = np.asarray(build().classes)
    assert np.abs(np.asarray(model.classes) - initial).max() > 1e-3  # the sampled classes moved
