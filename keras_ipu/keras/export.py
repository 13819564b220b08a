"""Exporting a model for serving: its inference program, frozen, with a Keras-free runtime.

An export directory holds what `keras_ipu.serving.runtime` needs and nothing
of Keras: the inference program for a fixed batch size as serialized
StableHLO (`jax.export`), twice (`step.jaxexport`: one batch per call;
`loop.jaxexport`: `steps_per_execution` batches per call, the exported loop),
or for a pipelined model one program per stage (`stage_<s>.jaxexport`, run on
the stage's IPU; `export_pipeline.py`),
the weights as a NumPy archive (`weights.npz`, loaded without pickle), and
`metadata.json` (signatures, batch size, iterations, IPUs, stage mapping,
platforms, keras_ipu version). The program takes the weights as arguments, so
the StableHLO stays small and the weights stay a plain archive.
"""

from __future__ import annotations

import inspect
import json
import numbers
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import keras
import numpy as np
from keras import KerasTensor, tree

from keras_ipu.keras import context, data, options, saving
from keras_ipu.serving import runtime

_SIGNATURE_ERROR = (
    "Cannot get model's input signature. Please specify the input shape using "
    "`model.build()` or invoke your model using real data."
)
# The name Keras gives an input tensor no one named (`keras_tensor`, `keras_tensor_3`, ...).
_KERAS_TENSOR_NAME = "keras_tensor"
_BATCH_ERROR = (
    "Not all dimensions of inputs can be determined. Please specify batch size in model's "
    "input layer or specify `batch_size` parameter when exporting model."
)


def _open_axes_hint(shape: tuple) -> str:
    """What fixes an input's unknown axes beyond the batch: the batch size does not."""
    axes = [axis for axis, d in enumerate(shape) if d is None and axis > 0]
    if not axes:
        return ""
    return (f"; axes {axes} beyond the batch are unknown: an exported program has fixed "
            f"shapes, so give the input layer those sizes, e.g. keras.Input(shape=(...))")


