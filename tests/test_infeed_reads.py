"""The infeed elements a compiled program's loops read: each taken once, none lost.

A kept program (`ipu_compiler.compile`, `strategy.run`) takes its loops'
elements before it runs (`keras_ipu/device/feed_reads.py`); a trace that
reads fewer than were taken, or that is traced twice, must not lose any.
"""

from __future__ import annotations

import numpy as np
import pytest

import keras_ipu as ipu

from conftest import configure


def _queues(count: int = 20):
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue([np.float32(i) for i in range(count)])
    return infeed, ipu.ipu_outfeed_queue.IPUOutfeedQueue()


def _left(infeed) -> list:
    return [int(v) for v in infeed.peek(100)]


def _outfed(outfeed) -> list:
    return np.asarray(outfeed.dequeue()).reshape(-1).astype(int).tolist()


def test_a_call_whose_trace_skips_a_loop_leaves_that_loops_elements():
    # Before: the first call's plan (two loops) was taken for the second call's
    # trace, which runs one: elements 6 and 7 were lost.
    configure(1)
    infeed, outfeed = _queues()

    def net(x):
        ipu.loops.repeat(2, outfeed.enqueue, [], infeed)
        if x.shape[0] < 3:  # a second loop for short inputs only
            ipu.loops.repeat(2, outfeed.enqueue, [], infeed)
        return x.sum()

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        for size, outfed, left in ((2, [0, 1, 2, 3], 4), (4, [4, 5], 6), (2, [6, 7, 8, 9], 10)):
            ipu.ipu_compiler.compile(net, [np.zeros(size, np.float32)])
            assert _outfed(outfeed) == outfed
            assert _left(infeed)[0] == left


def test_a_replicated_call_whose_loop_runs_no_iteration_leaves_its_elements():
    # Before: 2 replicas, a second loop of x.shape[0] - 1 iterations: at 1 row it
    # ran none, and the 4 elements taken for it on the first call's plan were lost.
    configure(2)
    infeed, outfeed = _queues()
    strategy = ipu.ipu_strategy.IPUStrategy()

    def fn(x):
        ipu.loops.repeat(1, outfeed.enqueue, [], infeed)
        ipu.loops.repeat(x.shape[0] - 1, outfeed.enqueue, [], infeed)
        return x.sum()

    strategy.run(fn, args=(np.zeros(3, np.float32),))
    assert _outfed(outfeed) == [0, 1, 2, 3, 4, 5] and _left(infeed)[0] == 6
    strategy.run(fn, args=(np.zeros(1, np.float32),))
    assert _outfed(outfeed) == [6, 7] and _left(infeed)[0] == 8


def test_a_stateful_outlined_function_over_an_infeed_reads_it_once():
    # Before: traced once to see whether it is pure, then again inlined, it took two
    # rounds of elements per run and computed on the second (0, 1, 4, 5 were lost).
    configure(1)
    infeed, outfeed = _queues()

    @ipu.outlined_function
    def block(a):  # stateful (it enqueues): inlined
        return ipu.loops.repeat(2, lambda total, x: (total + x, outfeed.enqueue(x)), [a],
                                infeed)

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        results = [float(ipu.ipu_compiler.compile(block, [np.float32(0)])[0]) for _ in range(2)]
    assert results == [0 + 1, 2 + 3]
    assert _outfed(outfeed) == [0, 1, 2, 3] and _left(infeed)[0] == 4
    # Eagerly too, where the loop takes its elements itself.
    assert float(block(np.float32(0))) == 4 + 5 and _left(infeed)[0] == 6


@pytest.mark.parametrize("replicas", [1, 2])
def test_an_infeed_too_short_for_the_programs_loops_together_says_so(replicas):
    # Before: "1 elements left for a loop of 3 iterations", with 5 in the queue.
    configure(replicas)
    infeed, _ = _queues(4 * replicas)

    def net():
        ipu.loops.repeat(2, lambda total, x: total + x, [0.0], infeed)
        return ipu.loops.repeat(3, lambda total, x: total + x, [0.0], infeed)

    message = (f"The program's earlier loops read {2 * replicas} of its {4 * replicas} "
               f"elements first: it needs {5 * replicas}, and none is taken")
    with pytest.raises(ValueError, match=message):
        if replicas == 1:
            with ipu.scopes.ipu_scope("/device:IPU:0"):
                ipu.ipu_compiler.compile(net)
        else:
            ipu.ipu_strategy.IPUStrategy().run(net)
    assert len(infeed.peek(100)) == 4 * replicas


def test_a_trapped_run_of_a_program_traced_per_call_keeps_its_elements():
    # A loop of x.shape[0] iterations: a new row count reads differently, and the program
    # is traced for each call, its loops taking their elements as constants. Before: a
    # run the floating point traps stopped lost them (the kept program's put them back).
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.floating_point_behaviour.inv = True
    config.configure_ipu_system()
    infeed, _ = _queues()

    def net(x):
        total = ipu.loops.repeat(x.shape[0], lambda t, e: t + e, [np.float32(0)], infeed)
        return (x ** 0.5).sum() + total  # the square root of a negative number traps

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        ipu.ipu_compiler.compile(net, [np.ones(2, np.float32)])
        assert _left(infeed)[0] == 2
        for _ in range(2):
            with pytest.raises(ipu.errors.IPUFloatingPointError):
                ipu.ipu_compiler.compile(net, [-np.ones(3, np.float32)])
            assert _left(infeed)[0] == 2
        assert float(ipu.ipu_compiler.compile(net, [np.ones(3, np.float32)])[0]) == 3 + 2 + 3 + 4
        assert _left(infeed)[0] == 5


def test_a_per_call_program_whose_loop_fails_to_trace_puts_each_element_back_once():
    # Before: the failing loop put its elements back, and the program's undo again.
    configure(1)
    user, _ = _queues(6)

    def program():
        own = ipu.ipu_infeed_queue.IPUInfeedQueue([np.float32(100)] * 2)  # traced per call
        a = ipu.loops.repeat(2, lambda t, x: t + x, [np.float32(0)], own)
        b = ipu.loops.repeat(2, lambda t, x: t + x, [a], user)
        return ipu.loops.repeat(2, lambda t, x: (t + x, t), [b], user)  # 2 values for 1

    with pytest.raises(ValueError, match="returned 2 values for 1"):
        with ipu.scopes.ipu_scope("/device:IPU:0"):
            ipu.ipu_compiler.compile(program)
    assert _left(user) == [0, 1, 2, 3, 4, 5]
