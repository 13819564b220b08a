"""Host embeddings of `ipu.embedding_ops`: a table on the host, looked up and trained on IPUs.

IPU TensorFlow keeps a `HostEmbedding`'s table in host memory: a compiled
program sends the indices it looks up to the host, which sends the rows
back, and, for a trainable embedding, its backward pass sends the rows'
gradients to the host, which applies SGD to the table. keras_ipu does the
same with JAX host callbacks:

- The table is a NumPy array (`get_embedding_tensor()`), updated in place.
- `lookup(indices)` inside a traced (jitted) function fetches the rows with
  a host callback; run outside `with embedding.register():` (which registers
  it with the configured IPU system, as IPU TensorFlow with its session) it raises
  (tracing it, when a Keras model is built, needs no registration).
- A trainable lookup is a `jax.custom_vjp` whose backward pass sends the
  indices and the rows' gradients to the host: SGD there,
  `table[i] -= learning_rate * gradient` (duplicate indices add up). The
  backward pass runs only when the program differentiates with respect to
  the embedding's `variable`, IPU TensorFlow's `__dummy` variable: a Keras
  layer that looks up keeps it as an attribute, so that the model trains
  it; a JAX function differentiates with respect to a value it maps the
  variable to (`keras.StatelessScope`). Forward-only programs never update.
- `HostEmbeddingSGDGAOptimizerSpec(lr, k)` keeps each replica's updates of
  `k` backward passes on the host and then applies their sum, as IPU
  TensorFlow's host does; lookups in between see the table as it was.
- Replicas look up and update the one host table; each replica's updates
  are applied as they arrive (the table moves by their sum). The partition
  strategy ("TOKEN" or "ENCODING") only splits remote-buffer embeddings
  between replicas on an IPU; it is checked and kept.

Example:

```python
embedding = embedding_ops.create_host_embedding(
    "words", (1000, 16), np.float32,
    optimizer_spec=embedding_ops.HostEmbeddingOptimizerSpec(0.1))
with embedding.register():
    vectors = jax.jit(embedding.lookup)(ids)   # [*ids.shape, 16]
```
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax._src import dispatch as jax_dispatch
from jax.experimental import io_callback

from keras_ipu.device import collectives
from keras_ipu.device import system as ipu_system

PARTITION_STRATEGIES = ("TOKEN", "ENCODING")
OPTIMIZERS = ("SGD", "SGD+GA")

# Host callbacks of several replicas (device threads) reach the host ends at once.
_LOCK = threading.Lock()
# The index a replica looks up when another replica's indices are out of range: its host
# end then raises too (see `_failing_together`).
_ELSEWHERE = int(np.iinfo(np.int32).min)


def _registry() -> dict:
    """The host ends registered with the configured system, by name."""
    return ipu_system.require().host_embeddings


@dataclasses.dataclass
class _HostEnd:
    """A registered embedding on the host: its table and the updates it accumulates."""

    table: np.ndarray
    learning_rate: float
    accumulation_factor: int = 1
    # Per replica: the (indices, gradients) of backward passes not yet applied.
    pending: dict = dataclasses.field(default_factory=dict)

    def rows(self, indices: np.ndarray) -> np.ndarray:
        tokens = self.table.shape[0]
        outside = indices[(indices < 0) | (indices >= tokens)]
        if outside.size:
            where = ("another replica looked up indices" if (outside == _ELSEWHERE).all()
                     else f"lookup of indices {outside[:8].tolist()}")
            raise IndexError(f"Host embedding {where} outside [0, {tokens - 1}]; look up "
                             f"with clip_indices=True to clip them.")
        return self.table[indices]

    def update(self, replica: int, indices: np.ndarray, gradients: np.ndarray) -> None:
        passes = self.pending.setdefault(replica, [])
        passes.append((indices, gradients))
        if len(passes) < self.accumulation_factor:
            return
        for step_indices, step_gradients in passes:
            # np.subtract.at adds up the updates of repeated indices.
            np.subtract.at(self.table, step_indices,
                           (self.learning_rate * step_gradients).astype(self.table.dtype))
        passes.clear()


def _registered(name: str, table: np.ndarray) -> _HostEnd:
    """The host end of embedding `name` of `table`; raises unless it is registered."""
    end = _registry().get(name)
    if end is None:
        raise RuntimeError(f"Host embedding {name!r} is not registered: look it up inside "
                           f"`with embedding.register():` (IPU TensorFlow registers it with "
                           f"the session).")
    if end.table is not table:
        raise RuntimeError(f"Another host embedding named {name!r} is registered; look this "
                           f"one up inside its own register() context.")
    return end


def _serve_rows(name: str, table: np.ndarray, indices: Any) -> np.ndarray:
    with _LOCK:
        return _registered(name, table).rows(np.asarray(indices))


def _take_gradients(name: str, table: np.ndarray, replica: Any, indices: Any, gradients: Any,
                    rows: Any) -> None:
    del rows  # an argument only so that the update follows the lookup
    with _LOCK:
        _registered(name, table).update(int(replica), np.asarray(indices),
                                        np.asarray(gradients))


def _fetch(name: str, table: np.ndarray, indices: jax.Array) -> jax.Array:
    """Traced: the rows at the flat `indices`, from the host (checked registered when run)."""
    shape = jax.ShapeDtypeStruct((indices.shape[0], table.shape[1]), table.dtype)
    return io_callback(functools.partial(_serve_rows, name, table), shape, indices,
                       ordered=False)


def _trainable_fetch(name: str, table: np.ndarray, indices: jax.Array,
                     handle: jax.Array) -> jax.Array:
    """Traced: `_fetch`, whose backward pass sends the rows' gradients to the host."""

    @jax.custom_vjp
    def lookup(handle, indices):
        return _fetch(name, table, indices)

    def forward(handle, indices):
        rows = lookup(handle, indices)
        return rows, (handle, indices, rows)

    def backward(residuals, gradients):
        handle, indices, rows = residuals
        io_callback(functools.partial(_take_gradients, name, table), None,
                    collectives.replica_index(), indices, gradients, rows, ordered=False)
        return jnp.zeros_like(handle), None

    lookup.defvjp(forward, backward)
    return lookup(handle, indices)