def export_model(model: Any, export_dir: str, batch_size: int | None = None,
                 output_names: str | Sequence[str] | None = None,
                 preprocessing_step: Callable[..., Any] | None = None,
                 postprocessing_step: Callable[..., Any] | None = None,
                 purge_export_dir: bool = False,
                 platforms: Sequence[str] | None = None,
                 int64_to_int32: bool = False,
                 preprocessing_step_signature: Any = None,
                 num_ipus: int | None = None) -> runtime.ServingRuntime:
    """Writes a serving export of `model`; returns its runtime (see `export_for_ipu_serving`).

    `int64_to_int32` exports int64 inputs as int32 (`keras-ipu convert
    --int64_to_int32_conversion`). `num_ipus` is the IPUs the export is for
    (`keras-ipu convert --num_ipus`; default: those its stages run on),
    which `keras-ipu run --num_ipus` checks. With a `preprocessing_step`, a
    `preprocessing_step_signature` (specs with `shape` and `dtype`) gives the
    export's inputs, which the step turns into the model's.

    Raises:
        ValueError: Model not created in an IPUStrategy, unknown batch size
            or one that is not a positive integer, non-empty directory
            without `purge_export_dir`, bad output names, a `device_mapping`
            that does not name one IPU per pipeline stage, `num_ipus` fewer
            than the IPUs the stages run on.
        TypeError: A signature entry without a shape and a dtype.
        RuntimeError: Model not built, or a pipeline stage assignment that
            `predict` refuses too.
    """
    if context.state_of(model).strategy is None:
        raise ValueError(
            f"Model {model.name!r} was not created inside an IPU strategy scope: create "
            f"it in `IPUStrategy().scope()` to export it for IPU serving."
        )
    structure, specs, names = _input_signature(model, _checked_batch_size(batch_size))
    keys = _dict_keys(structure, len(specs))
    batch = specs[0].shape[0]  # the model's: a step's first input may have no batch axis
    if preprocessing_step is not None and preprocessing_step_signature is not None:
        specs, names = _step_inputs(preprocessing_step_signature, batch)
        keys = [None] * len(specs)
    if int64_to_int32:  # the IPU has no 64-bit integers: the export takes int32
        specs = [jax.ShapeDtypeStruct(s.shape, np.int32) if s.dtype == np.int64 else s
                 for s in specs]
    iterations = data.positive_int("steps_per_execution",
                                   getattr(model, "steps_per_execution", 1))
    platforms = _checked_platforms(platforms)
    plan = _plan(model)
    returned = _ReturnedStructure()
    with context.model_scope(model):
        if plan is None:
            programs, weights, outputs, layout = _single_programs(
                model, structure, specs, iterations, preprocessing_step, postprocessing_step,
                platforms, returned.flatten)
        else:
            programs, weights, outputs, layout = _pipeline_programs(
                model, plan, specs, preprocessing_step, postprocessing_step, platforms,
                returned.flatten)
    metadata = {
        "format": runtime.FORMAT,
        "keras_ipu_version": _version(),
        "model_name": model.name,
        "batch_size": batch,
        "iterations": iterations,
        "inputs": [{**_signature_entry(n, s), **({"key": k} if k else {})}
                   for n, s, k in zip(names, specs, keys)],
        "outputs": [_signature_entry(n, s) for n, s in
                    zip(returned.names(output_names), outputs)],
        # The runtime returns several outputs by name only when they were named.
        "named_outputs": output_names is not None or returned.keyed,
        "platforms": list(platforms),
        "weight_dtypes": _archive_dtypes(weights),
        **layout,
        **_pipeline_metadata(model, plan, num_ipus),
    }
    # Everything that can fail but writing is done first: only then is the
    # directory emptied and written, the metadata last (without it, a
    # directory left half-written is no export, never a corrupt one).
    serialized = {name: exported.serialize() for name, exported in programs.items()}
    metadata_text = json.dumps(metadata, indent=2)

    def write() -> None:
        _prepare_directory(export_dir, purge_export_dir)
        for name, program in serialized.items():
            with open(os.path.join(export_dir, name), "wb") as f:
                f.write(program)
        np.savez(os.path.join(export_dir, runtime.WEIGHTS_FILE), **weights)
        with open(os.path.join(export_dir, runtime.METADATA_FILE), "w") as f:
            f.write(metadata_text)

    # In a job of several instances, instance 0 writes it and the others wait, as for
    # `save` (each writing it, one found the directory full, or both purged it).
    saving.on_first_instance(write, export_dir)
    return runtime.load(export_dir)


def _checked_batch_size(batch_size: Any) -> int | None:
    """`batch_size` as a Python int (NumPy integers included), or `None`.

    Raises:
        ValueError: When it is not a positive integer.
    """
    if batch_size is None:
        return None
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, numbers.Integral):
        raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
    if int(batch_size) < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got {int(batch_size)}.")
    return int(batch_size)


