"""User data as the host arrays the feeds batch: which data are arrays, their dtypes, sizes.

Example:

```python
data = as_arrays((x, y, None))              # None: not arrays (a generator, a PyDataset)
rows = common_length(tree_map(host_array, data))
```
"""

from __future__ import annotations

import contextlib
import functools
import random
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import sparse as jax_sparse
from keras.src import backend


def batch_size_of(batch: Any) -> int | None:
    """The leading dimension of a batch's first array (`None` for a batch of scalars)."""
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(batch) if np.ndim(leaf)]
    return np.shape(leaves[0])[0] if leaves else None


class Stacked:
    """Batches stacked on a new leading axis as they are read, leaf by leaf (as `np.stack`).

    Each batch is copied in when it comes: a generator may refill the arrays
    it yielded before the next batch, and a row copied at once is the
    execution's only copy.

    Args:
        count: The batches to stack.

    Example:

    >>> rows = Stacked(2)
    >>> rows.add(first); rows.add(second)
    >>> rows.result["x"].shape     # (2, batch, ...)
    """

    def __init__(self, count: int):
        self.count, self.result, self._added = count, None, 0

    def add(self, batch: Any) -> None:
        if self.result is None:
            self.result = jax.tree_util.tree_map(
                lambda a: np.empty((self.count, *np.shape(a)), np.asarray(a).dtype), batch)
        self.result = jax.tree_util.tree_map(self._written, self.result, batch)
        self._added += 1

    def _written(self, rows: np.ndarray, value: Any) -> np.ndarray:
        value = np.asarray(value)
        if value.dtype != rows.dtype:  # as np.stack: the dtypes' common type
            rows = rows.astype(np.result_type(rows.dtype, value.dtype))
        rows[self._added] = value
        return rows

    @property
    def added(self) -> int:
        """The batches stacked so far."""
        return self._added


def ran_out(role: Any, plan: Any, read: int, executions_before: int) -> None:
    """Warns that a source ran out of data, which ends the pass; refuses it if nothing ran.

    Args:
        role: The run's `data.Role` (what its errors call the data and steps).
        plan: The run's `data.FeedPlan`.
        read: Batches read for the execution that could not be completed.
        executions_before: Executions the feed completed before, in this run.

    Raises:
        ValueError: If the batches read are all the run would get: fewer than
            one execution needs, and none ran before (plain Keras would have
            run them; the run would report nothing).

    Example:

    >>> ran_out(ROLES["evaluate"], plan, read=3, executions_before=0)   # spe 4: raises
    """
    if read and not executions_before:
        raise ValueError(
            f"{role.subject} ran out after {read} batches, fewer than one execution "
            f"takes ({plan.steps_per_execution} steps per execution x {plan.replicas} "
            f"replicas = {plan.batches_per_execution} batches): nothing was run. Provide "
            f"at least {plan.batches_per_execution} batches (`{role.steps_argument}` of them), "
            f"or compile with a smaller `steps_per_execution`."
        )
    warnings.warn(
        "Your input ran out of data; interrupting the epoch. Make sure that your dataset or "
        "generator can generate at least `steps_per_epoch * epochs` batches (a last "
        "incomplete execution is dropped).",
        stacklevel=3,
    )


def as_tuple(batch: Any) -> tuple:
    """A batch as Keras' `(x, y, sample_weight)`-style tuple.

    As Keras' `unpack_x_y_sample_weight`, a list is such a tuple and a
    trailing `None` (no targets, no weights) is no part: `[x, y]` and
    `(x, y, None)` are the batch `(x, y)`.
    """
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple):
        return (batch,)
    while len(batch) > 1 and batch[-1] is None:
        batch = batch[:-1]
    return batch


def as_arrays(data: Any) -> Any | None:
    """`data` when every leaf is a NumPy or JAX array, else `None`."""
    # Only containers are walked: a generator or dataset is one leaf.
    leaves = jax.tree_util.tree_leaves(
        data, is_leaf=lambda v: not isinstance(v, (tuple, list, dict))
    )
    leaves = [leaf for leaf in leaves if leaf is not None]
    if leaves and all(isinstance(leaf, (np.ndarray, jax.Array)) for leaf in leaves):
        return data
    return None