def _failing_together(indices: jax.Array, tokens: int) -> jax.Array:
    """Traced, replicated: every replica's lookup fails when one replica's indices are out
    of range. A replica whose host callback raised alone would leave the others waiting in
    the program's next collective until XLA stopped the whole process."""
    if collectives.replica_count() == 1:
        return indices
    outside = jnp.any((indices < 0) | (indices >= tokens))
    anywhere = collectives.cross_replica_sum(outside.astype(jnp.int32)) > 0
    return jnp.where(anywhere & ~outside, jnp.full_like(indices, _ELSEWHERE), indices)


def check_loss_unscaled(model: Any) -> None:
    """Refuses to train a model's host embeddings on a scaled loss.

    The host applies SGD to the rows' gradients as the backward pass sends
    them: a `LossScaleOptimizer`'s scale (`mixed_float16` compiles one in)
    or an optimizer's `loss_scale_factor` would multiply them, and a step the
    optimizer skips would still update the table.

    Args:
        model: A compiled Keras model about to train.

    Raises:
        ValueError: Naming the embeddings, when the optimizer scales the loss.

    Example:

    >>> check_loss_unscaled(model)   # before the first step of fit
    """
    optimizer = getattr(model, "optimizer", None)
    scaler = ("a LossScaleOptimizer" if isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
              else "loss_scale_factor" if getattr(optimizer, "loss_scale_factor", None)
              else None)
    names = sorted({variable._keras_ipu_host_embedding for variable in model.trainable_variables
                    if hasattr(variable, "_keras_ipu_host_embedding")})
    if scaler and names:
        raise ValueError(
            f"Host embeddings {names} are trained on the host by plain SGD, which does not see "
            f"the loss scale of the model's optimizer ({scaler}): the table's updates would be "
            f"multiplied by the scale and made on steps the optimizer skips. Train them without "
            f"loss scaling: a 'mixed_bfloat16' or 'float32' policy ('mixed_float16' compiles in "
            f"a LossScaleOptimizer), and no loss_scale_factor.")