def _single_programs(model, structure, specs, iterations: int, preprocessing_step,
                     postprocessing_step, platforms, flatten_outputs):
    """The one-device programs (one batch; the loop of `iterations`), weights, outputs, layout."""
    from keras_ipu.keras import export_pipeline

    trainable = [np.asarray(v.numpy()) for v in model.trainable_variables]
    non_trainable = [np.asarray(v.numpy()) for v in model.non_trainable_variables]
    # Inference behaviour (Dropout off, BatchNormalization's moving statistics), for
    # models whose `call` takes `training`.
    flags = {"training": False} if _takes_training(model) else {}

    def step(trainable, non_trainable, *inputs):
        if preprocessing_step is not None:
            inputs = export_pipeline.preprocessed(preprocessing_step, inputs, structure)
        outputs, _ = model.stateless_call(trainable, non_trainable,
                                          tree.pack_sequence_as(structure, list(inputs)),
                                          **flags)
        if postprocessing_step is not None:
            outputs = export_pipeline.postprocessed(postprocessing_step, outputs)
        return flatten_outputs(outputs)

    def loop(trainable, non_trainable, *stacked):
        return jax.lax.map(lambda xs: step(trainable, non_trainable, *xs), stacked)

    weight_specs = (_specs(trainable), _specs(non_trainable))
    loop_specs = [jax.ShapeDtypeStruct((iterations, *s.shape), s.dtype) for s in specs]
    exported_step = export_pipeline.exported(step, platforms, *weight_specs, *specs)
    exported_loop = export_pipeline.exported(loop, platforms, *weight_specs, *loop_specs)
    weights = {**{f"t{i}": w for i, w in enumerate(trainable)},
               **{f"n{i}": w for i, w in enumerate(non_trainable)}}
    layout = {"num_weights": [len(trainable), len(non_trainable)]}
    programs = {runtime.STEP_FILE: exported_step, runtime.LOOP_FILE: exported_loop}
    return programs, weights, list(exported_step.out_avals), layout


def _pipeline_programs(model, plan, specs, preprocessing_step, postprocessing_step, platforms,
                       flatten_outputs):
    """One program per stage, run on its IPU by the runtime; weights, outputs, layout."""
    from keras_ipu.keras import export_pipeline

    mapping = _device_mapping(model, plan)
    built = export_pipeline.stage_programs(model, plan, specs, preprocessing_step,
                                           postprocessing_step, platforms, flatten_outputs)
    programs, weights, stages_meta = {}, {}, []
    for stage, (exported, stage_weights) in enumerate(built):
        name = runtime.STAGE_FILE.format(stage=stage)
        programs[name] = exported
        weights.update({f"s{stage}_{i}": w for i, w in enumerate(stage_weights)})
        stages_meta.append({"file": name, "ipu": mapping[stage],
                            "num_weights": len(stage_weights)})
    return programs, weights, list(built[-1][0].out_avals), {"stages": stages_meta}


def _input_signature(model: Any, batch_size: int | None):
    """`(input structure, flat input specs with the batch size, names)`.

    Inputs are named as the model names them; an input Keras named itself
    (`keras_tensor_<n>`, which changes with the tensors a process made
    before) is `input_<i>`, its position; names are made distinct
    (`_unique_names`).
    """
    structure = _model_inputs(model)
    if structure is None:
        structure = _built_inputs(model)
        flat = tree.flatten(structure)
        names = [f"input_{i}" for i in range(len(flat))]
    else:
        flat = tree.flatten(structure)
        names = _unique_names([_given_name(t) for t in flat])
    specs = []
    for name, tensor in zip(names, flat):
        shape = tuple(tensor.shape)
        if batch_size is not None:
            shape = (batch_size, *shape[1:])
        if any(d is None for d in shape):
            raise ValueError(f"{_BATCH_ERROR} (input {name!r} has shape {shape}"
                             f"{_open_axes_hint(shape)})")
        specs.append(jax.ShapeDtypeStruct(shape, np.dtype(str(tensor.dtype))))
    return structure, specs, names


def _built_inputs(model: Any) -> Any:
    """The inputs of a subclassed model built from shapes, in the structure it was built with.

    `build(input_shape)` (or a first call) records one shape, or a list,
    tuple or dict of them (`build([(None, 4), (None, 2)])`, as the
    reference's example builds): one input per shape, of the dtype the
    model was first called with (as Keras casts it: float inputs become
    the model's input dtype), float32 when it was never called.

    Raises:
        RuntimeError: When the model was neither built nor called.
    """
    shapes = getattr(model, "_build_shapes_dict", None) or {}
    # `build(input_shape)` records "input_shape"; a `build` of another argument name, its own.
    shape = shapes.get("input_shape", next(iter(shapes.values())) if len(shapes) == 1 else None)
    if shape is None:
        raise RuntimeError(_SIGNATURE_ERROR)
    # KerasTensors, not jax.ShapeDtypeStructs: the batch dimension may be None,
    # which ShapeDtypeStruct refuses from jax 0.11 on.
    structure = tree.map_shape_structure(lambda s: KerasTensor(tuple(s), dtype="float32"), shape)
    flat = tree.flatten(structure)
    called = context.state_of(model).called_dtypes
    if called is None or len(called) != len(flat):
        return structure
    return tree.pack_sequence_as(structure, [
        KerasTensor(t.shape, dtype=_received_dtype(d)) for t, d in zip(flat, called)])