_NOT_NUMBERS = {"U": "strings", "S": "bytes", "O": "Python objects"}


def check_numeric(arrays: tuple, role: str) -> None:
    """Refuses array data of strings, bytes or Python objects, naming the array.

    Args:
        arrays: `(x, y, sample_weight)`, each an array, a structure of arrays or `None`.
        role: The run's role (`"validation"` names `validation_data`'s parts).

    Raises:
        ValueError: For such an array: JAX holds numbers only.

    Example:

    >>> check_numeric((np.array(["a"]), None, None), "fit")
    Traceback (most recent call last):
    ValueError: `x` is an array of strings (<U1, shape (1,)): ...
    """
    prefix = "validation_data's " if role == "validation" else ""
    for name, part in zip(("x", "y", "sample_weight"), arrays):
        for path, leaf in jax.tree_util.tree_leaves_with_path(part):
            kind = getattr(getattr(leaf, "dtype", None), "kind", None)
            if kind in _NOT_NUMBERS:
                raise ValueError(
                    f"`{prefix}{name}{jax.tree_util.keystr(path)}` is an array of "
                    f"{_NOT_NUMBERS[kind]} ({leaf.dtype}, shape {leaf.shape}): the IPU is fed "
                    f"numbers only. Turn them into numbers first (a StringLookup or "
                    f"TextVectorization adapted and run on the data, or `astype`).")


def host_array(value: Any) -> np.ndarray:
    """`value` as a NumPy array of the dtype it is fed in (floatx, 32-bit integers)."""
    array = np.asarray(value)
    dtype = _host_dtype(array.dtype, backend.floatx())
    return array if dtype is None else array.astype(dtype)


def batch_arrays(batch: Any) -> Any:
    """Each array of a batch an adapter yields as `batch_array` makes it."""
    # A BCOO array is a pytree of its own: one leaf here.
    return jax.tree_util.tree_map(batch_array, batch,
                                  is_leaf=lambda v: isinstance(v, jax_sparse.JAXSparse))


def batch_array(value: Any) -> np.ndarray:
    """A batch an adapter yields (a generator's, a `PyDataset`'s) as JAX would hold it.

    Unlike array data, which Keras casts to floatx, such batches keep their
    dtype (a float16 batch stays float16), but for 64-bit types, which JAX
    narrows to 32 bits. Sparse batches (SciPy's, JAX's BCOO) become dense:
    Keras feeds a sparse matrix given as array data dense too.
    """
    if hasattr(value, "toarray"):  # a SciPy sparse matrix or array
        value = value.toarray()
    elif isinstance(value, jax_sparse.JAXSparse):
        value = value.todense()
    array = np.asarray(value)
    return array.astype(jax.dtypes.canonicalize_dtype(array.dtype), copy=False)


@functools.lru_cache(maxsize=64)
def _host_dtype(dtype: np.dtype, floatx: str) -> str | None:
    """The dtype host data of `dtype` is fed in, or `None` to keep it (cached: Keras'
    dtype checks cost tens of microseconds per array in every fit)."""
    if backend.is_float_dtype(dtype) and str(dtype) != floatx:
        return floatx
    if dtype in (np.int64, np.uint64):
        # JAX runs 32-bit integers unless x64 is enabled.
        return "int32" if dtype == np.int64 else "uint32"
    return None


