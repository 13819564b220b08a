"""The export of a pipelined model: one program per pipeline stage, each run on its IPU.

Stage `s`'s program takes its weights, the values the stages before it
forward (`plan.live_after[s - 1]`) and the model inputs, and returns what it
forwards (`plan.live_after[s]`, then the Keras masks those carry in the
graph; the model outputs for the last stage). The
runtime runs stage `s` on the device of IPU `device_mapping[s]` and moves the
forwarded values between devices; batches dispatched one after another
overlap across the IPUs, as a pipeline does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import keras
import numpy as np
from keras import tree
from keras.src.backend.common import masking

from keras_ipu.keras import stages
from keras_ipu.keras.pipelined import boundary


def stage_programs(model: Any, plan: Any, input_specs: Sequence[jax.ShapeDtypeStruct],
                   preprocessing_step: Callable | None, postprocessing_step: Callable | None,
                   platforms: Sequence[str],
                   flatten_outputs: Callable[[Any], tuple] = lambda o: tuple(tree.flatten(o)),
                   ) -> list[tuple[Any, list[np.ndarray]]]:
    """`(jax.export.Exported, weights)` for each stage, in order.

    `flatten_outputs` turns the model's (or the `postprocessing_step`'s)
    outputs into the last stage's flat results.

    Example:

    >>> programs = stage_programs(model, plan, specs, None, None, ("cpu",))
    """
    batch = input_specs[0].shape[0]
    programs = []
    forwarded: list[jax.ShapeDtypeStruct] = []  # what the stage before sends, as it runs
    masked: list[Any] = []  # the keys of its tensors that carry a mask, found as it traced
    for stage in range(plan.num_stages):
        variables = _stage_variables(plan, stage)
        weights = [np.asarray(v.numpy()) for v in variables]
        carried = plan.live_after[stage - 1] if stage else ()
        run, masked = _stage_function(plan, stage, variables, carried, masked,
                                      preprocessing_step, postprocessing_step, flatten_outputs)
        program = exported(run, platforms, [jax.ShapeDtypeStruct(w.shape, w.dtype)
                                            for w in weights], forwarded, list(input_specs))
        programs.append((program, weights))
        if stage < plan.num_stages - 1:
            # The types and shapes its layers give (a Lambda's graph type is float32,
            # whatever it returns), each checked for the batch axis as predict checks it.
            forwarded = [jax.ShapeDtypeStruct(aval.shape, aval.dtype)
                         for aval in program.out_avals]
            for key, spec in zip(plan.live_after[stage], forwarded):
                boundary.check_batched(spec.shape, batch, plan.tensors[key], stage)
    return programs


def exported(function: Callable, platforms: Sequence[str], *specs: Any) -> Any:
    """`jax.export` of `jax.jit(function)` on `specs`, refusing host callbacks clearly.

    Raises:
        ValueError: When the program calls the host (JAX cannot serialize such calls).
    """
    try:
        return jax.export.export(jax.jit(function), platforms=tuple(platforms))(*specs)
    except NotImplementedError as error:
        if "host_callbacks" not in str(error):
            raise
        raise ValueError(
            "The model calls the host from its program (a host callback: `print_tensor`, "
            "a host embedding's lookup, `jax.debug.callback` or `jax.pure_callback`), "
            "which an export cannot hold: it runs without this Python process. Export a "
            "model without these calls (the same layers and weights, with the printing "
            "or the host lookups left out).") from None


def postprocessed(postprocessing_step: Callable, outputs: Any) -> Any:
    """The step applied to the model's outputs, as the reference applies it: one argument
    per output of a list or tuple of outputs (`post(sum_out, prod_out)`), else the
    outputs (one tensor, or a dict) as one argument.

    Example:

    >>> postprocessed(lambda a, b: a + b, [a, b])
    """
    if isinstance(outputs, (list, tuple)):
        return postprocessing_step(*outputs)
    return postprocessing_step(outputs)


def preprocessed(preprocessing_step: Callable, inputs: Sequence[Any], structure: Any) -> list:
    """The step applied to the export's inputs, as the model's flat inputs.

    The step gives one input, a list or tuple of them in order, or the
    structure the model takes (the dict of a dict-input model).

    Args:
        preprocessing_step: The export's preprocessing step.
        inputs: The export's inputs, in order.
        structure: The model's input structure (`plan.inputs_struct`).

    Returns:
        The model's inputs, flat, in `keras.tree.flatten` order of `structure`.

    Raises:
        ValueError: For a dict whose keys are not the model's.

    Example:

    >>> preprocessed(lambda image, meta: {"image": image / 255, "meta": meta}, (x, m), struct)
    """
    given = preprocessing_step(*inputs)
    if isinstance(given, (list, tuple)):
        return list(given)
    if not isinstance(given, dict):
        return [given]
    expected = sorted(structure) if isinstance(structure, dict) else None
    if sorted(given) != expected:
        raise ValueError(
            f"The preprocessing step returned a dict of {sorted(given)}, but the model takes "
            f"{'a dict of ' + str(expected) if expected else 'no dict'}: return the model's "
            f"inputs as it takes them, or in order as a list.")
    return tree.flatten(given)


def _stage_function(plan, stage: int, variables: list, carried: Sequence[Any],
                    masks_in: Sequence[Any], preprocessing_step, postprocessing_step,
                    flatten_outputs):
    """The stage's function, and the list its trace fills with the keys of the tensors it
    sends with a mask: those whose value carries one, as Keras layers find it at run time
    (a layer returning its input unchanged keeps the input's, which Keras' graph drops)."""
    last = stage == plan.num_stages - 1
    forwarded = plan.output_keys if last else plan.live_after[stage]
    masks_out: list[Any] = []

    def run(weights, carried_values, inputs):
        if preprocessing_step is not None:
            inputs = preprocessed(preprocessing_step, inputs, plan.inputs_struct)
        values = dict(zip(carried, carried_values))
        for key, mask in zip(masks_in, carried_values[len(carried):]):
            masking.set_keras_mask(values[key], mask)
        values.update(zip(plan.input_keys, inputs))
        with keras.StatelessScope(state_mapping=list(zip(variables, weights))):
            for call in plan.stages[stage]:
                args, kwargs = stages.call_arguments(call, values, training=False)
                values.update(zip(call.output_keys, tree.flatten(call.operation(*args, **kwargs))))
        result = [values[key] for key in forwarded]
        if last:
            outputs = tree.pack_sequence_as(plan.outputs_struct, result)
            result = flatten_outputs(outputs if postprocessing_step is None
                                     else postprocessed(postprocessing_step, outputs))
        # The masks Keras layers find on the forwarded tensors cross with them, after them.
        masks_out[:] = [] if last else [key for key in forwarded
                                        if _carries_mask(values[key], plan.tensors[key])]
        return tuple(result) + tuple(_mask_of(values[key], plan.tensors[key])
                                     for key in masks_out)

    return run, masks_out


def _carries_mask(value, tensor) -> bool:
    return (masking.get_keras_mask(value) is not None
            or boundary.symbolic_mask(tensor) is not None)


def _mask_of(value, tensor):
    """The value's mask, or all True where nothing was masked."""
    mask = masking.get_keras_mask(value)
    if mask is not None:
        return mask
    return boundary.carried_mask(value, value.shape[0], boundary.symbolic_mask(tensor).shape[1:])


def _stage_variables(plan, stage: int) -> list:
    """The variables of a stage's layers, each once."""
    seen: dict[int, Any] = {}
    for operation in plan.stage_layers(stage):
        for variable in getattr(operation, "variables", []):
            seen.setdefault(id(variable), variable)
    return list(seen.values())


__all__ = ["exported", "postprocessed", "preprocessed", "stage_programs"]