def _received_dtype(dtype: str) -> str:
    """The dtype `predict` gives a model's `call` for data of `dtype`.

    Float data arrives in Keras' floatx, and `call` gets it uncast (Keras'
    `predict` runs `stateless_call`: a mixed-precision model's float32 layers
    see the data unrounded, its other layers cast it themselves); integer
    data as the infeed keeps it.
    """
    dtype = keras.backend.standardize_dtype(dtype)
    if keras.backend.is_float_dtype(dtype):
        return keras.backend.floatx()
    return dtype


def _step_inputs(signature: Any, batch: int) -> tuple[list, list[str]]:
    """`(specs, names)` of a preprocessing step's signature: its inputs become the export's.

    Each entry has a `shape` (a leading `None` is the export's batch size)
    and a `dtype`: a `jax.ShapeDtypeStruct`, a `keras.Input`, a `tf.TensorSpec`.
    """
    entries = list(signature) if isinstance(signature, (list, tuple)) else [signature]
    specs = []
    names = _unique_names([_given_name(entry) for entry in entries])
    for position, (entry, name) in enumerate(zip(entries, names)):
        shape, dtype = getattr(entry, "shape", None), getattr(entry, "dtype", None)
        if shape is None or dtype is None:
            raise TypeError(
                f"preprocessing_step_signature[{position}] must have a shape and a dtype (a "
                f"jax.ShapeDtypeStruct, keras.Input or tf.TensorSpec), got {entry!r}.")
        dims = tuple(shape)
        if dims and dims[0] is None:
            dims = (batch, *dims[1:])
        if any(d is None for d in dims):
            raise ValueError(f"{_BATCH_ERROR} (input {name!r} has shape {dims}"
                             f"{_open_axes_hint(dims)})")
        specs.append(jax.ShapeDtypeStruct(dims, np.dtype(getattr(dtype, "as_numpy_dtype",
                                                                 dtype))))
    return specs, names


def _model_inputs(model: Any) -> Any:
    """The model's input tensors, or `None` for a model built from a shape alone.

    A Sequential model never called has no `input`, but the tensors of its
    `InputLayer` (named, with their dtypes) are its `inputs`.
    """
    try:
        return model.input
    except (AttributeError, ValueError):
        pass
    try:
        inputs = list(model.inputs or ())
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    return inputs[0] if len(inputs) == 1 else inputs


def _given_name(tensor: Any) -> str | None:
    """The name someone gave an input, or `None` (Keras' own `keras_tensor_<n>` included)."""
    name = getattr(tensor, "name", None)
    if not name or name.startswith(_KERAS_TENSOR_NAME):
        return None
    return name


def _unique_names(given: Sequence[str | None]) -> list[str]:
    """One distinct name per input: its given name, else `input_<position>`.

    The runtime binds inputs by name, so two inputs of one name would take
    the same value. A name already taken (an unnamed second input beside one
    named `input_1`, or two inputs named alike) gets the first free suffix
    `_1`, `_2`, ...; a name someone gave is never taken by a generated one.

    Args:
        given: Per input, the name it was given, or `None`.

    Returns:
        The export's input names, in order.

    Example:

    >>> _unique_names(["input_1", None, "a", "a"])
    ['input_1', 'input_1_1', 'a', 'a_1']
    """
    names: list[str] = []
    for position, name in enumerate(given):
        base = name or f"input_{position}"
        # Given names are reserved for their inputs; the first of each keeps its own.
        taken = set(names) | {n for n in given if n and n != name}
        candidate, suffix = base, 0
        while candidate in taken:
            suffix += 1
            candidate = f"{base}_{suffix}"
        names.append(candidate)
    return names