def batch_change(subject: str, shapes: Any, first: Any) -> str:
    """The error's message for a batch whose shapes are not the first batch's.

    Args:
        subject: The data, as the message's subject ("The provided set of data").
        shapes: The batch's shapes (`np.shape` of each array).
        first: The first batch's.

    Returns:
        The message: a batch of another structure (targets or sample weights
        that come or go, inputs in another container) or of other shapes.

    Example:

    >>> batch_change("The provided set of data", ((4, 3), (4,)), ((8, 3), (8,)))
    'The provided set of data contains a batch with shapes ...'
    """
    def is_shape(value):
        return isinstance(value, tuple) and all(isinstance(d, int) for d in value)

    if (jax.tree_util.tree_structure(shapes, is_leaf=is_shape)
            != jax.tree_util.tree_structure(first, is_leaf=is_shape)):
        return (f"{subject} contains a batch of another structure than the first: shapes "
                f"{shapes} against {first}. Every batch must hold the same inputs, targets "
                f"and sample weights, in the same containers: the program compiled for the "
                f"first runs every batch.")
    return (f"{subject} contains a batch with shapes {shapes}, but the first batch had "
            f"shapes {first}. Executing on IPU requires all batches to have the same fully "
            f"defined shapes (no partial batches): drop or pad the remainder.")


def common_length(data: Any) -> int:
    """The samples every array of `data` has (a `ValueError` naming the sizes otherwise)."""
    lengths = {leaf.shape[0] if leaf.ndim else None for leaf in jax.tree_util.tree_leaves(data)}
    if None in lengths or len(lengths) != 1:
        sizes = [leaf.shape[:1] for leaf in jax.tree_util.tree_leaves(data)]
        raise ValueError(
            f"All arrays (inputs, targets and sample weights) must have the same "
            f"number of samples in their first dimension; got first dimensions {sizes}."
        )
    return lengths.pop()


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Puts the global random generators back as they were: Python's, NumPy's and Keras'
    (unseeded `keras.random` calls draw from it), so that user code run inside (a look
    at a `PyDataset`'s batch that plain Keras does not read there) draws nothing the
    run's own reads would have drawn.

    Example:

    >>> with random_state_kept():
    ...     last = dataset[len(dataset) - 1]
    """
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    python_state, numpy_state = random.getstate(), np.random.get_state()
    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    seed_state = None if generator is None else generator.state.value
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        if generator is None:  # made inside: the run's first draw makes it again
            global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, None)
        else:
            generator.state.assign(seed_state)


def read_by_index(dataset: Any, index: int, own_generators: bool = True) -> Any:
    """A `PyDataset`'s batch `index`, as its adapter yields it, read with the global random
    state kept, and that of the random generators the dataset holds as attributes: a look
    at a batch that plain Keras does not read there.

    Args:
        dataset: A `keras.utils.PyDataset`.
        index: The batch's index.
        own_generators: Whether to put the dataset's own generators back too
            (not while its workers draw from them: that would undo their draws).

    Returns:
        The batch as a tuple of arrays (`as_tuple`, `batch_arrays`).

    Example:

    >>> read_by_index(dataset, len(dataset) - 1)   # its last batch, for its shape
    """
    kept = _own_generators_kept(dataset) if own_generators else contextlib.nullcontext()
    with random_state_kept(), kept:
        return batch_arrays(as_tuple(dataset[index]))


# How to read and put back the state of a random generator a dataset holds as an attribute.
_GENERATOR_STATES = (
    (np.random.Generator, lambda g: g.bit_generator.state,
     lambda g, state: setattr(g.bit_generator, "state", state)),
    (np.random.RandomState, np.random.RandomState.get_state, np.random.RandomState.set_state),
    (random.Random, random.Random.getstate, random.Random.setstate),
)


@contextlib.contextmanager
def _own_generators_kept(dataset: Any) -> Iterator[None]:
    """Puts back the random generators `dataset` holds as attributes (an augmentation's
    `np.random.default_rng(seed)`, a `keras.random.SeedGenerator`) after a read."""
    from keras.random import SeedGenerator

    kept = []
    for value in getattr(dataset, "__dict__", {}).values():  # none with __slots__ alone
        if isinstance(value, SeedGenerator):
            kept.append((value, value.state.value, lambda g, state: g.state.assign(state)))
        for kind, get_state, set_state in _GENERATOR_STATES:
            if isinstance(value, kind):
                kept.append((value, get_state(value), set_state))
    try:
        yield
    finally:
        for generator, state, set_state in kept:
            set_state(generator, state)
