"""`ipu.nn_ops`' CTC loss and beam search decoder, against an exhaustive count of alignments.

Seed 002 §18.14.7. For a few time steps and classes every alignment can be
listed: a label sequence's probability is the sum over the alignments that
collapse to it (repeats merged, blanks removed). That gives the exact loss,
its exact gradient, and the exact most likely sequences a wide enough beam
must find.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.ops import nn_ops

from conftest import assert_weights_close

T, B, C = 4, 3, 3


def _collapse(alignment, blank):
    labels, previous = [], None
    for symbol in alignment:
        if symbol != previous and symbol != blank:
            labels.append(symbol)
        previous = symbol
    return tuple(labels)


def _sequence_log_probs(log_probs, length, blank):
    """log P(sequence) for every sequence of one entry, over all alignments.

    In NumPy for NumPy input; in jax.numpy (differentiable, slower) otherwise.
    """
    numpy = isinstance(log_probs, np.ndarray)
    total = {}
    for alignment in itertools.product(range(log_probs.shape[-1]), repeat=int(length)):
        score = sum(log_probs[t, alignment[t]] for t in range(int(length)))
        total.setdefault(_collapse(alignment, blank), []).append(score)
    if numpy:
        return {seq: np.logaddexp.reduce(np.array(s)) for seq, s in total.items()}
    return {seq: jax.scipy.special.logsumexp(jnp.stack(s)) for seq, s in total.items()}


def _log_softmax(logits):
    if isinstance(logits, np.ndarray):
        shifted = logits - logits.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return jax.nn.log_softmax(logits)


def _exact_loss(logits, labels, label_length, lengths, blank):
    log_probs = _log_softmax(logits)
    losses = [-_sequence_log_probs(log_probs[:, b], lengths[b], blank % C)[
        tuple(int(v) for v in labels[b, : label_length[b]])] for b in range(logits.shape[1])]
    return np.array(losses) if isinstance(logits, np.ndarray) else jnp.stack(losses)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(T, B, C)).astype(np.float32) * 2
    return logits, np.array([4, 3, 2]), rng


@pytest.mark.parametrize("blank", [0, 2, -1])
def test_the_loss_is_the_exact_negative_log_likelihood(blank):
    logits, lengths, _ = _data()
    symbols = [c for c in range(C) if c != blank % C]
    labels = np.array([[symbols[0], symbols[1]], [symbols[1], symbols[1]], [symbols[0], 0]])
    label_length = np.array([2, 2, 1])  # entry 1 repeats a label: it needs a blank between
    expected = _exact_loss(logits, labels, label_length, lengths, blank)

    log_probs = jax.nn.log_softmax(logits)
    for loss in (nn_ops.ctc_loss_v2(labels, logits, label_length, lengths, blank),
                 nn_ops.ctc_loss_with_logits(labels, logits, label_length, lengths, blank),
                 nn_ops.ctc_loss_with_log_probs(labels, log_probs, label_length, lengths, blank),
                 nn_ops.ctc_loss(labels, log_probs, label_length, lengths, blank)):
        assert loss.shape == (B,) and loss.dtype == jnp.float32
        np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_its_gradient_is_the_exact_one():
    logits, lengths, _ = _data(1)
    labels, label_length = np.array([[0, 1], [1, 0], [1, 1]]), np.array([2, 2, 1])

    def ipu_loss(x):
        return jnp.sum(nn_ops.ctc_loss_v2(labels, x, label_length, lengths, blank_index=2))

    def exact(x):
        return jnp.sum(_exact_loss(x, labels, label_length, lengths, 2))

    np.testing.assert_allclose(jax.grad(ipu_loss)(logits), jax.grad(exact)(logits), atol=1e-5)


def test_out_dtype_follows_the_seeds_rule():
    logits, lengths, _ = _data()
    labels, label_length = np.array([[0], [1], [0]]), np.array([1, 1, 1])
    half = nn_ops.ctc_loss_v2(labels, logits.astype(np.float16), label_length, lengths, 2)
    assert half.dtype == jnp.float16
    wide = nn_ops.ctc_loss_v2(labels, logits.astype(np.float16), label_length, lengths, 2,
                              out_dtype=jnp.float32)
    np.testing.assert_allclose(wide, _exact_loss(logits, labels, label_length, lengths, 2),
                               rtol=5e-3)
    with pytest.raises(ValueError, match="float16 when the data is float32"):
        nn_ops.ctc_loss_v2(labels, logits, label_length, lengths, 2, out_dtype="float16")
    # bfloat16 logits (mixed_bfloat16) give a float32 loss; before, an `out_dtype` the
    # caller never gave was refused.
    brain = nn_ops.ctc_loss_v2(labels, logits.astype(jnp.bfloat16), label_length, lengths, 2)
    assert brain.dtype == jnp.float32
    np.testing.assert_allclose(brain, _exact_loss(logits, labels, label_length, lengths, 2),
                               rtol=3e-2)


@pytest.mark.parametrize("call, message", [
    (lambda x: nn_ops.ctc_loss_v2(np.zeros((3, 2), int), x, [1] * 3, [4] * 3, 3),
     r"blank_index=3 is not a class of data with 3 classes \(valid: -3 to 2\)"),
    (lambda x: nn_ops.ctc_loss_v2(np.zeros((2, 2), int), x, [1] * 2, [4] * 2, 0),
     r"labels must be \[batch_size=3, max_label_length\]"),
    (lambda x: nn_ops.ctc_loss_v2(np.zeros((3, 2), int), x[0], [1] * 3, [4] * 3, 0),
     r"logits must be \[max_time, batch_size, num_classes\]"),
    (lambda x: nn_ops.ctc_beam_search_decoder(x, [4] * 3, beam_width=2, top_paths=3),
     r"top_paths must be an int from 1 to beam_width=2, got 3"),
    (lambda x: nn_ops.ctc_beam_search_decoder(x, [4] * 3, beam_width=0),
     "beam_width must be an int from 1 up, got 0"),
    (lambda x: nn_ops.ctc_loss_v2(np.zeros((3, 2), int), x, [1], [4] * 3, 0),
     r"label_length must be \[batch_size=3\], got shape \(1,\)"),
    (lambda x: nn_ops.ctc_loss_with_log_probs(np.zeros((3, 2), int), x, [1] * 3, [4] * 2, 0),
     r"data_length must be \[batch_size=3\]"),
    (lambda x: nn_ops.ctc_loss_v2(np.zeros((3, 2), int), x, [1] * 3, [4] * 3, 0, "int32"),
     "out_dtype must be float16 or float32, got int32"),
    # Before, these gave a plausible loss: an out-of-range class or the blank scored as
    # probability 1, a length past the labels clamped to them.
    (lambda x: nn_ops.ctc_loss_v2(np.array([[5, 1]] * 3), x, [2] * 3, [4] * 3, 0),
     r"labels must be classes 0 to 2 other than the blank \(0\), got \[5\]"),
    (lambda x: nn_ops.ctc_loss_v2(np.array([[1, 2]] * 3), x, [2] * 3, [4] * 3, -1),
     r"other than the blank \(2\), got \[2\]"),
    (lambda x: nn_ops.ctc_loss_v2(np.array([[1, 2]] * 3), x, [2, 3, 2], [4] * 3, 0),
     r"label_length must be whole numbers from 0 to 2, got \[2, 3, 2\]"),
    # Before, these gave a loss too: a negative length read as 0, past the steps as all.
    (lambda x: nn_ops.ctc_loss_v2(np.array([[1, 2]] * 3), x, [2, -1, 2], [4] * 3, 0),
     r"label_length must be whole numbers from 0 to 2, got \[2, -1, 2\]"),
    (lambda x: nn_ops.ctc_loss_with_log_probs(np.array([[1, 2]] * 3), x, [2] * 3, [4, 9, 4], 0),
     r"data_length must be whole numbers from 0 to 4, got \[4, 9, 4\]"),
    (lambda x: nn_ops.ctc_loss_v2(np.array([[1, 2]] * 3), x, [2] * 3, [4, -1, 4], 0),
     r"logit_length must be whole numbers from 0 to 4, got \[4, -1, 4\]"),
    # Before, JAX's vmap or broadcasting error from inside Keras.
    (lambda x: nn_ops.ctc_beam_search_decoder(x, [4] * 2),
     r"input_lengths must be \[batch_size=3\], got shape \(2,\)"),
    (lambda x: nn_ops.ctc_beam_search_decoder(x, [4, 5, 4]),
     r"input_lengths must be whole numbers from 0 to 4, got \[4, 5, 4\]"),
])
def test_bad_arguments_say_what_is_valid(call, message):
    with pytest.raises(ValueError, match=message):
        call(_data()[0])


def test_labels_are_integers_and_unchecked_values_pass_inside_a_program():
    logits, lengths, _ = _data()
    # Before: 1.9 was taken as 1. Whole numbers of any type are lengths.
    with pytest.raises(ValueError, match=r"label_length must be whole numbers from 0 to 2, "
                                         r"got \[1\.9, 1, 1\]"):
        nn_ops.ctc_loss_v2(np.ones((3, 2), np.int32), logits, [1.9, 1, 1], lengths, 0)
    with pytest.raises(TypeError, match="label_length must be integers, got bool"):
        nn_ops.ctc_loss_v2(np.ones((3, 2), np.int32), logits, [True] * 3, lengths, 0)
    np.testing.assert_array_equal(
        nn_ops.ctc_loss_v2(np.ones((3, 2), np.int32), logits, [1.0] * 3, lengths, 0),
        nn_ops.ctc_loss_v2(np.ones((3, 2), np.int32), logits, [1] * 3, lengths, 0))
    with pytest.raises(TypeError, match="labels must be integer class indices, got float32"):
        nn_ops.ctc_loss_v2(np.ones((3, 1), np.float32), logits, [1] * 3, lengths, 0)
    # Inside jit the values are not known: the program is made (as on the IPU).
    loss = jax.jit(lambda labels: nn_ops.ctc_loss_v2(labels, logits, [1] * 3, lengths, 0))(
        np.ones((3, 1), np.int32))
    np.testing.assert_allclose(loss, nn_ops.ctc_loss_v2(np.ones((3, 1), np.int32), logits,
                                                        [1] * 3, lengths, 0))


@pytest.mark.parametrize("blank", [-1, 0])
def test_a_wide_beam_finds_the_exact_most_likely_sequences(blank):
    logits, lengths, _ = _data(2)
    top = 3
    neg_log_probs, lengths_out, predictions = nn_ops.ctc_beam_search_decoder(
        logits, lengths, beam_width=np.int64(64), top_paths=top, blank_index=blank)
    assert neg_log_probs.shape == lengths_out.shape == (B, top)
    assert predictions.shape == (B, top, T)
    log_probs = _log_softmax(logits)
    for b in range(B):
        exact = sorted(_sequence_log_probs(log_probs[:, b], lengths[b], blank % C).items(),
                       key=lambda item: -float(item[1]))[:top]
        np.testing.assert_allclose(neg_log_probs[b], [-float(p) for _, p in exact], rtol=1e-5)
        for path, (sequence, _) in enumerate(exact):
            assert int(lengths_out[b, path]) == len(sequence)
            assert tuple(int(v) for v in predictions[b, path, : len(sequence)]) == sequence
            assert (np.asarray(predictions[b, path, len(sequence):]) == -1).all()

    same = nn_ops.ctc_beam_search_decoder_with_log_probs(log_probs, lengths, 64, top, blank)
    for ours, theirs in zip(same, (neg_log_probs, lengths_out, predictions)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5)


def test_an_entry_of_no_time_step_decodes_to_the_empty_sequence():
    # Before: decoded as if of length 1 (Keras' search takes a step of it).
    logits, lengths, _ = _data(2)
    lengths = np.array([0, *lengths[1:]])
    neg_log_probs, lengths_out, predictions = nn_ops.ctc_beam_search_decoder(
        logits, lengths, beam_width=8, top_paths=2)
    np.testing.assert_array_equal(neg_log_probs[0], [0.0, np.inf])
    np.testing.assert_array_equal(lengths_out[0], [0, 0])
    assert (np.asarray(predictions[0]) == -1).all()
    whole = nn_ops.ctc_beam_search_decoder(logits, np.array([T, *lengths[1:]]), 8, 2)
    np.testing.assert_allclose(neg_log_probs[1:], whole[0][1:])  # the others as before


def test_a_model_trained_with_the_ctc_loss_on_an_ipu_equals_plain_keras():
    rng = np.random.default_rng(3)
    x = rng.random((16, T, 5), np.float32)
    labels = rng.integers(1, C, (16, 2))

    def ctc(y_true, y_pred):  # batch-major model output -> the op's time-major layout
        lengths = jnp.full((y_pred.shape[0],), T)
        return nn_ops.ctc_loss_v2(y_true.astype(jnp.int32), jnp.swapaxes(y_pred, 0, 1),
                                  jnp.full((y_pred.shape[0],), 2), lengths, blank_index=0)

    def build():
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((T, 5)), keras.layers.Dense(C)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=ctc, steps_per_execution=2)
        return model

    plain = build()
    plain_history = plain.fit(x, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = build()
    history = model.fit(x, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)
    assert history.history["loss"][1] < history.history["loss"][0]
