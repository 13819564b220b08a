"""`ipu.slicing_ops`, `ipu.statistics_ops`, `ipu.internal_ops.print_tensor` and `infeed_benchmark`.

Seed 002 §18.14.16-17, §18.14.4 and §18.11: the seed's slicing examples give
its printed results; the rest is checked against NumPy written out here.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.ops import slicing_ops, statistics_ops

ROWS = np.repeat(np.arange(6, dtype=np.float32)[:, None], 6, axis=1)  # row i is all i


def _column(result):
    return np.asarray(result)[:, 0].tolist()


def test_the_seeds_three_slicing_examples():
    dst = ipu.slicing_ops.sequence_slice(np.zeros((6, 6), np.float32), ROWS, [2, 2], [2, 1],
                                         [0, 4], False)
    assert _column(dst) == [2, 3, 0, 0, 1, 2]
    np.testing.assert_array_equal(dst, np.asarray(dst)[:, :1].repeat(6, axis=1))

    packed = slicing_ops.sequence_slice_pack(np.zeros((6, 6), np.float32), ROWS[[2, 3, 1, 2]],
                                             [2, 2], [2, 1], False)
    assert _column(packed) == [0, 1, 2, 3, 0, 0]

    # The seed calls it with `False` before the total; the signature has no such argument.
    for unpacked in (slicing_ops.sequence_slice_unpack(ROWS, [2, 2], [2, 1], False, 4),
                     slicing_ops.sequence_slice_unpack(ROWS, [2, 2], [2, 1], 4)):
        assert unpacked.shape == (4, 6) and _column(unpacked) == [2, 3, 1, 2]


def _reference_slice(dst, src, num_elems, src_offsets, dst_offsets, zero_unused):
    out = np.zeros_like(dst) if zero_unused else dst.copy()
    for count, s, d in zip(num_elems, src_offsets, dst_offsets):
        out[d:d + count] = src[s:s + count]
    return out


@pytest.mark.parametrize("zero_unused", [False, True])
def test_random_slices_equal_a_loop_of_copies_under_jit(zero_unused):
    rng = np.random.default_rng(0)
    src = rng.random((9, 2, 3), np.float32)
    dst = rng.random((7, 2, 3), np.float32)
    for _ in range(5):
        num = rng.integers(0, 4, 3)
        src_offsets = rng.integers(0, 9 - num + 1)
        dst_offsets = rng.integers(0, 7 - num + 1)  # may overlap: the later slice wins
        expected = _reference_slice(dst, src, num, src_offsets, dst_offsets, zero_unused)
        sliced = jax.jit(slicing_ops.sequence_slice, static_argnums=5)(
            dst, src, num, src_offsets, dst_offsets, zero_unused)  # traced counts and offsets
        np.testing.assert_array_equal(sliced, expected)


def test_gradients_reach_the_copied_source_rows_and_the_kept_destination_rows():
    def total(dst, src):
        weights = jnp.arange(1.0, 7.0)[:, None]
        return jnp.sum(weights * slicing_ops.sequence_slice(dst, src, [2], [3], [1], False))

    d_dst, d_src = jax.grad(total, argnums=(0, 1))(jnp.zeros((6, 1)), jnp.zeros((5, 1)))
    assert _column(d_src) == [0, 0, 0, 2, 3]  # src rows 3, 4 land on dst rows 1, 2
    assert _column(d_dst) == [1, 0, 0, 4, 5, 6]  # overwritten rows take no gradient


@pytest.mark.parametrize("call, message", [
    (lambda: slicing_ops.sequence_slice(np.zeros((6, 2)), ROWS, [2], [0], [0], False),
     "same inner dimensions"),
    (lambda: slicing_ops.sequence_slice(np.zeros((6, 6)), ROWS, [2, 3], [0, 5], [0, 0], False),
     r"Slice 1 \(src_offsets=5, num_elems=3\) does not fit in the 6 rows"),
    (lambda: slicing_ops.sequence_slice(np.zeros((6, 6)), ROWS, [2, 2], [0], [0, 1], False),
     "one entry per slice, got 2, 1 and 2"),
    (lambda: slicing_ops.sequence_slice_unpack(ROWS, [2], [0], 2.5),
     "total_elements must be a non-negative int"),
    (lambda: jax.jit(lambda d, s: slicing_ops.sequence_slice(d, s, [3], [5], [0], False))(
        np.zeros((4, 6)), ROWS), r"Slice 0 \(src_offsets=5, num_elems=3\) does not fit"),
    (lambda: slicing_ops.sequence_slice(np.zeros((6, 6)), ROWS, [], [], [], False),
     "num_elems is empty: give at least one slice"),
    # Before, these two named dst_offsets and src_offsets, which the calls do not take.
    (lambda: slicing_ops.sequence_slice_unpack(ROWS, [2, 2], [2, 1], 3),
     r"The slices, one after another in the result, need 4 rows \(the sum of num_elems\), "
     r"and total_elements gives it 3"),
    (lambda: slicing_ops.sequence_slice_pack(np.zeros((6, 6)), ROWS[:3], [2, 2], [2, 1], False),
     r"The slices, one after another in src, need 4 rows .*and src has 3"),
])
def test_bad_slices_say_which_and_why(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_fixed_width_bins_span_the_inputs_and_histogram_counts_as_digitize():
    values = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    levels = statistics_ops.fixed_width_bins(values, 10)
    np.testing.assert_allclose(levels, np.linspace(values.min(), values.max(), 10), rtol=1e-5)
    hist = statistics_ops.histogram(values, levels)
    expected = np.bincount(np.digitize(values, np.asarray(levels)), minlength=11)
    np.testing.assert_array_equal(hist, expected)
    assert hist.shape == (11,) and hist.dtype == jnp.float32 and float(hist.sum()) == 1000
    assert float(hist[0]) == 0 and float(hist[-1]) == 1  # only the largest is >= the last level
    # Before: a matrix was taken (histogram refused it).
    with pytest.raises(ValueError, match=r"expects a rank-1 array, got inputs of shape \(2, 2\)"):
        statistics_ops.fixed_width_bins(np.ones((2, 2), np.float32), 3)


def test_histogram_bins_by_numpys_digitize_rule_and_update_accumulates():
    levels = np.array([-1.0, 0.0, 2.0], np.float32)
    values = np.array([-3.0, -1.0, -0.5, 0.0, 1.9, 2.0, 7.0], np.float32)
    expected = np.bincount(np.digitize(values, levels), minlength=4)
    np.testing.assert_array_equal(statistics_ops.histogram(values, levels), expected)
    np.testing.assert_array_equal(
        statistics_ops.histogram(values.astype(np.float16), levels, absolute_of_input=True),
        np.bincount(np.digitize(np.abs(values), levels), minlength=4))
    hist = statistics_ops.histogram_update(np.zeros(4, np.float32), values, levels)
    hist = jax.jit(statistics_ops.histogram_update)(hist, values, levels)
    np.testing.assert_array_equal(hist, 2 * expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("inputs, levels, absolute, expected", [
    ([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0], [0.25, 0.5, 0.75, 1.0], False,
     [2, 2, 3, 2, 1]),
    ([-0.1, 0.2, -0.3, 0.4, -0.5, 0.6, -0.7, 0.8, -0.9, 1.0], [0.25, 0.5, 0.75, 1.0], True,
     [2, 2, 3, 2, 1]),
    ([0, 0, 0, 1, 2, 5, 6, 6, 0, 10], [5, 10], False, [6, 3, 1]),
    ([0, 0, 0], [-1, 1], False, [0, 3, 0]),
])
def test_histograms_of_ipu_tensorflows_cases(dtype, inputs, levels, absolute, expected):
    # A value equal to a level counts in the bin above it.
    inputs, levels = np.array(inputs, dtype), np.array(levels, dtype)
    hist = statistics_ops.histogram(inputs, levels, absolute)
    np.testing.assert_array_equal(hist, expected)
    twice = statistics_ops.histogram_update(hist, inputs, levels, absolute)
    np.testing.assert_array_equal(twice, 2 * np.array(expected))


@pytest.mark.parametrize("call, message", [
    (lambda v, lv: statistics_ops.histogram_update(np.zeros(3, np.float32), v, lv),
     "for 3 levels hist must have 4 entries, got 3"),
    (lambda v, lv: statistics_ops.histogram_update(np.zeros(4, np.float16), v, lv),
     "hist must be float32"),
    (lambda v, lv: statistics_ops.histogram(v.astype(np.int32), lv),
     "only float16 and float32 are supported, got inputs of int32"),
    (lambda v, lv: statistics_ops.histogram(v.reshape(1, -1), lv), "rank-1 arrays"),
    (lambda v, lv: statistics_ops.fixed_width_bins(v, 0), "n_bins must be an int of at least 1"),
])
def test_statistics_ops_refuse_what_ipu_tensorflow_refuses(call, message):
    values = np.arange(6, dtype=np.float32)
    with pytest.raises(ValueError, match=message):
        call(values, np.array([1.0, 2.0, 3.0], np.float32))


def test_print_tensor_prints_each_run_and_compile_drops_it(capfd):
    def my_net(v):
        print_op = ipu.internal_ops.print_tensor(v, name="v")
        return v + 1, print_op

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        for start in (1.0, 5.0):
            result = ipu.ipu_compiler.compile(my_net, inputs=[np.full(2, start, np.float32)])
            assert len(result) == 1
            np.testing.assert_array_equal(result[0], [start + 1, start + 1])
    jax.effects_barrier()
    err = capfd.readouterr().err
    assert "v: [1. 1.]" in err and "v: [5. 5.]" in err


def test_infeed_benchmark_times_a_new_pass_and_leaves_the_queue_as_it_was():
    elements = [(np.full((4, 3), i, np.float32), np.full((4,), i, np.int32)) for i in range(10)]
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(elements)
    stats = json.loads(ipu.dataset_benchmark.infeed_benchmark(infeed, 2, 3, print_stats=False))
    assert [e["elements_processed"] for e in stats["epochs"]] == [3, 3]
    assert [e["total_bytes_processed"] for e in stats["epochs"]] == [3 * 64, 3 * 64]
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [first] = ipu.ipu_compiler.compile(
            lambda: ipu.loops.repeat(1, lambda total, x, y: total + x[0, 0], [0.0], infeed))
    assert float(first) == 0  # the loop still starts at the first element
    with pytest.raises(TypeError, match="must be a keras_ipu.ipu_infeed_queue.IPUInfeedQueue"):
        ipu.dataset_benchmark.infeed_benchmark(elements, 1, 1)
    with pytest.raises(ValueError, match="ran out"):  # one pass across epochs: 4 x 3 > 10
        ipu.dataset_benchmark.infeed_benchmark(infeed, 4, 3, print_stats=False)
