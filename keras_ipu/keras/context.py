"""The context a model runs in: the active strategy, a model's host state, its scope and IPUs.

This module sits at the bottom of `keras_ipu.keras`: the strategy, the
extensions, the trainer, the stage assignment and the pipelined executor all
read the model's state through `state_of(model)` and the active strategy
through `current_strategy()`, so none of them needs to import another for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax

from keras_ipu.device import system as ipu_system

# The strategies whose scopes are active, innermost last.
_active: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "keras_ipu_strategy_stack", default=()
)

# The one instance-dict entry keras_ipu keeps on a model. Written into
# `__dict__` directly: Keras' attribute tracking must not see it.
STATE_ATTRIBUTE = "_ipu_state"


def current_strategy() -> Any:
    """The innermost `IPUStrategy` whose scope is active, or `None`.

    Returns:
        The strategy, or `None` outside every strategy scope.

    Example:

    >>> with strategy.scope():
    ...     current_strategy() is strategy
    True
    """
    stack = _active.get()
    return stack[-1] if stack else None


@contextlib.contextmanager
def strategy_scope(strategy: Any) -> Iterator[Any]:
    """Makes `strategy` the active strategy inside the context.

    Args:
        strategy: An `IPUStrategy`.

    Returns:
        A context manager yielding `strategy`.

    Example:

    >>> with strategy_scope(strategy):
    ...     model = keras.Sequential([...])   # gains the IPU extension
    """
    token = _active.set(_active.get() + (strategy,))
    try:
        yield strategy
    finally:
        _active.reset(token)


@dataclasses.dataclass(eq=False)
class IPUModelState:
    """What keras_ipu keeps on the host for one model, in one place.

    Args:
        strategy: The `IPUStrategy` the model was created in (`None` for a
            plain model).
        options: The model's `IPUOptions`, or `None` for the defaults.
        programs: Per mode, `(cache key, Run)` of the last compiled run.
        pending_state: `(device state, codec)` of the latest execution that
            Keras' variables have not received yet (`jax_state_sync`).
        asynchronous_hooks: Whether a run's batch hooks run beside its
            executions (`set_asynchronous_callbacks(True)`) now.
        synced_state: During a run, Keras' state dict the variables last
            received from an execution: what callbacks' writes are told from.
        synced_from: The device state that dict was made from.
        compilations: How many times `compile()` dropped the model's
            programs: a run whose count moved (a callback compiled) stops on
            the state the model had when compiled, where an option setter's
            stop keeps the execution that ran.
        hooks_replaced_metrics: Whether an asynchronous hook ran the
            model's own `test_on_batch` (which resets the metrics first):
            its metric state lands whole after the running execution.
        hooks_wrote_metrics: Whether the hooks of a run's last execution
            changed the metric variables (a reset; not a nested run, which
            syncs its own): its epoch logs are then Keras' metric results.
        assignment: The pipeline stage assignment (a `stages` assignment
            state), created on first use.
        traced_graph: The graph traced from a subclassed model's `call`,
            with the build config it was traced for.
        called_dtypes: The dtypes of the inputs a subclassed model was
            first called with, flat (the export's input dtypes: such a model
            has no `keras.Input` to say them); `None` until then.
        validation: The `FitValidation` of a running `fit`, which the model's
            `evaluate(..., _use_cached_eval_dataset=True)` runs (as Keras'
            `fit` calls it); `None` outside a `fit`.

    Example:

    >>> state_of(model).options is None   # no option was set yet
    True
    """

    strategy: Any = None
    options: Any = None
    programs: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    pending_state: Any = None
    asynchronous_hooks: bool = False
    synced_state: Any = None
    synced_from: Any = None
    hooks_replaced_metrics: bool = False
    hooks_wrote_metrics: bool = False
    compilations: int = 0
    assignment: Any = None
    traced_graph: Any = None
    called_dtypes: tuple[str, ...] | None = None
    validation: Any = None


def state_of(model: Any) -> IPUModelState:
    """A model's keras_ipu host state, created empty on first use.

    Args:
        model: A Keras model (an IPU extension model or a plain one).

    Returns:
        The model's `IPUModelState` (the same object on every call).

    Example:

    >>> state_of(model).programs.keys()
    dict_keys(['fit'])
    """
    state = vars(model).get(STATE_ATTRIBUTE)
    if state is None:
        state = vars(model)[STATE_ATTRIBUTE] = IPUModelState()
    return state


def record_called_dtypes(model: Any, inputs: Any) -> None:
    """Keeps the dtypes of the first inputs a model is called with that all have one.

    Args:
        model: A Keras model.
        inputs: The inputs of a call (arrays, tensors or symbolic tensors,
            nested in lists, tuples and dicts).

    Example:

    >>> record_called_dtypes(model, np.zeros((2, 3), "int32"))
    >>> state_of(model).called_dtypes
    ('int32',)
    """
    state = state_of(model)
    if state.called_dtypes is not None:
        return
    dtypes = [getattr(leaf, "dtype", None) for leaf in jax.tree_util.tree_leaves(inputs)]
    if dtypes and all(d is not None for d in dtypes):
        # NumPy and JAX dtypes have a `name`; a KerasTensor's dtype is its name.
        state.called_dtypes = tuple(getattr(d, "name", None) or str(d) for d in dtypes)


def model_scope(model: Any) -> contextlib.AbstractContextManager:
    """The scope of the strategy a model was created in, or a null context.

    Models run outside their strategy's scope too; the scope is entered so
    that `PipelineStage` scopes in a subclassed model's `call` work.

    Args:
        model: A Keras model.

    Returns:
        A context manager.

    Example:

    >>> with model_scope(model):
    ...     model.call(inputs)
    """
    strategy = state_of(model).strategy
    return strategy_scope(strategy) if strategy is not None else contextlib.nullcontext()


def device_ipus(model: Any) -> tuple[Any, ...]:
    """The IPUs of the device a model runs on (its strategy's `ipu_device`).

    Args:
        model: A Keras model.

    Returns:
        The `VirtualIPU`s of the device, in order.

    Raises:
        RuntimeError: When no IPU system is configured.

    Example:

    >>> len(device_ipus(model))
    4
    """
    strategy = state_of(model).strategy
    device = strategy.ipu_device if strategy is not None else 0
    return tuple(ipu_system.require().ipus_of_device(device))
