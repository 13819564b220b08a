"""Keras' `train_on_batch`, `test_on_batch` and `predict_on_batch` as IPU programs.

Keras runs each as its jitted step on one batch (`model.train_function` and
its kin, made by `make_train_function` when unset). For an IPU model that
step is a program like `fit`'s executions: compiled for the batch, its memory
checked against the IPU it runs on, and run as the device connection allows
(`PRE_COMPILE`: zeros come back and the weights stay; `NEVER`:
`IPUNotAttachedError`), all before any weight changes; the floating point
exceptions the system traps stop it as they stop `fit`, and
`--use_synthetic_data` feeds it zeros. A model keeps its step for the system it
was made for: once the system is configured again, the next call makes it anew.

The step is the model's own (`train_step`, `test_step`, `predict_step`, an
override included), on one batch and on the model's first IPU, as Keras
runs it: neither pipelined nor replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from keras_ipu.device import system as ipu_system
from keras_ipu.device.attachment import CheckedFunction
from keras_ipu.distributed import runtime
from keras_ipu.errors import IPUFloatingPointError, IPUNotAttachedError, IPUOutOfMemoryError
from keras_ipu.keras import context, step_callbacks


class _Step(NamedTuple):
    function: str  # the model attribute Keras' method calls
    maker: str  # the Keras method that sets it when unset
    step: str  # the model's step it runs


_STEPS = {
    "train_on_batch": _Step("train_function", "make_train_function", "train_step"),
    "test_on_batch": _Step("test_function", "make_test_function", "test_step"),
    "predict_on_batch": _Step("predict_function", "make_predict_function", "predict_step"),
}


def on_this_instance(method: str, originals: dict[str, Callable]) -> Callable:
    """An IPU model's `method`: Keras' own, in the model's scope, its step a checked program.

    Args:
        method: `"train_on_batch"`, `"test_on_batch"` or `"predict_on_batch"`.
        originals: Keras' methods by name (looked up at each call).

    Returns:
        `method(model, *args, **kwargs)`.

    Example:

    >>> JAXTrainer.train_on_batch = on_this_instance("train_on_batch", originals)
    """
    def on_ipus(model, *args, **kwargs):
        if method != "predict_on_batch":  # a step of the job's weights: one instance's only
            runtime.check_one_instance(f"`{method}`")
        model_state = context.state_of(model)
        if model_state.asynchronous_hooks and step_callbacks.on_hooks_thread():
            if method == "train_on_batch":  # would land behind the running execution's steps
                step_callbacks.check_not_in_async_hooks(model, method)
            elif method == "test_on_batch":  # see `step_callbacks.hook_writes`
                model_state.hooks_replaced_metrics = True
        synced = getattr(model, "_jax_state_synced", True)
        with context.model_scope(model):
            install(model, method)
            try:
                return originals[method](model, *args, **kwargs)
            except (IPUOutOfMemoryError, IPUNotAttachedError, IPUFloatingPointError):
                # Refused, or its results dropped: the variables are still the model's
                # state, not the state Keras kept from its last step.
                model._jax_state_synced = synced
                raise

    return on_ipus


def install(model: Any, method: str) -> None:
    """Gives `model` its step for `method` as a checked IPU program, unless it has it.

    A model whose class makes the function itself (overrides Keras'
    `make_train_function`, say) keeps its own.

    Args:
        model: An IPU model (created in an `IPUStrategy`).
        method: `"train_on_batch"`, `"test_on_batch"` or `"predict_on_batch"`.

    Raises:
        RuntimeError: For a model compiled with `run_eagerly=True`, as `fit`.

    Example:

    >>> install(model, "train_on_batch")
    >>> model.train_on_batch(x, y)   # Keras' method, the checked program's step
    """
    from keras_ipu.keras import programs  # programs imports the layers this one serves

    programs.check_not_eager(model)  # as `fit`: the step would run compiled regardless
    spec = _STEPS[method]
    if programs.overrides(model, spec.maker):
        return
    current = getattr(model, spec.function, None)
    if isinstance(current, _OneBatch) and current.checked.system is ipu_system.current():
        return  # made for this system (its IPUs' memory, traps, synthetic data)
    ipu = context.device_ipus(model)[0].index
    step = _predict_step(model) if spec.step == "predict_step" else getattr(model, spec.step)
    setattr(model, spec.function, _OneBatch(CheckedFunction(step, ipu, method), model))


class _OneBatch:
    """Keras' step function of `_make_function` for one batch: `(state, iterator)`."""

    def __init__(self, checked: CheckedFunction, model: Any):
        self.checked, self._model_state = checked, context.state_of(model)

    def __call__(self, state: Any, iterator: Any) -> tuple[Any, Any]:
        # As Keras' jit does, the step consumes the state it is given; not in an
        # asynchronous hook (of this model's run or of one sharing its layers), whose
        # writes are told from the state it was synced to.
        donate = not (self._model_state.asynchronous_hooks or step_callbacks.on_hooks_thread())
        return self.checked(state, next(iterator), donate=donate)


def _predict_step(model: Any):
    """Keras' predict function's step: the predictions, and the state it gives back."""
    def predict_step(state, data):
        outputs, non_trainable_variables = model.predict_step(state, data)
        return outputs, (state[0], non_trainable_variables)

    return predict_step
