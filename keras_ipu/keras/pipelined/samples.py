"""The per-sample shapes and types of a pipelined model's tensors, for the inputs a program
is built for.

What a stage sends the next is laid out by its tensors' shapes and types
(`boundary.Sample`). The graph does not always know them: it may leave an
axis `None` (`Input((None, 4))`: a sequence of any length), and it types a
layer's output by the layer's compute dtype unless the layer says otherwise
(a `Lambda` returning integers is float32 there). An IPU program has static
shapes, so they come from tracing the layers on the data each program is
built for, as Keras' own jit traces a step per input shape.

Example:

```python
traced = samples_for(plan, variables, x)    # x: one micro-batch of the model inputs
traced.samples[key].width                   # values per sample in the bundle
```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import keras
from keras.src import tree
from keras.src.backend.common import masking

from keras_ipu.keras import stages
from keras_ipu.keras.pipelined.boundary import Sample, symbolic_mask


class TracedSamples(NamedTuple):
    """What tracing the layers on a micro-batch's shapes found.

    Attributes:
        samples: Per tensor key of the plan, its `Sample`.
        adds_losses: Whether a layer call added a loss (`add_loss`, an
            activity regularizer), in the traced mode.
    """

    samples: dict[Any, Sample]
    adds_losses: bool


def samples_for(plan, variables: Sequence[Any], x, training: bool = False) -> TracedSamples:
    """Every tensor's `Sample` for a micro-batch of inputs like `x`.

    The graph's layer calls are traced on `x`'s shapes (nothing runs; the
    variables keep their values), in the program's mode: a layer's shapes may
    depend on it (`RandomCrop` crops in training only).

    Args:
        plan: The model's `PipelinePlan`.
        variables: The variables the model's layers read (its trainable and
            non-trainable variables).
        x: One micro-batch of the model inputs (arrays, tracers or shape
            structs, the batch first), structured as `plan.inputs_struct`.
        training: Whether the program trains.

    Returns:
        `TracedSamples`: per tensor key of the plan, its `Sample`; whether
        the calls added losses.

    Raises:
        Whatever a layer raises for inputs of these shapes.

    Example:

    >>> samples_for(plan, model.variables, np.zeros((4, 7, 3))).samples[key].shape
    (7, 8)
    """
    specs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in variables]
    inputs = jax.eval_shape(plan.flat_inputs, jax.tree_util.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), x))
    losses: list[int] = []  # filled as the trace runs
    traced = jax.eval_shape(
        lambda values, flat: _every_tensor(plan, variables, values, flat, losses, training),
        specs, inputs)
    return TracedSamples({key: _sample(plan.tensors[key], value, mask)
                          for key, (value, mask) in traced.items()}, bool(losses[0]))


def _every_tensor(plan, variables, values, flat_inputs, losses: list,
                  training: bool) -> Mapping[Any, tuple]:
    """Each tensor's value and the mask it carries, running every stage's calls in turn;
    appends to `losses` how many losses the calls added."""
    env = dict(zip(plan.input_keys, flat_inputs))
    # Within a scope: a layer's state updates and losses stay out of its variables.
    with keras.StatelessScope(state_mapping=list(zip(variables, values)),
                              collect_losses=True) as scope:
        for calls in plan.stages:
            for call in calls:
                args, kwargs = stages.call_arguments(call, env, training=training)
                outputs = call.operation(*args, **kwargs)
                env.update(zip(call.output_keys, tree.flatten(outputs)))
        losses.append(len(scope.losses))
    return {key: (value, masking.get_keras_mask(value)) for key, value in env.items()}


def _sample(tensor, value, mask) -> Sample:
    """A tensor's `Sample` from its traced value and mask.

    A mask crosses where the value carries one, as Keras layers find it at run
    time: also where the graph's tensor has none (a layer that returns its
    input unchanged keeps the input's mask, which Keras' graph drops). Where
    the graph's tensor carries a mask the value does not (nothing masked), the
    mask covers the value's leading axes, as the graph's does.
    """
    graph_mask = symbolic_mask(tensor)
    dtype = str(value.dtype)
    if graph_mask is None and mask is None:
        return Sample(tuple(value.shape[1:]), dtype=dtype)
    shape = mask.shape if mask is not None else value.shape[:len(graph_mask.shape)]
    return Sample(tuple(value.shape[1:]), tuple(shape[1:]), dtype)


__all__ = ["TracedSamples", "samples_for"]
