"""`ipu.dataset_benchmark`: how fast a data source or an infeed delivers elements, without a model.

IPU TensorFlow benchmarks a `tf.data.Dataset` this way to tell whether the
host can feed the IPUs; keras_ipu takes the data sources its `fit` takes:
a `keras.utils.PyDataset` (its batches, in order) or any iterable of
elements (a generator, a list, a NumPy array's rows, ...).

Example:

```python
import json
import keras_ipu as ipu

stats = json.loads(ipu.dataset_benchmark.dataset_benchmark(batches(), 2, 100))
print(stats["epochs"][-1]["elements_per_second"])
```
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np


def dataset_benchmark(dataset: Any, number_of_epochs: int, elements_per_epochs: int,
                      print_stats: bool = True, apply_options: bool = True,
                      do_memcpy: bool = True) -> str:
    """Times `number_of_epochs` epochs of `elements_per_epochs` elements of `dataset`.

    Args:
        dataset: A `keras.utils.PyDataset` (an element is a batch) or an
            iterable of elements (arrays, or tuples and dicts of them). A
            re-iterable source restarts each epoch; an iterator goes on.
        number_of_epochs: Epochs to time, at least 1.
        elements_per_epochs: Elements per epoch, at least 1.
        print_stats: Print each epoch's figures.
        apply_options: Accepted for compatibility (tf.data options).
        do_memcpy: Copy each element's arrays into a buffer, as an infeed
            copies them towards the device.

    Returns:
        A JSON string: `{"epochs": [...]}`, each epoch with
        `elements_processed`, `total_bytes_processed`, `time_elapsed`
        (seconds), `elements_per_second` and `bandwidth` (GB/s).

    Raises:
        TypeError: When `dataset` is not a `PyDataset` or an iterable.
        ValueError: When `number_of_epochs` or `elements_per_epochs` is below
            1, or the dataset runs out within an epoch.

    Example:

    >>> dataset_benchmark([np.ones((32, 8))] * 10, 2, 10, print_stats=False)
    '{"epochs": [{"elements_processed": 10, "total_bytes_processed": 20480, ...}]}'
    """
    for name, value in (("number_of_epochs", number_of_epochs),
                        ("elements_per_epochs", elements_per_epochs)):
        # NumPy integers count as ints do; a bool is no count.
        whole = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
        if not whole or value < 1:
            raise ValueError(f"{name} must be an integer of at least 1, got {value!r}.")
    epochs = []
    stream = None
    for epoch in range(number_of_epochs):
        stream = _elements(dataset) if stream is None or _restarts(dataset) else stream
        epochs.append(_epoch(stream, elements_per_epochs, do_memcpy, epoch))
        if print_stats:
            figures = epochs[-1]
            print(f"Epoch {epoch + 1}/{number_of_epochs}: {figures['elements_processed']} "
                  f"elements in {figures['time_elapsed']:.4f} s, "
                  f"{figures['elements_per_second']:,.1f} elements/s, "
                  f"{figures['bandwidth']:.4f} GB/s")
    return json.dumps({"epochs": epochs})


def infeed_benchmark(infeed_queue: Any, number_of_epochs: int, elements_per_epochs: int,
                     print_stats: bool = True, do_memcpy: bool = True) -> str:
    """Times how fast an `IPUInfeedQueue` delivers its elements, without a program.

    As IPU TensorFlow's, it times a new pass over the queue's data source,
    one pass on across the epochs, and leaves the queue as it was; a source
    that is a one-pass iterator has no new pass, so the elements timed are
    the queue's own and a loop fed by it afterwards gets the ones after them.

    Args:
        infeed_queue: A `keras_ipu.ipu_infeed_queue.IPUInfeedQueue`.
        number_of_epochs: Epochs to time, at least 1.
        elements_per_epochs: Elements per epoch, at least 1.
        print_stats: Print each epoch's figures.
        do_memcpy: Copy each element's arrays into a buffer, as the infeed
            copies them towards the device.

    Returns:
        The JSON string `dataset_benchmark` returns.

    Raises:
        TypeError: When `infeed_queue` is not an `IPUInfeedQueue`.
        ValueError: When `number_of_epochs` or `elements_per_epochs` is below
            1, or the queue runs out.

    Example:

    >>> infeed = IPUInfeedQueue(batches())
    >>> stats = json.loads(infeed_benchmark(infeed, 2, 100, print_stats=False))
    """
    from keras_ipu.device.queues import IPUInfeedQueue

    if not isinstance(infeed_queue, IPUInfeedQueue):
        raise TypeError(f"infeed_queue must be a keras_ipu.ipu_infeed_queue.IPUInfeedQueue, got "
                        f"{type(infeed_queue).__name__}.")
    # A new pass, on across the epochs; for a one-pass iterator, which has none, the
    # queue's own elements (those it looked at or had put back first).
    source = (iter(infeed_queue.dataset) if _restarts(infeed_queue.dataset)
              else infeed_queue.elements())
    return dataset_benchmark(source, number_of_epochs, elements_per_epochs,
                             print_stats=print_stats, do_memcpy=do_memcpy)


def _elements(dataset: Any) -> Iterator[Any]:
    try:
        from keras.utils import PyDataset
    except ImportError:  # pragma: no cover - Keras is a dependency
        PyDataset = ()
    if isinstance(dataset, PyDataset):
        count = dataset.num_batches
        return (dataset[i] for i in (itertools.count() if count is None else range(count)))
    if isinstance(dataset, Iterable):
        return iter(dataset)
    raise TypeError(f"dataset must be a keras.utils.PyDataset or an iterable of elements, "
                    f"got {type(dataset).__name__}.")


def _restarts(dataset: Any) -> bool:
    """Whether each epoch starts the source again (it is not a one-pass iterator)."""
    return not isinstance(dataset, Iterator)


def _epoch(stream: Iterator[Any], elements: int, do_memcpy: bool, epoch: int) -> dict:
    processed = total_bytes = 0
    started = time.perf_counter()
    for element in itertools.islice(stream, elements):
        leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(element)]
        if do_memcpy:
            for leaf in leaves:
                np.copyto(np.empty_like(leaf), leaf)
        total_bytes += sum(leaf.nbytes for leaf in leaves)
        processed += 1
    elapsed = time.perf_counter() - started
    if processed < elements:
        raise ValueError(f"The dataset ran out after {processed} elements in epoch {epoch + 1}; "
                         f"elements_per_epochs is {elements}. Repeat the dataset or ask for "
                         f"fewer elements.")
    return {
        "elements_processed": processed,
        "total_bytes_processed": total_bytes,
        "time_elapsed": elapsed,
        "elements_per_second": processed / elapsed if elapsed else float("inf"),
        "bandwidth": total_bytes / elapsed / 1e9 if elapsed else float("inf"),
    }


__all__ = ["dataset_benchmark", "infeed_benchmark"]