class HostEmbeddingOptimizerSpec:
    """How a host embedding is trained: SGD with `learning_rate`, applied on the host.

    The device computes the rows' gradients; the host applies them. The
    `create_*` hooks are what `HostEmbedding` calls: on keras_ipu they act
    at once (as IPU TensorFlow's operations do in eager mode).

    Args:
        learning_rate: The SGD learning rate, a non-negative number (0: the
            embedding is not trained, as with no optimizer spec).
        optimizer_name: `None` or `"SGD"` (plain SGD), or `"SGD+GA"`
            (what `HostEmbeddingSGDGAOptimizerSpec` sets).

    Raises:
        ValueError: For a negative or non-numeric `learning_rate` or another
            `optimizer_name`.

    Example:

    >>> spec = HostEmbeddingOptimizerSpec(0.1)
    >>> spec.get_learning_rate()
    0.1
    """

    def __init__(self, learning_rate, optimizer_name=None):
        if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float,
                                                                              np.number)):
            raise ValueError(f"learning_rate must be a number, got {learning_rate!r}.")
        if learning_rate < 0:
            raise ValueError(f"learning_rate must be 0 or more, got {learning_rate}.")
        optimizer_name = optimizer_name or "SGD"
        if optimizer_name not in OPTIMIZERS:
            raise ValueError(f"optimizer_name must be one of {OPTIMIZERS} (or None), got "
                             f"{optimizer_name!r}.")
        self._learning_rate = learning_rate
        self._optimizer_name = optimizer_name

    def get_learning_rate(self):
        """The SGD learning rate.

        Returns:
            The learning rate given.
        """
        return self._learning_rate

    def _accumulation(self) -> int:
        return 1

    def create_slot_variables(self, embedding_tensor, name):
        """The optimizer's variables: the trainable embedding's differentiable handle.

        Args:
            embedding_tensor: The host table.
            name: The embedding's name.

        Returns:
            `[]` when not trained (learning rate 0); otherwise a list of one
            trainable scalar `keras.Variable` (IPU TensorFlow's `__dummy`):
            differentiating with respect to it runs the lookups' backward
            pass, which sends the gradients to the host.
        """
        if self._learning_rate == 0:
            return []
        handle = keras.Variable(np.zeros((), np.float32), trainable=True, name=f"{name}__dummy")
        handle._keras_ipu_host_embedding = name  # what check_loss_unscaled looks for
        return [handle]

    def create_register_instruction(self, embedding_tensor, slot_vars, name):
        """Registers the table on the host, so that lookups of `name` reach it.

        Called when entering the `HostEmbedding.register()` context.

        Args:
            embedding_tensor: The host table.
            slot_vars: The slot variables.
            name: The embedding's name.

        Returns:
            The host end: the object serving lookups and taking updates.

        Raises:
            ValueError: When an embedding of that name is registered already.
        """
        with _LOCK:
            if name in _registry():
                raise ValueError(f"A host embedding named {name!r} is registered already; "
                                 f"leave its register() context first or use another name.")
            end = _HostEnd(embedding_tensor, float(self._learning_rate), self._accumulation())
            _registry()[name] = end
        return end

    def create_lookup_instruction(self, embedding_tensor, indices, slot_vars,
                                  partition_strategy, name):
        """Traced: the rows at the flat `indices`, fetched from the host.

        Args:
            embedding_tensor: The host table.
            indices: Flat integer indices, traced.
            slot_vars: The slot variables (the handle of a trainable one).
            partition_strategy: `"TOKEN"` or `"ENCODING"` (no effect here).
            name: The embedding's name.

        Returns:
            `[len(indices), encoding width]` rows; trainable when the spec's
            learning rate is not 0.
        """
        if not slot_vars:
            return _fetch(name, embedding_tensor, indices)
        # The variable's value: in a Keras step (a stateless scope) the traced one.
        handle = jnp.asarray(slot_vars[0].value)
        return _trainable_fetch(name, embedding_tensor, indices, handle)

    def create_deregister_instruction(self, embedding_tensor, slot_vars, name):
        """Ends the registration, once running programs have sent their updates.

        Called when leaving the `HostEmbedding.register()` context. Updates
        still accumulating (`HostEmbeddingSGDGAOptimizerSpec`) are dropped,
        as IPU TensorFlow's host drops them.

        Args:
            embedding_tensor: The host table.
            slot_vars: The slot variables.
            name: The embedding's name.

        Returns:
            The host table.
        """
        try:
            jax.effects_barrier()
        except jax.errors.JaxRuntimeError:
            # A program that failed while it ran (a lookup out of range) raised its error
            # to its caller; its devices' runtime tokens keep the error, and every later
            # barrier of the process would raise it again.
            jax_dispatch.runtime_tokens.clear()
        with _LOCK:
            _registry().pop(name, None)
        return embedding_tensor


