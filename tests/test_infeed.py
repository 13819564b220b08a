"""The infeed thread: order, device placement, errors, early close."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from keras_ipu.device.infeed import Infeed, to_device


def test_items_arrive_in_order_on_the_device():
    device = jax.devices()[1]
    source = (np.full((2, 3), i, "float32") for i in range(10))
    with Infeed(source, to_device(device), depth=2) as infeed:
        items = list(infeed)
    assert [int(item[0, 0]) for item in items] == list(range(10))
    assert all(item.devices() == {device} for item in items)


def test_prefetches_ahead_of_the_consumer():
    produced = []

    def source():
        for i in range(5):
            produced.append(i)
            yield i

    with Infeed(source(), depth=2) as infeed:
        assert next(infeed) == 0
        deadline = time.monotonic() + 5
        while len(produced) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # time to read one too many
        # One handed out and two prepared ahead of it: `depth` ahead, not one more.
        assert produced == [0, 1, 2]
        assert next(infeed) == 1
        deadline = time.monotonic() + 5
        while len(produced) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert produced == [0, 1, 2, 3]


def test_errors_reach_the_consumer_at_their_item():
    def source():
        yield 1
        raise ValueError("bad batch 2")

    with Infeed(source()) as infeed:
        assert next(infeed) == 1
        with pytest.raises(ValueError, match="bad batch 2"):
            next(infeed)


def test_close_stops_an_endless_producer():
    def endless():
        i = 0
        while True:
            i += 1
            yield i

    infeed = Infeed(endless(), depth=1)
    assert next(infeed) == 1
    infeed.close()
    assert not any(t.name == "keras_ipu-infeed" and t.is_alive() for t in threading.enumerate())


def test_first_inline_prepares_the_first_item_at_once_and_the_rest_on_the_thread():
    where = []

    def source():
        for i in range(4):
            where.append(threading.current_thread())
            yield i

    infeed = Infeed(source(), depth=2, first_inline=True)
    assert where == [threading.current_thread()]  # prepared here, when it opened
    assert not infeed._thread.is_alive()
    assert next(infeed) == 0
    assert not infeed._thread.is_alive()  # started when the second is asked for
    assert list(infeed) == [1, 2, 3]
    assert all(thread is not threading.current_thread() for thread in where[1:])
    infeed.close()


def test_first_inline_hands_a_failed_first_item_over_when_it_is_asked_for():
    def place(item):
        raise ValueError(f"cannot place {item}")

    infeed = Infeed(iter(range(3)), place, first_inline=True)  # does not raise here
    with pytest.raises(ValueError, match="cannot place 0"):
        next(infeed)
    infeed.close()
    assert not infeed._thread.is_alive()


def test_first_inline_ends_an_empty_source_and_closes_unread():
    with Infeed(iter(()), first_inline=True) as empty:
        assert list(empty) == []
    unread = Infeed(iter(range(3)), first_inline=True)
    unread.close()
    assert not unread._thread.is_alive()


def test_close_drops_an_unread_first_item():
    infeed = Infeed(iter(range(3)), first_inline=True)
    assert infeed._first is not None
    infeed.close()  # the run never read it: its device buffers must not be held
    assert infeed._first is None
