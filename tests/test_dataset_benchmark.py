"""`ipu.dataset_benchmark`: the seed's statistics of a data source, and its errors."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import keras_ipu as ipu


class _Batches(keras.utils.PyDataset):
    def __init__(self, count):
        super().__init__()
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return np.full((4, 8), index, np.float32), np.zeros((4,), np.int32)


def test_statistics_per_epoch_of_a_py_dataset(capsys):
    stats = json.loads(ipu.dataset_benchmark.dataset_benchmark(_Batches(5), 3, 5))
    assert len(stats["epochs"]) == 3
    for epoch in stats["epochs"]:
        assert epoch["elements_processed"] == 5
        assert epoch["total_bytes_processed"] == 5 * (4 * 8 * 4 + 4 * 4)
        assert epoch["elements_per_second"] == pytest.approx(5 / epoch["time_elapsed"])
        assert epoch["bandwidth"] == pytest.approx(
            epoch["total_bytes_processed"] / epoch["time_elapsed"] / 1e9)
    assert capsys.readouterr().out.count("elements/s") == 3


def test_an_iterator_goes_on_and_runs_out_with_a_clear_error():
    rows = iter(np.ones((10, 3), np.float32))  # one pass: epochs continue it
    stats = json.loads(ipu.dataset_benchmark.dataset_benchmark(rows, 2, 4, print_stats=False))
    assert [e["total_bytes_processed"] for e in stats["epochs"]] == [48, 48]
    with pytest.raises(ValueError, match="ran out after 2 elements in epoch 1"):
        ipu.dataset_benchmark.dataset_benchmark(rows, 1, 4, print_stats=False)
    # A list restarts every epoch.
    stats = json.loads(ipu.dataset_benchmark.dataset_benchmark(
        [{"x": np.ones(2)}] * 3, 2, 3, print_stats=False, do_memcpy=False))
    assert [e["elements_processed"] for e in stats["epochs"]] == [3, 3]
    stats = json.loads(ipu.dataset_benchmark.dataset_benchmark(
        [np.ones(2)] * 3, np.int64(2), np.int32(3), print_stats=False))
    assert [e["elements_processed"] for e in stats["epochs"]] == [3, 3]


@pytest.mark.parametrize("args, error, message", [
    ((42, 1, 1), TypeError, "PyDataset or an iterable"),
    (([1], 0, 1), ValueError, "number_of_epochs must be an integer of at least 1, got 0"),
    (([1], 1, -2), ValueError, "elements_per_epochs must be an integer of at least 1"),
    (([1], True, 1), ValueError, "number_of_epochs must be an integer of at least 1, got True"),
])
def test_bad_arguments_say_what_is_wrong(args, error, message):
    with pytest.raises(error, match=message):
        ipu.dataset_benchmark.dataset_benchmark(*args, print_stats=False)