class HostEmbeddingSGDGAOptimizerSpec(HostEmbeddingOptimizerSpec):
    """SGD with gradient accumulation on the host.

    Each replica's updates of `accumulation_factor` backward passes are kept
    and then applied together: the table moves by `learning_rate` times the
    sum of their gradients.

    Args:
        learning_rate: The SGD learning rate.
        accumulation_factor: The backward passes (mini-batches) accumulated
            before an update; 1 is plain SGD.

    Raises:
        ValueError: For an `accumulation_factor` that is not a positive int,
            or a bad `learning_rate`.

    Example:

    >>> HostEmbeddingSGDGAOptimizerSpec(0.1, 4).get_accumulation_factor()
    4
    """

    def __init__(self, learning_rate, accumulation_factor):
        if (isinstance(accumulation_factor, bool) or
                not isinstance(accumulation_factor, (int, np.integer)) or
                accumulation_factor < 1):
            raise ValueError(f"accumulation_factor must be a positive int, got "
                             f"{accumulation_factor!r}.")
        super().__init__(learning_rate, "SGD+GA" if accumulation_factor > 1 else None)
        self._accumulation_factor = int(accumulation_factor)

    def get_accumulation_factor(self):
        """The number of mini-batches whose gradients are accumulated.

        Returns:
            The accumulation factor.
        """
        return self._accumulation_factor

    def _accumulation(self) -> int:
        return self._accumulation_factor


class HostEmbedding:
    """An embedding table on the host, looked up (and trained) from the device.

    The table is rank two: tokens by encoding width. Lookups happen inside
    `with embedding.register():`.

    Args:
        name: The name that identifies the embedding.
        embedding_tensor: The table, `[tokens, width]`: a NumPy array (kept,
            and updated in place) or an array-like (copied).
        partition_strategy: `"TOKEN"` or `"ENCODING"`.
        optimizer_spec: A `HostEmbeddingOptimizerSpec`, or `None`: not trained.

    Raises:
        ValueError: For a name that is not a non-empty string, a table that
            is not rank two (or not floating point for a trained one), another
            partition strategy or optimizer spec.

    Example:

    >>> embedding = HostEmbedding("words", np.zeros((100, 8), np.float32))
    >>> with embedding.register():
    ...     rows = jax.jit(embedding.lookup)(jnp.array([3, 4]))
    """

    def __init__(self, name, embedding_tensor, partition_strategy="TOKEN", optimizer_spec=None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}.")
        if partition_strategy not in PARTITION_STRATEGIES:
            raise ValueError(f"partition_strategy must be one of {PARTITION_STRATEGIES}, got "
                             f"{partition_strategy!r}.")
        if not isinstance(optimizer_spec, (type(None), HostEmbeddingOptimizerSpec)):
            raise ValueError(f"optimizer_spec must be a HostEmbeddingOptimizerSpec or None, "
                             f"got {type(optimizer_spec).__name__}.")
        optimizer_spec = optimizer_spec or HostEmbeddingOptimizerSpec(0)
        table = _host_table(embedding_tensor)
        if optimizer_spec.get_learning_rate() and not np.issubdtype(table.dtype, np.floating):
            raise ValueError(f"A trained host embedding needs a floating-point table, got "
                             f"{table.dtype}.")
        self._name = name
        self._table = table
        self._partition_strategy = partition_strategy
        self._optimizer_spec = optimizer_spec
        self._slot_vars = optimizer_spec.create_slot_variables(table, name)

    @property
    def name(self) -> str:
        """The embedding's name."""
        return self._name

    @property
    def variable(self):
        """The trainable handle (IPU TensorFlow's `__dummy`), or `None` when not trained.

        Differentiating with respect to it runs the lookups' backward pass,
        which sends their gradients to the host. Its own gradient is zero.
        """
        return self._slot_vars[0] if self._slot_vars else None

    def get_embedding_tensor(self):
        """The host table, once running programs have sent their updates.

        Returns:
            The `[tokens, width]` NumPy array.
        """
        jax.effects_barrier()
        return self._table

    def register(self, session=None):
        """A context manager within which programs look the embedding up.

        Args:
            session: Accepted for compatibility (keras_ipu has no sessions).

        Returns:
            A context manager: entering it registers the table on the host
            and gives the embedding; leaving it waits for running programs'
            updates and ends the registration.

        Raises:
            RuntimeError: On entering, for a trained embedding in a job of
                several instances (each would train a table of its own).

        Example:

        >>> with embedding.register():
        ...     train(steps)
        """
        return _Registration(self)

    def lookup(self, indices, clip_indices=True):
        """The rows at `indices`, fetched from the host inside a traced program.

        Args:
            indices: Integer indices, any shape.
            clip_indices: Clip them to `[0, tokens - 1]`. When `False`, an
                index out of range makes the host raise `IndexError` (in every
                replica of a replicated program, where one replica's
                failure alone would leave the others waiting).

        Returns:
            `[*indices.shape, width]`, of the table's type.

        Raises:
            RuntimeError: When run (the host callback's error, inside a
                compiled program) outside `with embedding.register():`, as
                IPU TensorFlow's lookups need the embedding registered with
                the session running them; tracing needs no registration.
            ValueError: For non-integer indices.
        """
        indices = jnp.asarray(indices)
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise ValueError(f"Host embedding indices must be integers, got {indices.dtype}.")
        flat = indices.reshape(-1).astype(jnp.int32)
        if clip_indices:
            flat = jnp.clip(flat, 0, self._table.shape[0] - 1)
        else:
            flat = _failing_together(flat, self._table.shape[0])
        rows = self._optimizer_spec.create_lookup_instruction(
            self._table, flat, self._slot_vars, self._partition_strategy, self._name)
        return rows.reshape(*indices.shape, self._table.shape[1])


