"""`ipu.scopes`, `ipu.ipu_compiler`, `ipu.loops` and the infeed/outfeed queues, on JAX functions.

The seed's programs (18.4-18.8) with `jax.numpy` for TensorFlow's graph code.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import warnings

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import system

from conftest import configure


def test_the_seeds_outfeed_example_returns_every_iteration():
    # The seed's `dequeue` example: 20 iterations of `output = input + 1` enqueued.
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def body(value):
        output = value + 1
        return output, outfeed.enqueue((output, jnp.sum(output)))

    def my_net(value):
        return ipu.loops.repeat(20, body, [value])

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [result] = ipu.ipu_compiler.compile(my_net, inputs=[np.ones((4, 4), np.float32)])
    np.testing.assert_array_equal(result, np.full((4, 4), 21))
    outputs, sums = outfeed.dequeue()
    assert outputs.shape == (20, 4, 4) and sums.shape == (20,)
    np.testing.assert_array_equal(outputs[:, 0, 0], np.arange(2, 22))
    np.testing.assert_array_equal(sums, 16 * np.arange(2, 22))
    assert outfeed.dequeue() == []  # dequeued once


def test_an_infeed_feeds_each_iteration_and_the_last_mode_keeps_one():
    rng = np.random.default_rng(0)
    features, labels = rng.random((12, 3), np.float32), rng.random((12,), np.float32)
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(
        {"features": f, "labels": y} for f, y in zip(features, labels))
    last = ipu.ipu_outfeed_queue.IPUOutfeedQueue(
        outfeed_mode=ipu.ipu_outfeed_queue.IPUOutfeedMode.LAST)

    def body(total, features, labels):  # the element's dict by keyword, after the carried
        total = total + jnp.sum(features) * labels
        return total, last.enqueue(total)

    def my_net():
        return ipu.loops.repeat(8, body, [0.0], infeed)

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [first] = ipu.ipu_compiler.compile(my_net)
        [second] = ipu.ipu_compiler.compile(lambda: ipu.loops.repeat(4, body, [0.0], infeed))
    expected = features.sum(axis=1) * labels
    np.testing.assert_allclose(first, expected[:8].sum(), rtol=1e-6)
    np.testing.assert_allclose(second, expected[8:].sum(), rtol=1e-6)  # the infeed goes on
    np.testing.assert_allclose(last.dequeue(), expected[8:].sum(), rtol=1e-6)
    with pytest.raises(ValueError, match="The infeed ran out: 0 elements left"):
        ipu.loops.repeat(1, body, [0.0], infeed)
    with pytest.raises(ValueError, match="no last element"):
        last.dequeue()


def test_scopes_place_the_computation_and_while_loops_stop():
    configure(2)
    devices = [ipu_.device for ipu_ in system.require().ipus_of_device(0)]
    with ipu.scopes.ipu_scope("/device:IPU:0"), ipu.scopes.ipu_shard(1):
        [count] = ipu.ipu_compiler.compile(
            lambda: ipu.loops.while_loop(lambda x: x < 10, lambda x: x + 3, [0]))
        [capped] = ipu.ipu_compiler.compile(
            lambda: ipu.loops.while_loop(lambda x: x < 10, lambda x: x + 3, [0],
                                         maximum_iterations=2))
    assert int(count) == 12 and int(capped) == 6
    assert count.devices() == {devices[1]}
    with pytest.raises(ValueError, match="has IPUs 0-1"):
        with ipu.scopes.ipu_shard(2):
            pass


def test_misuse_says_what_to_do():
    with pytest.raises(RuntimeError, match="inside ipu.scopes.ipu_scope"):
        ipu.ipu_compiler.compile(lambda: 1)
    with pytest.raises(RuntimeError, match=r"inside a compiled computation \(ipu_compiler"):
        ipu.ipu_outfeed_queue.IPUOutfeedQueue().enqueue(1.0)

    class Inspect(keras.layers.Layer):  # Graphcore's "inspecting tensors" layer
        def __init__(self):
            super().__init__()
            self.queue = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

        def call(self, x):
            self.queue.enqueue(x)
            return x

    with pytest.raises(RuntimeError, match="A Keras layer cannot enqueue in fit, evaluate or "
                                           "predict, nor while its model is built"):
        keras.Sequential([keras.Input((2,)), Inspect()])
    with pytest.raises(ValueError, match="returned 2 values for 1 loop-carried"):
        ipu.loops.repeat(2, lambda x: (x, x), [0.0])
    with pytest.raises(ValueError, match="The infeed of an ipu.loops.while_loop is empty"):
        ipu.loops.while_loop(lambda x: x < 1, lambda x, e: x, [0],
                             infeed_queue=ipu.ipu_infeed_queue.IPUInfeedQueue([]))
    with pytest.raises(TypeError, match="iterable of elements"):
        ipu.ipu_infeed_queue.IPUInfeedQueue(3)
    # Eagerly, outside `compile`, a loop runs at once and its outfeed is filled.
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    final = ipu.loops.repeat(3, lambda x: (x * 2, outfeed.enqueue(x)), [jnp.float32(1)])
    assert float(final) == 8 and outfeed.dequeue().tolist() == [1, 2, 4]


def test_a_strategy_run_fills_the_outfeeds_its_loops_enqueue_to():
    # The TF2 custom loop: strategy.run(fn) with an infeed and an outfeed, then dequeue.
    strategy = ipu.ipu_strategy.IPUStrategy()
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.full(3, i, np.float32) for i in range(10)])
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def body(total, x):
        total = total + jnp.sum(x)
        return total, outfeed.enqueue(total)

    with strategy.scope():
        total = strategy.run(lambda: ipu.loops.repeat(10, body, [0.0], infeed))
        totals = np.cumsum(3 * np.arange(10))
        np.testing.assert_allclose(total, totals[-1])
        np.testing.assert_allclose(outfeed.dequeue(), totals)
        # A compiled computation inside the run: its outfeed leaves with the run's outputs.
        nested = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

        def run_compiled(x):
            with ipu.scopes.ipu_scope("/device:IPU:0"):
                return ipu.ipu_compiler.compile(
                    lambda v: ipu.loops.repeat(3, lambda c: (c * 2, nested.enqueue(c)), [v]),
                    [x])

        [doubled] = strategy.run(run_compiled, args=(np.float32(1),))
    assert float(doubled) == 8 and nested.dequeue().tolist() == [1, 2, 4]


def test_a_lone_input_is_one_input_as_in_the_seeds_examples():
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def body(value):
        output = value + 1
        return output, outfeed.enqueue(output)

    value = np.ones((4, 4), np.float32)
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [result] = ipu.ipu_compiler.compile(lambda v: ipu.loops.repeat(20, body, (v)), value)
        [count] = ipu.ipu_compiler.compile(
            lambda: ipu.loops.while_loop(lambda x: x < 10, lambda x: x + 3, 0))
    np.testing.assert_array_equal(result, np.full((4, 4), 21))
    assert outfeed.dequeue().shape == (20, 4, 4) and int(count) == 12


def test_the_outfeed_mode_is_checked_and_takes_its_values():
    last = ipu.ipu_outfeed_queue.IPUOutfeedQueue(outfeed_mode="get_last")
    assert last.outfeed_mode is ipu.ipu_outfeed_queue.IPUOutfeedMode.LAST
    ipu.loops.repeat(3, lambda x: (x + 1, last.enqueue(x)), [jnp.float32(0)])
    assert float(last.dequeue()) == 2
    for bad in ("LAST", 2, object()):
        with pytest.raises(ValueError, match=r"outfeed_mode must be IPUOutfeedMode\.ALL or "):
            ipu.ipu_outfeed_queue.IPUOutfeedQueue(outfeed_mode=bad)


def test_synthetic_data_feeds_zeros_and_returns_nothing(monkeypatch):
    monkeypatch.setenv("KERAS_IPU_FLAGS", "--use_synthetic_data")
    configure(1)
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.full(3, 7.0, np.float32)] * 4)
    every = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    last = ipu.ipu_outfeed_queue.IPUOutfeedQueue(
        outfeed_mode=ipu.ipu_outfeed_queue.IPUOutfeedMode.LAST)

    def body(total, x):
        total = total + jnp.sum(x)
        return total, every.enqueue({"x": x, "total": total}), last.enqueue(total)

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [total] = ipu.ipu_compiler.compile(lambda: ipu.loops.repeat(4, body, [0.0], infeed))
    assert float(total) == 0  # the device got zeros
    shapes = {key: value.shape for key, value in every.dequeue().items()}
    assert shapes == {"x": (0, 3), "total": (0,)}
    with pytest.raises(ValueError, match="--use_synthetic_data returns no data to the host"):
        last.dequeue()


def test_a_loop_nested_in_a_body_returns_every_inner_iteration_in_order():
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def outer(i):
        inner = ipu.loops.repeat(2, lambda j: (j + 1, outfeed.enqueue(j)), [i * 10])
        return i + 1, inner

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [count, last] = ipu.ipu_compiler.compile(
            lambda: ipu.loops.repeat(3, lambda i, _: outer(i), [jnp.int32(0), jnp.int32(0)]))
    assert (int(count), int(last)) == (3, 22)
    assert outfeed.dequeue().tolist() == [0, 1, 10, 11, 20, 21]
    # Eagerly too (the queue got values, not leaked tracers).
    ipu.loops.repeat(2, lambda i: outer(i)[0], [jnp.int32(0)])
    assert outfeed.dequeue().tolist() == [0, 1, 10, 11]


def test_a_second_enqueue_in_one_iteration_is_refused_as_on_the_ipu():
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def twice(x):
        return x + 1, outfeed.enqueue(x), outfeed.enqueue(x * 10)

    with pytest.raises(ValueError, match="enqueued once in an iteration"):
        ipu.loops.repeat(3, twice, [jnp.int32(0)])
    with pytest.raises(ValueError, match="enqueued once in an iteration"):
        # The body's own enqueue and a nested loop's on the same queue.
        ipu.loops.repeat(2, lambda x: (ipu.loops.repeat(2, lambda y: (y, outfeed.enqueue(y)),
                                                        [x]), outfeed.enqueue(x)),
                         [jnp.int32(0)])
    with pytest.raises(RuntimeError, match="cannot be called in the body of "
                                           "ipu.loops.while_loop"):
        ipu.loops.while_loop(lambda x: x < 3, lambda x: (x + 1, outfeed.enqueue(x)), [0])
    assert outfeed.dequeue() == []


def test_strategy_run_fixes_python_values_and_passes_queues_as_the_tf2_loops_do():
    strategy = ipu.ipu_strategy.IPUStrategy()
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.full(2, i, np.float32) for i in range(8)])
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def training_loop(infeed, outfeed, steps, scale=1.0):
        def body(total, x):
            total = total + scale * jnp.sum(x)
            return total, outfeed.enqueue(total)
        return ipu.loops.repeat(steps, body, [0.0], infeed)

    with strategy.scope():
        first = strategy.run(training_loop, args=(infeed, outfeed, 4))
        second = strategy.run(training_loop, args=(infeed, outfeed), kwargs={"steps": 2,
                                                                             "scale": 10.0})
    assert float(first) == 2 * (0 + 1 + 2 + 3) and float(second) == 10 * 2 * (4 + 5)
    np.testing.assert_allclose(outfeed.dequeue(), [0, 2, 6, 12, 80, 180])
    assert float(ipu.loops.repeat(np.int64(3), lambda x: x + 1, [0.0])) == 3
    # No iteration, as IPU TensorFlow's while loop of 0: the inputs, nothing taken.
    assert float(ipu.loops.repeat(0, lambda x, e: x + e, [5.0], infeed)) == 5.0
    assert len(infeed.peek(10)) == 2
    for bad in (-1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="repeat needs n >= 0 iterations, a Python or "
                                             "NumPy integer"):
            ipu.loops.repeat(bad, lambda x: x + 1, [0.0])


def test_a_compiled_program_runs_again_without_tracing_and_reads_the_next_elements():
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.full(3, i, np.float32) for i in range(9)])
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    traces = []

    def body(total, x):
        traces.append(None)
        return total + jnp.sum(x), outfeed.enqueue(x[0])

    def my_net(start):
        return ipu.loops.repeat(3, body, [start], infeed)

    assert not infeed.dequeued and infeed.number_of_tuple_elements == 1
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        totals = [float(ipu.ipu_compiler.compile(my_net, [np.float32(s)])[0]) for s in (0, 1, 2)]
    assert totals == [0 + 9, 1 + 36, 2 + 63]  # 3 * (0+1+2), 3 * (3+4+5), 3 * (6+7+8)
    assert len(traces) == 1  # one trace (of the loop's body) for the three calls
    assert outfeed.dequeue().tolist() == list(range(9)) and infeed.dequeued
    with pytest.raises(ValueError, match="The infeed ran out: 0 elements left"):
        with ipu.scopes.ipu_scope("/device:IPU:0"):
            ipu.ipu_compiler.compile(my_net, [np.float32(0)])


def test_a_loop_that_cannot_run_takes_nothing_from_its_infeed():
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.float32(i) for i in range(5)])

    def body(total, x):
        return total + x

    assert float(ipu.loops.repeat(3, body, [0.0], infeed)) == 3
    with pytest.raises(ValueError, match="The infeed ran out: 2 elements left for a loop of 3"):
        ipu.loops.repeat(3, body, [0.0], infeed)
    with pytest.raises(ValueError, match="The infeed ran out: 2 elements left for a loop of 3"):
        with ipu.scopes.ipu_scope("/device:IPU:0"):
            ipu.ipu_compiler.compile(lambda: ipu.loops.repeat(3, body, [0.0], infeed))
    with pytest.raises(ZeroDivisionError):  # a body that fails to trace
        ipu.loops.repeat(2, lambda total, x: 1 / 0, [0.0], infeed)
    with pytest.raises(ZeroDivisionError):
        with ipu.scopes.ipu_scope("/device:IPU:0"):
            ipu.ipu_compiler.compile(
                lambda: ipu.loops.repeat(2, lambda total, x: 1 / 0, [0.0], infeed))
    assert float(ipu.loops.repeat(2, body, [0.0], infeed)) == 3 + 4


def test_the_queues_have_ipu_tensorflows_members():
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([(np.ones(2), {"a": np.zeros(1),
                                                                "b": np.zeros(3)})])
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    assert infeed.initializer is None and infeed.deleter is None and outfeed.deleter is None
    # The body's arguments (IPU TensorFlow's `_body_arguments`): the tuple's two parts.
    assert infeed.number_of_tuple_elements == 2 and not infeed.dequeued
    with pytest.raises(ValueError, match="get_next\\(\\) is obsolete"):
        infeed.get_next()
    assert ipu.ipu_infeed_queue.IPUInfeedQueue([]).number_of_tuple_elements == 0


def test_the_arguments_ipu_tensorflow_deprecated_warn_only_when_passed():
    queues = ipu.ipu_infeed_queue, ipu.ipu_outfeed_queue
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        queues[0].IPUInfeedQueue([1], prefetch_depth=2)
        queues[1].IPUOutfeedQueue(buffer_depth=2)
    with pytest.warns(DeprecationWarning) as caught:
        queues[0].IPUInfeedQueue([1], "feed", 0, 2, data_to_prefetch=2)
        queues[1].IPUOutfeedQueue(feed_name="out", io_batch_size=2)
    assert [str(w.message).split(" of ")[0] for w in caught] == [
        "The argument data_to_prefetch", "The argument feed_name",
        "The argument replication_factor", "The argument feed_name",
        "The argument io_batch_size"]
    assert "use prefetch_depth instead" in str(caught[0].message)
    assert {w.filename for w in caught} == {__file__}


def test_ipu_tensorflows_other_homes_of_its_names_import():
    from keras_ipu.config import KeyId as config_key_id
    from keras_ipu.keras.extensions import (
        FunctionalLayerPipelineStageAssignment,
        ReplicatedMetricReductionMethod,
    )
    from keras_ipu.utils import KeyId, VerificationOptions

    assert KeyId is config_key_id and VerificationOptions is ipu.config.VerificationOptions
    assert (FunctionalLayerPipelineStageAssignment
            is ipu.keras.FunctionalLayerPipelineStageAssignment)
    assert ReplicatedMetricReductionMethod is ipu.keras.ReplicatedMetricReductionMethod
    options = VerificationOptions()
    options.input_parameters = KeyId(1)  # the seed's set_verification_options example
    assert options.input_parameters.key == 1


def test_a_program_closing_over_arrays_sees_their_values_at_each_call():
    # A kept program would keep the values of its trace: one that captured arrays is traced
    # again (a custom loop reading a model's weights between fits).
    import keras

    weights = keras.Variable(np.ones(3, np.float32))
    strategy = ipu.ipu_strategy.IPUStrategy()

    def scaled(x):
        return x * weights.value

    with strategy.scope():
        first = strategy.run(scaled, args=(np.full(3, 2.0, np.float32),))
        weights.assign(np.full(3, 5.0, np.float32))
        second = strategy.run(scaled, args=(np.full(3, 2.0, np.float32),))
    assert first.tolist() == [2, 2, 2] and second.tolist() == [10, 10, 10]


STEPS = 2


def test_a_kept_program_sees_the_python_values_its_function_reads_and_its_argument_types():
    def my_scaled(x):
        return x * scale

    # The seed's loops re-run with new host values: a program keeps only while they hold.
    global STEPS
    scale = np.float32(2)

    def my_net(x):
        return ipu.loops.repeat(STEPS, lambda v: v * scale, [x])

    strategy = ipu.ipu_strategy.IPUStrategy()
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        first = float(ipu.ipu_compiler.compile(my_net, [np.float32(1)])[0])
        STEPS, scale = 3, np.float32(3)
        second = float(ipu.ipu_compiler.compile(my_net, [np.float32(1)])[0])
    STEPS = 2
    assert (first, second) == (4.0, 27.0)
    with strategy.scope():  # 1, 1.0 and True are equal keys of different types
        kinds = [strategy.run(lambda v: jnp.asarray(v), args=(v,)).dtype for v in (1, 1.0, True)]
    assert kinds == [jnp.int32, jnp.float32, jnp.bool_]
    # A 0-d NumPy array is written into the program as a literal (was reused: 2 * x).
    for value in (2.0, 5.0):
        scale = np.array(value, np.float32)
        assert strategy.run(my_scaled, args=(np.ones(2, np.float32),)).tolist() == [value] * 2


def test_compile_inside_a_jax_transform_and_an_infeed_made_inside_run_as_before():
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        doubled = jax.jit(lambda x: ipu.ipu_compiler.compile(lambda v: v * 2, [x])[0])(
            np.ones(3, np.float32))
        made_inside = ipu.ipu_compiler.compile(lambda: ipu.loops.repeat(
            3, lambda t, e: t + e, [0.0],
            ipu.ipu_infeed_queue.IPUInfeedQueue([np.float32(i) for i in (1, 2, 3)])))
    assert doubled.tolist() == [2, 2, 2] and float(made_inside[0]) == 6


def test_an_infeed_read_inside_another_loops_body_is_refused():
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.float32(i) for i in range(6)])
    with pytest.raises(ValueError, match="A loop inside another loop's body cannot read an "
                                         "infeed"):
        ipu.loops.repeat(3, lambda t: ipu.loops.repeat(2, lambda u, e: u + e, [t], infeed),
                         [jnp.float32(0)])
    assert len(infeed.peek(10)) == 6  # nothing taken


def test_data_given_as_the_infeed_queue_itself_is_refused_naming_what_to_wrap():
    # Before: "unhashable type: 'list'" in compile, "'list' object has no attribute 'take'"
    # eagerly, "... no attribute 'peek'" from while_loop.
    data = [np.float32(i) for i in range(3)]
    message = ("infeed_queue must be an ipu.ipu_infeed_queue.IPUInfeedQueue or None, got "
               "list: wrap the data, IPUInfeedQueue\\(data\\)")
    loops = [lambda: ipu.loops.repeat(3, lambda t, e: t + e, [0.0], data),
             lambda: ipu.loops.while_loop(lambda t: t < 2, lambda t, e: t + e, [0.0], data)]
    configure(1)
    for loop in loops:
        with pytest.raises(TypeError, match=message):
            loop()
        with ipu.scopes.ipu_scope("/device:IPU:0"), pytest.raises(TypeError, match=message):
            ipu.ipu_compiler.compile(loop)


def test_a_loop_filling_an_outfeed_inside_a_jit_of_ones_own_says_where_to_run_it():
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def body(x):
        return x + 1, outfeed.enqueue(x)

    with pytest.raises(RuntimeError, match="inside a JAX transformation of your own.*"
                                           "ipu_compiler.compile or strategy.run"):
        jax.jit(lambda x: ipu.loops.repeat(3, body, [x]))(jnp.float32(1))
    assert outfeed.dequeue() == []  # nothing reached it
    # Inside keras_ipu's own compiled function the values come out.
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        ipu.ipu_compiler.compile(lambda x: ipu.loops.repeat(3, body, [x]), [jnp.float32(1)])
    np.testing.assert_array_equal(outfeed.dequeue(), [1, 2, 3])


def test_a_helper_function_defined_again_gets_a_new_program_not_the_kept_one():
    # A notebook cell defining the helper again (before: the kept program gave [3, 3]).
    global _helper
    strategy = ipu.ipu_strategy.IPUStrategy()

    def body(v):
        return _helper(v) + 1.0

    results = []
    for factor in (2.0, 3.0):
        exec(f"def _helper(v):\n    return v * {factor}", globals())
        with strategy.scope():
            results.append(strategy.run(body, args=(np.ones(2, np.float32),)).tolist())
    assert results == [[3.0, 3.0], [4.0, 4.0]]


_FACTOR = 2.0


class _ScaledByGlobal(keras.layers.Layer):
    def call(self, inputs):
        return inputs * _FACTOR


def _chain_8(v):
    return v * _FACTOR


def _chain_7(v):
    return _chain_8(v)


def _chain_6(v):
    return _chain_7(v)


def _chain_5(v):
    return _chain_6(v)


def _chain_4(v):
    return _chain_5(v)


def _chain_3(v):
    return _chain_4(v)


def _chain_2(v):
    return _chain_3(v)


def _chain_1(v):
    return _chain_2(v)


def _chain_0(v):  # the computation: `_FACTOR` is read eight calls below it
    return _chain_1(v)


def test_a_global_read_in_a_custom_layers_call_or_calls_deep_gets_a_new_program():
    # A notebook cell changing a global the step reads through a custom layer or a chain of
    # helper calls (before: the kept program gave the first value, [2, 2], again).
    global _FACTOR
    strategy = ipu.ipu_strategy.IPUStrategy()
    layer = _ScaledByGlobal()
    ones = np.ones(2, np.float32)
    for step in (_chain_0, lambda v: layer(v)):
        results = []
        for factor in (2.0, 7.0):
            _FACTOR = factor
            with strategy.scope():
                results.append(strategy.run(step, args=(ones,)).tolist())
            with ipu.scopes.ipu_scope("/device:IPU:0"):
                results.append(ipu.ipu_compiler.compile(step, [ones])[0].tolist())
        assert results == [[2.0, 2.0]] * 2 + [[7.0, 7.0]] * 2
    _FACTOR = 2.0


class _Ops:
    @staticmethod
    def scaled(v):
        return v * _FACTOR

    @property
    def factor(self):
        return _FACTOR


def _loss(w):
    return jnp.sum(w * w) * _FACTOR


_GRAD = jax.grad(_loss)


def test_globals_read_through_methods_properties_and_jax_transforms_get_a_new_program():
    global _FACTOR
    strategy = ipu.ipu_strategy.IPUStrategy()
    ones = np.ones(2, np.float32)
    steps = {"static method": lambda v: _Ops.scaled(v),
             "property": lambda v: v * _Ops().factor,
             "jax.grad": lambda v: _GRAD(v)}
    for name, step in steps.items():
        results = []
        for factor in (2.0, 7.0):
            _FACTOR = factor
            with strategy.scope():
                results.append(strategy.run(step, args=(ones,)).tolist())
        assert results == [[2.0, 2.0], [7.0, 7.0]] if name != "jax.grad" else [
            [4.0, 4.0], [14.0, 14.0]], name
    _FACTOR = 2.0


_ACTIVATION = keras.activations.relu
_PARTIAL = None


class _Mode(enum.Enum):
    DOUBLE = 2.0
    TRIPLE = 3.0


_MODE = _Mode.DOUBLE


def _activated(v):
    return _ACTIVATION(v)


def _partially(v):
    return _PARTIAL(v)


def _by_mode(v):
    return v * _MODE.value


def _sign_of(v, zero):
    return jnp.copysign(jnp.ones_like(v), zero)


def test_rebound_callables_enums_and_signed_zeros_get_a_new_program():
    # The same function each time: before, each second call was the same key as the first
    # (its kept program ran again).
    global _ACTIVATION, _PARTIAL, _MODE
    strategy = ipu.ipu_strategy.IPUStrategy()
    x = np.array([-1.0, 2.0], np.float32)

    def run(fn, *args):
        with strategy.scope():
            return np.asarray(strategy.run(fn, args=(x, *args)))

    assert run(_activated).tolist() == [0.0, 2.0]
    _ACTIVATION = keras.activations.tanh  # a library function bound again
    np.testing.assert_allclose(run(_activated), np.tanh(x), rtol=1e-6)
    got = []
    for k in (2.0, 3.0):
        _PARTIAL = functools.partial(lambda v, k: v * k, k=k)
        got.append(run(_partially).tolist())
    for mode in _Mode:
        _MODE = mode
        got.append(run(_by_mode).tolist())
    assert got == [[-2.0, 4.0], [-3.0, 6.0]] * 2
    _MODE, _ACTIVATION = _Mode.DOUBLE, keras.activations.relu
    assert [run(_sign_of, zero).tolist() for zero in (0.0, -0.0)] == [[1.0, 1.0], [-1.0, -1.0]]


@dataclasses.dataclass(frozen=True)
class _Settings:
    factor: float


class _Helper:
    def scaled(self, v):
        return v * _FACTOR


def test_equal_fixed_arguments_share_a_program_and_a_replaced_method_gets_a_new_one():
    # Equal values made anew at each call (a dataclass, a bound method) are one program
    # (they were traced at every call for a while today); a method replaced on its class is
    # compared as a function defined again.
    global _FACTOR
    strategy = ipu.ipu_strategy.IPUStrategy()
    traced = []
    helper = _Helper()

    def fn(v, settings, method):
        traced.append(1)
        return method(v) * settings.factor

    ones = np.ones(2, np.float32)
    with strategy.scope():
        got = [strategy.run(fn, args=(ones, _Settings(3.0), helper.scaled)).tolist()
               for _ in range(3)]
    assert got == [[6.0, 6.0]] * 3 and len(traced) == 1
    def scaled(v):  # the same function at each call
        return helper.scaled(v)

    original = _Helper.scaled
    got = []
    try:
        with strategy.scope():
            got.append(strategy.run(scaled, args=(ones,)).tolist())
            _Helper.scaled = lambda self, v: v * _FACTOR * 5  # reads the same global
            got.append(strategy.run(scaled, args=(ones,)).tolist())
            _Helper.scaled = lambda self, v: v * _FACTOR * 100
            _FACTOR = 3.0
            got.append(strategy.run(scaled, args=(ones,)).tolist())
    finally:
        _Helper.scaled, _FACTOR = original, 2.0
    assert got == [[2.0, 2.0], [10.0, 10.0], [300.0, 300.0]]


def test_the_key_walks_a_bounded_part_of_a_large_helper_library():
    # A function reaching hundreds of helpers: the key is made at every call (it walked
    # them all, eight calls deep: milliseconds per call).
    from keras_ipu.device import closures

    namespace = {"EPS": 1.0}
    for i in range(600):
        exec(f"def h{i}(x, d=0):\n    return h{(3 * i + 1) % 600}(x) + h{(7 * i + 2) % 600}(x) "
             f"+ EPS", namespace)
    key = closures.host_values(namespace["h0"])
    assert len(key) <= 4 * closures._FUNCTIONS_WALKED


def _with_default_helper(v, helper=_chain_8):
    return helper(v)


def test_a_helper_given_as_a_default_argument_is_walked():
    global _FACTOR
    strategy = ipu.ipu_strategy.IPUStrategy()
    got = []
    for factor in (2.0, 5.0):
        _FACTOR = factor
        with strategy.scope():
            got.append(strategy.run(_with_default_helper, args=(np.ones(2, np.float32),)
                                    ).tolist())
    _FACTOR = 2.0
    assert got == [[2.0, 2.0], [5.0, 5.0]]


_SHIFT = 0.0


class _Base:
    def scaled(self, v):
        return v * _FACTOR


class _Shared(_Base):
    def scaled(self, v):  # an override reaching its base's through super()
        return super().scaled(v) + 0.0

    def shifted(self, v):
        return v + _SHIFT


def _logged(method):
    @functools.wraps(method)
    def wrapper(self, v):
        return method(self, v)
    return wrapper


class _Decorated:
    @_logged
    def step(self, v):
        return self.helper(v)

    def helper(self, v):
        return v * _FACTOR


_SHARED, _DECORATED = _Shared(), _Decorated()


def _shifted_after(v):
    return _SHARED.shifted(v)


def _two_methods_of_one_object(v):  # each function names another method of `_SHARED`
    return _shifted_after(_SHARED.scaled(v))


def _through_a_partial(v):
    return _PARTIAL_HELPER(v)


_PARTIAL_HELPER = functools.partial(_chain_1)  # `_FACTOR` is read eight calls below


def test_methods_reached_by_super_decorators_shared_objects_partials_and_modules_count(
        tmp_path, monkeypatch):
    # Each was stale (the kept program of the first values ran again).
    global _FACTOR, _SHIFT
    (tmp_path / "_user_helpers.py").write_text(
        "SCALE = 2.0\n\ndef scaled(v):\n    return v * SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import _user_helpers

    strategy = ipu.ipu_strategy.IPUStrategy()
    ones = np.ones(2, np.float32)

    def run(fn):
        with strategy.scope():
            return strategy.run(fn, args=(ones,)).tolist()

    try:
        for step in (_two_methods_of_one_object, lambda v: _DECORATED.step(v),
                     _through_a_partial):
            _FACTOR, _SHIFT = 2.0, 0.0
            first = run(step)
            _FACTOR = 3.0
            second = run(step)
            _SHIFT = 10.0
            third = run(step)
            expected = [[2.0] * 2, [3.0] * 2,
                        [13.0] * 2 if step is _two_methods_of_one_object else [3.0] * 2]
            assert [first, second, third] == expected, step
        module_step = lambda v: _user_helpers.scaled(v)  # noqa: E731
        first = run(module_step)
        _user_helpers.SCALE = 5.0
        assert (first, run(module_step)) == ([2.0] * 2, [5.0] * 2)
    finally:
        _FACTOR, _SHIFT = 2.0, 0.0


class _Trainer:
    def __init__(self):
        self.loss = lambda v: v * 2.0

    def step(self, v):
        return self.loss(v)


loss = 0.0  # a global named as `_Trainer`'s attribute
_ARGS = argparse.Namespace(scale=2.0)


def test_an_attribute_named_as_a_global_is_not_it_and_a_namespace_bound_again_counts():
    # Before: the global `loss`, changed by the user's loop, recompiled every call; and an
    # argparse configuration parsed again kept the old program.
    global loss, _ARGS
    strategy = ipu.ipu_strategy.IPUStrategy()
    trainer, traced = _Trainer(), []
    ones = np.ones(2, np.float32)

    def step(v):
        traced.append(1)
        return trainer.step(v) * _ARGS.scale

    got = []
    with strategy.scope():
        for i in range(3):
            loss = float(i)
            got.append(strategy.run(step, args=(ones,)).tolist())
        _ARGS = argparse.Namespace(scale=5.0)
        got.append(strategy.run(step, args=(ones,)).tolist())
    _ARGS, loss = argparse.Namespace(scale=2.0), 0.0
    assert got == [[4.0, 4.0]] * 3 + [[10.0, 10.0]] and len(traced) == 2


class _AttributeDict(dict):
    def __getattr__(self, name):
        return self[name]  # a KeyError, not an AttributeError, for a missing name


_CONFIG = _AttributeDict(scale=2.0)


def test_an_object_answering_attribute_lookups_with_other_errors_is_read_as_eagerly():
    # Before: the walk of what the function reads raised "KeyError: '__code__'".
    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        got = strategy.run(lambda v: v * _CONFIG.scale, args=(np.ones(2, np.float32),))
    assert got.tolist() == [2.0, 2.0]


def test_queues_made_again_get_a_new_program_not_the_kept_one():
    # A notebook cell making the queues run again: the kept program must not take from, or
    # fill, the queues of its trace.
    global _INFEED, _OUTFEED

    def body(total, x):
        total = total + x
        return total, _OUTFEED.enqueue(total)

    def my_net():
        return ipu.loops.repeat(3, body, [0.0], _INFEED)

    for epoch in range(3):
        _INFEED = ipu.ipu_infeed_queue.IPUInfeedQueue(
            [np.float32(10 * epoch + i) for i in range(3)])
        _OUTFEED = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
        with ipu.scopes.ipu_scope("/device:IPU:0"):
            [total] = ipu.ipu_compiler.compile(my_net)
        expected = np.cumsum([10 * epoch + i for i in range(3)])
        assert float(total) == expected[-1]
        np.testing.assert_array_equal(_OUTFEED.dequeue(), expected)
        assert len(_INFEED.peek(1)) == 0  # this epoch's elements were taken


_INFEED = _OUTFEED = None


def test_a_function_wrapped_in_jax_jit_runs_as_the_port_of_a_jit_compiled_tf_function():
    # `@tf.function(jit_compile=True)` ports to `@jax.jit`; its loops still read the infeed
    # and fill the outfeed.
    strategy = ipu.ipu_strategy.IPUStrategy()
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.float32(i) for i in range(6)])
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    @jax.jit
    def training_loop(start):
        def body(total, x):
            total = total + x
            return total, outfeed.enqueue(total)
        return ipu.loops.repeat(3, body, [start], infeed)

    with strategy.scope():
        first = strategy.run(training_loop, args=(np.float32(0),))
        second = strategy.run(training_loop, args=(np.float32(100),))
    assert (float(first), float(second)) == (0 + 1 + 2, 100 + 3 + 4 + 5)
    np.testing.assert_array_equal(outfeed.dequeue(), [0, 1, 3, 103, 107, 112])
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [doubled] = ipu.ipu_compiler.compile(jax.jit(lambda v: v * 2), [np.ones(2)])
    assert doubled.tolist() == [2, 2]


def test_an_enqueue_outside_any_loop_outfeeds_one_element_per_run():
    # IPU TF2's one-step pattern: the computation returns its enqueue op.
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def step(x):
        y = x * 2
        looped = ipu.loops.repeat(2, lambda v: (v + 1, outfeed.enqueue(v)), [y])
        return y, looped, outfeed.enqueue(y)

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        y, looped = ipu.ipu_compiler.compile(step, [np.ones(3, np.float32)])
    np.testing.assert_array_equal(looped, np.full(3, 4))
    # In the order of the program: the loop's two iterations, then the step's value.
    np.testing.assert_array_equal(outfeed.dequeue()[:, 0], [2, 3, 2])
    strategy = ipu.ipu_strategy.IPUStrategy()
    for run in range(2):
        strategy.run(lambda x: outfeed.enqueue({"x": x}), args=(np.full(2, run, np.float32),))
    np.testing.assert_array_equal(outfeed.dequeue()["x"], [[0, 0], [1, 1]])
    with pytest.raises(RuntimeError, match="in the body of ipu.loops.while_loop"):
        with ipu.scopes.ipu_scope("/device:IPU:0"):
            ipu.ipu_compiler.compile(lambda: ipu.loops.while_loop(
                lambda i: i < 2, lambda i: (i + 1, outfeed.enqueue(i)), [0]))


def test_the_outfeed_values_go_to_the_queues_of_the_trace_of_the_program_run():
    # One function compiled for two shapes that enqueue on different queues.
    small, big = ipu.ipu_outfeed_queue.IPUOutfeedQueue(), ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def net(x):
        queue = small if x.shape[0] < 4 else big  # decided at trace time
        return ipu.loops.repeat(2, lambda v: (v + 1, queue.enqueue(v.sum())), [x])

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        for size in (2, 8, 2):
            ipu.ipu_compiler.compile(net, [np.ones(size, np.float32)])
    np.testing.assert_array_equal(small.dequeue(), [2, 4, 2, 4])
    np.testing.assert_array_equal(big.dequeue(), [8, 16])


def test_a_while_loop_takes_an_infeed_element_per_iteration_it_runs():
    # The seed's infeed_queue: "the IPUInfeedQueue from which data is consumed". The
    # iteration count is known on the device only: each iteration takes its element.
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(
        [{"x": np.float32(i)} for i in range(10)])

    def my_net():  # sum the elements while the total stays below 5
        return ipu.loops.while_loop(lambda i, total: total < 5,
                                    lambda i, total, x: (i + 1, total + x),
                                    [0, np.float32(0)], infeed_queue=infeed,
                                    maximum_iterations=10)

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        count, total = ipu.ipu_compiler.compile(my_net)
        assert (int(count), float(total)) == (4, 6.0)  # 0 + 1 + 2 + 3
        # The kept program again: the next elements, 4 and 5.
        count, total = ipu.ipu_compiler.compile(my_net)
        assert (int(count), float(total)) == (2, 9.0)
    assert [float(e["x"]) for e in infeed.peek(10)] == [6, 7, 8, 9]
    # Eagerly too, and running out while the condition holds fails the run.
    assert int(ipu.loops.while_loop(lambda i: i < 3, lambda i, x: i + 1, [0],
                                    infeed_queue=infeed)) == 3
    with pytest.raises(Exception, match="ran out at iteration 1 of a while_loop"):
        jax.block_until_ready(ipu.loops.while_loop(
            lambda i: i < 5, lambda i, x: i + 1, [0], infeed_queue=infeed))


def test_a_while_loops_infeed_takes_python_numbers_and_refuses_mixed_reads_clearly():
    ints = ipu.ipu_infeed_queue.IPUInfeedQueue([1, 2, 3, 4])  # int64 on the host
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        count, total = ipu.ipu_compiler.compile(lambda: ipu.loops.while_loop(
            lambda i, t: i < 2, lambda i, t, x: (i + 1, t + x), [0, 0], infeed_queue=ints))
    assert (int(count), int(total)) == (2, 3)
    # Staged (repeat) and streamed (while_loop) reads of one queue would be out of order.
    shared = ipu.ipu_infeed_queue.IPUInfeedQueue([np.float32(i) for i in range(6)])

    def both():
        ipu.loops.while_loop(lambda i: i < 2, lambda i, x: i + 1, [0], infeed_queue=shared)
        return ipu.loops.repeat(2, lambda t, x: t + x, [np.float32(0)], shared)

    with pytest.raises(ValueError, match="read by an ipu.loops.while_loop and by an ipu.loops"):
        with ipu.scopes.ipu_scope("/device:IPU:0"):
            ipu.ipu_compiler.compile(both)
    assert len(shared.peek(10)) == 6
    # An element of other shapes than the loop was compiled for stays in the queue.
    shapes = ipu.ipu_infeed_queue.IPUInfeedQueue([np.ones(2, np.float32),
                                                  np.ones(3, np.float32)])

    def one(x):
        return ipu.loops.while_loop(lambda i: i < 1, lambda i, e: i + 1, [0],
                                    infeed_queue=shapes)

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        ipu.ipu_compiler.compile(one, [np.float32(0)])
        with pytest.raises(Exception, match=r"shape=\(3,\).*it is left in the queue"):
            ipu.ipu_compiler.compile(one, [np.float32(0)])  # raised by the call itself
    assert [e.shape for e in shapes.peek(5)] == [(3,)]


def test_queue_elements_as_ipu_tensorflow_gives_them():
    # A list element is unpacked like a tuple; number_of_tuple_elements counts the body's
    # arguments (not the arrays), and does not change as the queue empties.
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(
        [[np.float32(i), (np.float32(1), np.float32(2))] for i in range(2)])
    assert infeed.number_of_tuple_elements == 2
    total = ipu.loops.repeat(2, lambda v, x, pair: v + x + pair[0] + pair[1], [0.0], infeed)
    assert float(total) == (0 + 3) + (1 + 3)
    assert infeed.number_of_tuple_elements == 2
    with pytest.raises(ValueError, match="prefetch_depth must be an integer from 1 to 255"):
        ipu.ipu_infeed_queue.IPUInfeedQueue([1], prefetch_depth=0)
    ipu.ipu_outfeed_queue.IPUOutfeedQueue(buffer_depth=2)  # IPU TensorFlow's later argument
    with pytest.raises(ValueError, match="buffer_depth must be an integer from 1 to 255"):
        ipu.ipu_outfeed_queue.IPUOutfeedQueue(buffer_depth=256)


def test_elements_of_another_shape_are_named_and_left_in_the_queue():
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.ones(4, np.float32), np.ones(2, np.float32)])
    with pytest.raises(ValueError, match=r"elements differ in shape \(\(2,\), \(4,\)\).*"
                                         r"partial"):
        ipu.loops.repeat(2, lambda v, x: v + x.sum(), [0.0], infeed)
    assert len(infeed.peek(3)) == 2


@pytest.mark.parametrize("second, described", [
    ((np.ones(4), np.ones(4)), r"\(array \(4,\), array \(4,\)\) where the first is array "
                               r"\(4,\)"),
    ({"a": np.ones(4)}, r"\{'a': array \(4,\)\} where the first is array \(4,\)")])
def test_elements_of_another_structure_are_named_and_left_in_the_queue(second, described):
    # Before: a tuple after an array was taken for one stacked array ("differ in shape ...
    # Is the last batch partial?"), a dict after a tuple gave JAX's pytree error.
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.ones(4, np.float32), second])
    with pytest.raises(ValueError, match=rf"The infeed's element 1 is {described}"):
        ipu.loops.repeat(2, lambda v, x: v + 1.0, [0.0], infeed)
    assert len(infeed.peek(3)) == 2


def test_the_infeed_benchmark_times_the_queues_own_elements_in_order():
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(np.float32(i) for i in range(10))
    assert infeed.number_of_tuple_elements == 1  # looks at element 0
    ipu.dataset_benchmark.infeed_benchmark(infeed, 1, 3, print_stats=False)
    assert [float(e) for e in infeed.take(4)] == [3, 4, 5, 6]  # before: 0, 4, 5, 6
    # A source with new passes (a list) is timed anew, the queue left as it was.
    listed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.float32(i) for i in range(10)])
    listed.put_back(listed.take(2))
    ipu.dataset_benchmark.infeed_benchmark(listed, 1, 6, print_stats=False)
    assert [float(e) for e in listed.peek(20)] == list(range(10))


def test_an_outfeed_is_iterated_one_element_at_a_time_as_in_ipu_tensorflow():
    # IPU TF 2's custom loops read `for loss in outfeed_queue:` (was not iterable).
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    last = ipu.ipu_outfeed_queue.IPUOutfeedQueue(
        outfeed_mode=ipu.ipu_outfeed_queue.IPUOutfeedMode.LAST)

    def body(x):
        return x + 1, outfeed.enqueue({"x": x, "twice": 2 * x}), last.enqueue(x)

    assert list(outfeed) == [] and list(last) == []  # nothing enqueued yet
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        for _ in range(3):
            ipu.ipu_compiler.compile(lambda x: ipu.loops.repeat(2, body, [x]),
                                     [np.float32(1)])
    elements = list(outfeed)
    assert [(float(e["x"]), float(e["twice"])) for e in elements] == [(1, 2), (2, 4)] * 3
    assert outfeed.dequeue() == []  # iterating took them
    # LAST keeps one element, however many runs enqueued (every run's were held).
    assert len(last._received) == 1 and last._received[0].shape == (1,)
    assert [float(v) for v in last] == [2.0]


def test_keras_variables_given_arrive_as_arrays_and_returned_come_back_as_values(strategy):
    # A returned variable raised a JAX error ("Triggering __jax_array__() during
    # abstractification"). One assigned through the closure takes its new value.
    counter = keras.Variable(np.zeros((), np.float32))

    def step(x):
        counter.assign(counter + jnp.sum(x))
        return counter

    assert [float(strategy.run(step, args=(np.ones(3, np.float32),)))
            for _ in range(2)] == [3.0, 6.0]
    assert float(counter.numpy()) == 6.0
    gradient = strategy.run(jax.grad(lambda c: c * 3.0), args=(counter,))  # an array there
    assert float(gradient) == 3.0
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [value] = ipu.ipu_compiler.compile(lambda c: c * 2, [counter])
    assert float(value) == 12.0


def test_an_enqueue_inside_a_transformation_of_the_computation_says_where_to_enqueue(strategy):
    # Inside jax.grad the values are the gradient trace's: "Computation compiled for 2
    # inputs but called with 1". The gradient without the enqueue is unchanged.
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def logged(w, log):
        def body(t):
            t = t * w
            return (t, outfeed.enqueue(t)) if log else t
        return ipu.loops.repeat(3, body, [jnp.float32(1.0)])

    with pytest.raises(RuntimeError, match="filled inside a JAX transformation within the "
                                           "computation .* has_aux=True"):
        strategy.run(lambda w: jax.grad(logged)(w, True), args=(np.float32(2.0),))
    assert outfeed.dequeue() == []
    gradient = strategy.run(lambda w: jax.grad(logged)(w, False), args=(np.float32(2.0),))
    assert float(gradient) == 12.0


def test_an_enqueue_inside_a_transformation_within_a_loop_body_says_where_to_enqueue(strategy):
    # The loss logged where it is computed, inside jax.grad in the body (a GradientTape
    # body's port): JAX's "compiled for 2 inputs but called with 1" before.
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.float32(i) for i in range(4)])
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def body(w, x):
        def loss(w):
            value = (w * x - 1.0) ** 2
            outfeed.enqueue(value)
            return value
        return w - 0.1 * jax.grad(loss)(w)

    with pytest.raises(RuntimeError, match="filled inside a JAX transformation within the "
                                           "computation .* has_aux=True"):
        strategy.run(lambda: ipu.loops.repeat(2, body, [jnp.float32(0.5)], infeed))
    assert len(infeed.peek(10)) == 4 and outfeed.dequeue() == []


def test_a_keras_variable_enqueued_in_a_loop_body_outfeeds_each_iterations_value(strategy):
    # It raised "Triggering __jax_array__() during abstractification" (outside a loop it ran).
    import keras

    variable = keras.Variable(np.zeros(2, np.float32))
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def body():
        variable.assign(variable + 1.0)
        return outfeed.enqueue(variable)

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        ipu.ipu_compiler.compile(lambda: ipu.loops.repeat(3, body))
    np.testing.assert_array_equal(outfeed.dequeue(), [[1, 1], [2, 2], [3, 3]])


def test_an_assignment_inside_a_jitted_step_in_a_loop_body_says_what_to_do(strategy):
    # Before: the loop, traced again to carry the optimizer's variables, replayed the
    # inner jit's trace, which assigned nothing: no weight changed, no error.
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(
        [(np.full((4, 3), i, np.float32), np.ones((4, 1), np.float32)) for i in range(3)])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    before = model.get_weights()

    def step(x, y):
        def loss(weights):
            return jnp.mean((model.stateless_call(weights, [], x)[0] - y) ** 2)
        value, gradients = jax.value_and_grad(loss)([v.value for v in model.trainable_variables])
        optimizer.apply(gradients, model.trainable_variables)
        return value

    def loop(step):
        def body(x, y):
            step(x, y)
        return lambda: ipu.loops.repeat(3, body, [], infeed)

    with pytest.raises(RuntimeError, match=r"variable '.*kernel' was assigned a value made by "
                                           r"a JAX transformation .* Call the function that "
                                           r"assigns it directly"):
        strategy.run(loop(jax.jit(step)))
    for kept, now in zip(before, model.get_weights()):
        np.testing.assert_array_equal(kept, now)
    assert int(optimizer.iterations.numpy()) == 0 and len(infeed.peek(10)) == 3
    strategy.run(loop(step))  # the same step, called directly, trains
    assert int(optimizer.iterations.numpy()) == 3
    assert not np.allclose(before[0], model.get_weights()[0])


def test_batch_statistics_assigned_inside_jax_grad_name_the_variable(strategy):
    # Before: "Computation compiled for 10 inputs but called with 1".
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.BatchNormalization()])
    x = np.arange(8, dtype=np.float32).reshape(4, 2)

    def gradient(x):
        return jax.grad(lambda v: jnp.sum(model(v, training=True)))(x)

    with pytest.raises(RuntimeError, match=r"variable '.*moving_mean' was assigned a value "
                                           r"made by a JAX transformation .*stateless_call"):
        strategy.run(gradient, args=(x,))
    assert float(np.abs(model.get_weights()[2]).sum()) == 0.0  # moving mean kept


@pytest.mark.parametrize("limit", [2.5, -1, True, 2**40, "3"])
def test_a_while_loops_maximum_iterations_is_checked_before_it_takes_elements(limit):
    # Before: 2.5 ran 3 iterations, -1 none, True one; 2**40 and "3" failed inside JAX.
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.float32(i) for i in range(4)])
    with pytest.raises(ValueError, match=rf"while_loop needs maximum_iterations from 0 to "
                                         rf"2147483647, .* got {limit!r}\."):
        ipu.loops.while_loop(lambda t: t < 10.0, lambda t, x: t + x, [np.float32(0)], infeed,
                             maximum_iterations=limit)
    assert len(infeed.peek(10)) == 4
    total = ipu.loops.while_loop(lambda t: t < 10.0, lambda t, x: t + x, [np.float32(0)],
                                 infeed, maximum_iterations=np.int64(3))
    assert float(total) == 0 + 1 + 2


def test_a_while_loops_condition_must_be_a_boolean_scalar():
    # Before: "and does not accept dtype float32 at position 0", from keras_ipu's own code.
    with pytest.raises(TypeError, match=r"condition must return a boolean scalar, got "
                                        r"float32\[\]"):
        ipu.loops.while_loop(lambda t: 10.0 - t, lambda t: t + 1.0, [np.float32(0)])
    with pytest.raises(TypeError, match=r"boolean scalar, got bool\[2\]"):
        ipu.loops.while_loop(lambda t: t < 3.0, lambda t: t + 1.0, [np.zeros(2, np.float32)])


def test_values_jax_computes_outside_a_transformation_are_assigned_inside_it(strategy):
    # Dropout's next seed, a count, a stop_gradient's metric: values of the computation's own
    # trace, though assigned inside jax.grad or jax.vmap. They were refused for a while.
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8

    def build():
        keras.utils.set_random_seed(0)
        return (keras.layers.Dropout(0.5), keras.metrics.Mean(),
                keras.Variable(np.float32(0)))

    def step(dropout, metric, calls):
        def loss(w, a):
            value = jnp.sum((w * dropout(a, training=True)) ** 2)
            metric.update_state(jax.lax.stop_gradient(value))
            calls.assign_add(1.0)
            return value

        def computation(a):
            return jax.grad(loss)(jnp.float32(1.0), a), jax.vmap(dropout)(a)
        return computation

    eager = build()
    expected = step(*eager)(x)
    with strategy.scope():
        made = build()
    got = strategy.run(step(*made), args=(x,))
    for value, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(value, want, rtol=1e-6)
    assert float(made[1].result()) == float(eager[1].result()) > 0
    assert float(made[2].numpy()) == float(eager[2].numpy()) == 1.0
    np.testing.assert_array_equal(made[0].seed_generator.state.numpy(),
                                  eager[0].seed_generator.state.numpy())