def _prepare_directory(export_dir: str, purge: bool) -> None:
    if os.path.isdir(export_dir) and os.listdir(export_dir):
        if not purge:
            raise ValueError(
                f"Directory {export_dir!r} is not empty. Please specify an empty directory "
                f"or set `purge_export_dir` to True."
            )
        shutil.rmtree(export_dir)
    os.makedirs(export_dir, exist_ok=True)


def _positions_in(flat: Sequence[Any], values: Sequence[Any]) -> list[int]:
    """For each entry of `flat`, the index of the value it is in `values` (by identity).

    The flat order is the tree's (a dict's sorted keys, an `OrderedDict`'s own
    order); a value given twice takes two entries.
    """
    order: list[int | None] = [None] * len(flat)
    for index, value in enumerate(values):
        at = next(i for i, entry in enumerate(flat) if entry is value and order[i] is None)
        order[at] = index
    return order


class _ReturnedStructure:
    """What the exported program returns, seen as it is traced: its outputs' names.

    A dict of tensors (a functional model with dict outputs, or a
    `postprocessing_step` returning one) is served under its keys, and
    `output_names` rename its entries in the dict's own order, as Keras
    returns it. Anything else is flattened as Keras flattens it and named
    `output_0`, ... unless `output_names` names each flat output.
    """

    def __init__(self):
        self._keys: list[str] | None = None  # the dict's keys, in its own order
        self._flat_order: list[int] = []  # of those keys, in the flat outputs' order
        self._count = 0

    def flatten(self, outputs: Any) -> tuple:
        """The flat outputs, in `keras.tree.flatten`'s order (a dict's sorted keys).

        Raises:
            ValueError: When an output is `None`.
        """
        flat = tuple(tree.flatten(outputs))
        if any(value is None for value in flat):
            raise ValueError(
                f"The exported outputs hold None (at flat position "
                f"{[i for i, v in enumerate(flat) if v is None]}): a served output is a "
                f"tensor; return only tensors from the model or `postprocessing_step`.")
        self._count = len(flat)
        self._keys = None
        if isinstance(outputs, Mapping) and len(outputs) == len(flat) and not any(
                value is None or isinstance(value, (Mapping, list, tuple))
                for value in outputs.values()):
            self._keys = [str(key) for key in outputs]
            self._flat_order = _positions_in(flat, list(outputs.values()))
        return flat

    def names(self, given: str | Sequence[str] | None) -> list[str]:
        """One name per flat output.

        Raises:
            ValueError: `given` does not name each output once with a string,
                or dict keys that are the same text (`1` and `"1"`) without `given`.
        """
        count = self._count
        if given is not None:
            given = [given] if isinstance(given, str) else list(given)
            if len(given) != count or len(set(given)) != count or not all(
                    isinstance(name, str) for name in given):
                raise ValueError(
                    f"`output_names` must name each of the model's {count} outputs once, "
                    f"with a string{self._keys_hint()}, got {given}.")
        if self._keys is None:
            return given if given is not None else [f"output_{i}" for i in range(count)]
        if given is None and len(set(self._keys)) != count:
            raise ValueError(
                f"The outputs' dict keys give the names {self._keys}, some twice (keys are "
                f"served as text): rename them with `output_names`.")
        names = given if given is not None else self._keys
        return [names[i] for i in self._flat_order]

    @property
    def keyed(self) -> bool:
        """Whether the outputs are a dict's, served under its keys."""
        return self._keys is not None

    def _keys_hint(self) -> str:
        return f" (its dict's keys {self._keys}, in that order)" if self._keys else ""


