"""`PipelineStage` scopes and where their stages are recorded.

A layer constructed inside `PipelineStage(s)` takes stage `s` for all of its
calls; a layer call made inside a scope takes that scope's stage, which beats
the layer's. `install()` hooks Keras so both are recorded: `Operation.__new__`
(every layer and op) and `Node.__init__` (every symbolic call).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import numbers
from collections.abc import Callable, Iterator
from typing import Any

from keras.src.ops.node import Node
from keras.src.ops.operation import Operation

from keras_ipu.keras import context

# Private attribute holding the stage on a layer (constructed in a scope) or a
# node (called in a scope). Written into the instance `__dict__` so Keras'
# attribute tracking never sees it.
STAGE_ATTRIBUTE = "_ipu_pipeline_stage"

_current_stage: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "keras_ipu_pipeline_stage", default=None
)
# Lists that collect every stage entered while they are active (tracing uses
# them to tell a model that uses PipelineStage from one that does not).
_recorders: contextvars.ContextVar[tuple[list[int], ...]] = contextvars.ContextVar(
    "keras_ipu_pipeline_stage_recorders", default=()
)
# The Keras functions `install` replaced, by (class, attribute name).
_originals: dict[tuple[type, str], Any] = {}


class PipelineStage:
    """A scope that assigns Keras layers and layer calls to a pipeline stage.

    Layers constructed inside the scope are assigned to `stage` for every
    call; layer calls made inside the scope are assigned to `stage` for that
    call only, which takes precedence over the stage of the layer's
    construction. Calling a nested model inside a scope assigns every layer
    call of that nested model to the scope's stage. Scopes only work inside an
    `IPUStrategy` scope and cannot be nested. Sequential models ignore them:
    use `set_pipeline_stage_assignment` instead.

    Args:
        stage: The pipeline stage (a non-negative integer) that Keras layers
            created and/or called within this scope are assigned to.

    Raises:
        ValueError: On construction, when `stage` is not a non-negative integer.
        RuntimeError: On entry, outside an `IPUStrategy` scope or inside
            another `PipelineStage` scope.

    Example:

    >>> with keras_ipu.IPUStrategy().scope():
    ...     inputs = keras.Input((4,))
    ...     with PipelineStage(0):
    ...         x = keras.layers.Dense(8)(inputs)
    ...     with PipelineStage(1):
    ...         x = keras.layers.Dense(1)(x)
    ...     model = keras.Model(inputs, x)
    """

    def __init__(self, stage: int):
        if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage < 0:
            raise ValueError(
                f"{stage!r} is not a valid pipeline stage. Pipeline stages are "
                f"non-negative integers (0 for the first stage)."
            )
        self._stage = int(stage)
        self._tokens: list[contextvars.Token] = []

    @property
    def stage(self) -> int:
        """The pipeline stage this scope assigns."""
        return self._stage

    def __enter__(self) -> PipelineStage:
        if context.current_strategy() is None:
            raise RuntimeError(
                "PipelineStage may only be used from within an IPUStrategy context: "
                "use it inside `with keras_ipu.ipu_strategy.IPUStrategy().scope():`."
            )
        if _current_stage.get() is not None:
            raise RuntimeError(
                f"Pipeline stages must not be nested: PipelineStage({self._stage}) was "
                f"entered inside PipelineStage({_current_stage.get()})."
            )
        self._tokens.append(_current_stage.set(self._stage))
        for recorder in _recorders.get():
            recorder.append(self._stage)
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        _current_stage.reset(self._tokens.pop())

    def __repr__(self) -> str:
        return f"PipelineStage({self._stage})"


def current_pipeline_stage() -> int | None:
    """The stage of the innermost active `PipelineStage` scope, or `None`.

    Returns:
        The stage, or `None` outside every scope.

    Example:

    >>> with strategy.scope(), PipelineStage(2):
    ...     current_pipeline_stage()
    2
    """
    return _current_stage.get()


def recorded_stage(obj: Any) -> int | None:
    """The stage recorded on a layer, op or `Node` by a `PipelineStage` scope.

    Args:
        obj: A layer or operation (stage of its construction) or a Keras
            `Node` (stage of that call).

    Returns:
        The stage, or `None` when none was recorded.

    Example:

    >>> with strategy.scope(), PipelineStage(1):
    ...     layer = keras.layers.Dense(2)
    >>> recorded_stage(layer)
    1
    """
    return getattr(obj, "__dict__", {}).get(STAGE_ATTRIBUTE)


@contextlib.contextmanager
def recording() -> Iterator[list[int]]:
    """Collects the stages of the `PipelineStage` scopes entered inside it.

    Returns:
        A context manager yielding the list the stages are appended to.

    Example:

    >>> with recording() as seen:
    ...     model.call(inputs)
    >>> bool(seen)  # True when `call` uses PipelineStage scopes
    """
    seen: list[int] = []
    token = _recorders.set(_recorders.get() + (seen,))
    try:
        yield seen
    finally:
        _recorders.reset(token)


def _record(obj: Any) -> None:
    stage = _current_stage.get()
    if stage is not None:
        vars(obj)[STAGE_ATTRIBUTE] = stage


def _recording_new(original: Callable[..., Any]) -> Callable[..., Any]:
    # `__new__`, not `__init__`: Keras reads `inspect.getfullargspec(cls.__init__)`
    # for auto-configs, which a wrapped `__init__` would change.
    @functools.wraps(original)
    def new(cls, *args, **kwargs):
        instance = original(cls, *args, **kwargs)
        _record(instance)
        return instance

    return new


def _recording_init(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _record(self)

    return init


def install() -> None:
    """Hooks Keras so that `PipelineStage` scopes record stages (idempotent).

    Wraps `keras.src.ops.operation.Operation.__new__` (layers and ops
    constructed in a scope) and `keras.src.ops.node.Node.__init__` (symbolic
    calls made in a scope). Outside every scope the hooks record nothing.

    Example:

    >>> install()
    >>> install()  # a second call changes nothing
    """
    if (Operation, "__new__") not in _originals:
        original_new = Operation.__dict__["__new__"]
        _originals[(Operation, "__new__")] = original_new
        Operation.__new__ = staticmethod(_recording_new(original_new.__func__))
    if (Node, "__init__") not in _originals:
        original_init = Node.__dict__["__init__"]
        _originals[(Node, "__init__")] = original_init
        Node.__init__ = _recording_init(original_init)


def uninstall() -> None:
    """Removes the hooks `install` added; recorded stages stay where they are.

    Example:

    >>> uninstall()
    """
    for (cls, name), original in list(_originals.items()):
        setattr(cls, name, original)
        del _originals[(cls, name)]


__all__ = [
    "PipelineStage",
    "current_pipeline_stage",
    "install",
    "recorded_stage",
    "recording",
    "uninstall",
]
