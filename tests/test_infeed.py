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
        # One handed out, two waiting in the queue, the producer blocked on the next.
        assert len(produced) >= 3


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


def test_first_alone_prepares_one_item_until_it_is_taken_then_runs_ahead():
    produced = []

    def source():
        for i in range(6):
            produced.append(i)
            yield i

    def settle(count):
        deadline = time.monotonic() + 5
        while len(produced) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # long enough for the producer to go on, were it free to

    with Infeed(source(), depth=3, first_alone=True) as infeed:
        settle(1)
        assert produced == [0]
        assert next(infeed) == 0
        settle(5)  # then up to depth ahead: 3 queued, a fourth waiting to be put
        assert len(produced) >= 4
        assert list(infeed) == [1, 2, 3, 4, 5]


def test_first_alone_closes_while_its_first_item_waits():
    with Infeed(iter(range(5)), depth=2, first_alone=True) as infeed:
        time.sleep(0.05)
    infeed.close()
    assert not infeed._thread.is_alive()