def _plan(model: Any):
    """The model's pipeline plan, or `None` when it is not pipelined.

    Raises:
        RuntimeError, ValueError: For a stage assignment `predict` refuses
            too (a stage without layers, an assignment no longer valid):
            exporting the model unpipelined instead would silently serve
            another program than the one the model runs; or, as `predict`,
            `forward_propagation_stages_poplar_options` without one entry per stage.
    """
    from keras_ipu.keras import pipelined

    plan = pipelined.plan_of(model)
    if plan is not None:
        options.check_stage_poplar_options(options.options_of(model), plan.num_stages,
                                           training=False)
    return plan


def _device_mapping(model: Any, plan: Any) -> tuple[int, ...]:
    """Stage -> IPU, checked as `predict` checks it (one IPU per stage).

    Raises:
        ValueError: When `device_mapping` does not name one IPU per stage, or
            names an IPU the model's device does not have.
    """
    from keras_ipu.keras import pipelined, replication

    mapping = pipelined.device_mapping(plan, options.options_of(model),
                                       len(context.device_ipus(model)))
    # As predict: the model's device holds whole pipelines (the default mapping too).
    replication.replicas_for(model, ipus_per_replica=max(mapping) + 1)
    return mapping


def _pipeline_metadata(model: Any, plan: Any, num_ipus: int | None) -> dict:
    """The IPUs and stage mapping (IPUs: `num_ipus`, else those the stages run on).

    Raises:
        ValueError: When `num_ipus` is fewer than the IPUs the stages run on.
    """
    mapping = (0,) if plan is None else _device_mapping(model, plan)
    used = max(mapping) + 1
    if num_ipus is not None and not (isinstance(num_ipus, int) and num_ipus >= used):
        raise ValueError(f"`num_ipus` must be an integer of at least {used}, the IPUs the "
                         f"stages run on (device_mapping {list(mapping)}); got {num_ipus!r}.")
    return {"num_ipus": used if num_ipus is None else num_ipus,
            "pipeline_stages": 1 if plan is None else plan.num_stages,
            "device_mapping": list(mapping)}


def _archive_dtypes(weights: dict[str, np.ndarray]) -> dict[str, str]:
    """The dtypes a NumPy archive cannot name, by weight: it stores bfloat16 or float8 as bytes.

    (ml_dtypes' types are NumPy "void" dtypes; `np.savez` keeps their bytes,
    `np.load` gives them back as `V2`, which the runtime views as the dtype
    recorded here.)
    """
    return {key: str(w.dtype) for key, w in weights.items() if w.dtype.kind == "V"}


def _dict_keys(structure: Any, count: int) -> list[str | None]:
    """Per input, the key a model taking a dict of inputs knows it by (`None` for others).

    The runtime takes a dict by these keys too: they are what the model's
    callers use, where the inputs' names may differ.
    """
    if not isinstance(structure, Mapping) or count != len(structure):
        return [None] * count
    return [str(path[0]) for path, _ in tree.flatten_with_path(structure)]


def _signature_entry(name: str, spec: Any) -> dict:
    return {"name": name, "shape": list(spec.shape), "dtype": str(np.dtype(spec.dtype))}


def _specs(arrays: list[np.ndarray]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def _takes_training(model: Any) -> bool:
    # As Keras passes it: to a `call` that names it (not to `**kwargs`).
    return "training" in inspect.signature(model.call).parameters


# The platforms jax.export lowers for.
_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def _checked_platforms(platforms: Any) -> tuple[str, ...]:
    """The platforms to export for (default: this process's), names checked.

    Raises:
        ValueError: For a name jax.export does not lower for.
    """
    if not platforms:
        return (jax.default_backend(),)
    names = (platforms,) if isinstance(platforms, str) else tuple(platforms)
    unknown = [name for name in names if name not in _PLATFORMS]
    if unknown:
        raise ValueError(f"Cannot export for the platforms {unknown}: each must be one of "
                         f"{list(_PLATFORMS)} (IPUs are JAX devices of those).")
    return names


def _version() -> str:
    import keras_ipu

    return keras_ipu.__version__


__all__ = ["export_model"]