class _Registration:
    """`HostEmbedding.register()`'s context manager."""

    def __init__(self, embedding: HostEmbedding):
        self._embedding = embedding

    def __enter__(self) -> HostEmbedding:
        e = self._embedding
        if e._slot_vars and jax.process_count() > 1:
            raise RuntimeError(
                f"Host embedding {e._name!r} is trained on its host, and each of the "
                f"{jax.process_count()} instances of this job holds a table of its own: each "
                f"would train only on its own replicas' gradients, and the tables would drift "
                f"apart. Train it in one instance (its replicas share the table), or look it "
                f"up without training it (optimizer_spec=None).")
        e._optimizer_spec.create_register_instruction(e._table, e._slot_vars, e._name)
        return e

    def __exit__(self, *exc_info) -> None:
        e = self._embedding
        e._optimizer_spec.create_deregister_instruction(e._table, e._slot_vars, e._name)


def _host_table(embedding_tensor: Any) -> np.ndarray:
    """The table as a NumPy array: a NumPy one itself, anything else copied."""
    table = embedding_tensor if isinstance(embedding_tensor, np.ndarray) else np.array(
        keras.ops.convert_to_numpy(embedding_tensor))
    if table.ndim != 2:
        raise ValueError(f"A host embedding is rank two, [tokens, width], got shape "
                         f"{table.shape}.")
    return table


def create_host_embedding(name, shape, dtype, partition_strategy="TOKEN", optimizer_spec=None,
                          initializer=None):
    """A `HostEmbedding` of a new table.

    Args:
        name: The name that identifies the embedding.
        shape: `[tokens, width]`.
        dtype: The table's type.
        partition_strategy: `"TOKEN"` or `"ENCODING"`.
        optimizer_spec: A `HostEmbeddingOptimizerSpec`, or `None`: not trained.
        initializer: A Keras initializer (or its name), or a function of
            `(shape, dtype)`; `None`: Glorot uniform, as TensorFlow's
            variables.

    Returns:
        The `HostEmbedding`.

    Raises:
        ValueError: For a shape that is not two positive ints, or what
            `HostEmbedding` refuses.

    Example:

    >>> embedding = create_host_embedding("words", [1000, 16], np.float32,
    ...                                   initializer=keras.initializers.RandomNormal(seed=1))
    """
    shape = tuple(shape)
    if len(shape) != 2 or not all(isinstance(s, (int, np.integer)) and s > 0 for s in shape):
        raise ValueError(f"shape must be two positive ints, [tokens, width], got {shape}.")
    dtype = np.dtype(keras.backend.standardize_dtype(dtype))
    values = keras.initializers.get(initializer or "glorot_uniform")(shape, dtype=dtype.name)
    table = np.array(keras.ops.convert_to_numpy(values), dtype=dtype)
    return HostEmbedding(name, table, partition_strategy=partition_strategy,
                         optimizer_spec=optimizer_spec)


__all__ = ["HostEmbedding", "HostEmbeddingOptimizerSpec", "HostEmbeddingSGDGAOptimizerSpec",
           "create_host_embedding"]
