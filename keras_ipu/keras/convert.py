"""`keras-ipu convert`: a saved Keras model to an IPU serving export, with its pipeline configured.

Modelled on the SavedModel tool's `convert ipu` subcommand. The model is
loaded inside an `IPUStrategy`; `precision_mode="FP16"` recasts its layers to
float16 (but those named by `precision_conversion_excluded_nodes`);
`manual_sharding` (one regex list per IPU) or `pipeline_cfg` (`manual`,
`load` or `auto`) assigns each layer to a pipeline stage; the export is
written by `export.export_model` with `batch_size` and `batch_per_step`
iterations. `auto` estimates each layer's cycles and memory with the device
model and splits the chain of layers into the fewest stages, from
`min_ipu_quantity` to `max_ipu_quantity`, whose stages fit an IPU, balancing
cycles (`priority: "cycle"`) or memory (`"memory"`); the solution is written
in the seed's solution-file format. Options that mean nothing on the device
model are accepted and reported.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from keras_ipu.keras import fp16_conversion

# Options of the SavedModel tool that keras_ipu accepts without effect.
NO_EFFECT = ("excluded_nodes", "remove_excluded_nodes", "matmul_amp", "conv_amp",
             "matmul_partial_type", "conv_partial_type", "gelu_replacement",
             "no_ipu_placement", "merge_subgraphs", "embedded_runtime_save_config")
_PIPELINE_NO_EFFECT = ("fine_tune_iter", "ipu_model", "profiling_root_dir", "profiling_enable")
SOLUTION_FILE = "greedy_search.pipeconfig"


@dataclasses.dataclass
class ConvertOptions:
    """The options of `keras-ipu convert` (the SavedModel tool's names).

    Example:

    >>> ConvertOptions(batch_size=4, pipeline_cfg={"converter": "auto"})
    """

    batch_size: int = 1
    batch_per_step: int = 0
    num_ipus: int = 1
    precision_mode: str = "FP32"
    precision_conversion_excluded_nodes: Sequence[str] = ()
    int64_to_int32_conversion: bool = False
    manual_sharding: Sequence[Sequence[str]] | None = None
    pipeline_cfg: Mapping[str, Any] | None = None
    ignored: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ConvertOptions:
        """Options from a configuration (file or command line); unknown keys raise.

        Raises:
            ValueError: For unknown keys and bad values.
        """
        known = {f.name for f in dataclasses.fields(cls)} - {"ignored"}
        unknown = sorted(set(values) - known - set(NO_EFFECT))
        if unknown:
            raise ValueError(f"Unknown convert options {unknown}; valid: {sorted(known)}.")
        options = cls(**{k: v for k, v in values.items() if k in known},
                      ignored={k: v for k, v in values.items() if k in NO_EFFECT})
        options.check()
        return options

    def check(self) -> None:
        """Raises `ValueError` naming an option whose value is not valid, and what would be.

        A configuration file's values are any JSON (`"precision_mode": 16`),
        so each option's type is checked here, before a method of the wrong
        type fails deep in the conversion.
        """
        _check_values(vars(self), _OPTION_VALUES, "`{}`")
        if self.manual_sharding is not None and self.pipeline_cfg is not None:
            raise ValueError("Give manual_sharding or pipeline_cfg, not both (on the command "
                             "line and in --config_file together).")
        if self.pipeline_cfg is not None:
            _check_values(self.pipeline_cfg, _PIPELINE_VALUES, "pipeline_cfg `{}`")


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_count(value: Any) -> bool:
    return _is_index(value) and value > 0


def _is_regexes(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(r, str) for r in value)


def _is_regexes_per_unit(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(p, str) or _is_regexes(p) for p in value)


# Each option's test, and what is valid, for the error (`manual_sharding` and
# `pipeline_cfg` are None when not given).
_REGEXES_PER = "a list with a regular expression (a string), or a list of them, per {}"
_OPTION_VALUES = {
    "batch_size": (_is_count, "a positive integer"),
    "batch_per_step": (_is_index, "an integer >= 0"),
    "num_ipus": (_is_count, "a positive integer"),
    "precision_mode": (lambda v: isinstance(v, str) and v.upper() in ("FP16", "FP32"),
                       "FP16 or FP32 (a string)"),
    "precision_conversion_excluded_nodes": (_is_regexes, "a list of regular expressions "
                                                         "(strings)"),
    "int64_to_int32_conversion": (lambda v: isinstance(v, bool), "true or false"),
    "manual_sharding": (lambda v: v is None or _is_regexes_per_unit(v), _REGEXES_PER.format("IPU")),
    "pipeline_cfg": (lambda v: v is None or isinstance(v, Mapping),
                     'a JSON object, such as {"converter": "auto"}'),
}
# The values of `pipeline_cfg`'s keys, where given (the converters check the rest).
_PIPELINE_VALUES = {
    "converter": (lambda v: v in ("auto", "manual", "load"), "auto, manual or load"),
    "manual_pipeline_config": (_is_regexes_per_unit, _REGEXES_PER.format("stage")),
    "device_info": (lambda v: isinstance(v, list) and all(_is_index(i) for i in v),
                    "a list of IPU indices (integers >= 0), one per stage"),
    "priority": (lambda v: v in ("cycle", "memory"), "cycle or memory"),
    "min_ipu_quantity": (_is_count, "a positive integer"),
    "max_ipu_quantity": (_is_count, "a positive integer"),
    "solution_path": (lambda v: isinstance(v, str), "a file path (a string)"),
    "solution_dir": (lambda v: isinstance(v, str), "a folder path (a string)"),
}


def _check_values(values: Mapping[str, Any], valid: Mapping[str, tuple], label: str) -> None:
    """Raises `ValueError` for the first of `values` that its test in `valid` refuses."""
    for name, (test, expected) in valid.items():
        if name in values and not test(values[name]):
            value = values[name]
            raise ValueError(f"{label.format(name)} must be {expected}, got {value!r} "
                             f"({type(value).__name__}).")


def convert(model_path: str, export_dir: str, options: ConvertOptions) -> dict:
    """Converts a saved Keras model into an export; returns what was done.

    Returns:
        A summary: the stage of each layer, the device mapping, the
        per-stage cost estimates (`auto`), the solution file and the
        ignored options.

    Raises:
        ValueError: Bad options, or a split that does not fit.
        RuntimeError: A stage assignment the model's graph does not allow.
    """
    import keras

    import keras_ipu as ipu

    options.check()  # options made directly, not by `from_mapping`, are checked too
    _check_export_dir(export_dir, options)
    _configure(options.num_ipus)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.models.load_model(model_path, compile=False)
        if options.precision_mode.upper() == "FP16":
            model = fp16_conversion.to_float16(
                model, _patterns(list(options.precision_conversion_excluded_nodes)))
    summary = {"ignored": dict(options.ignored)}
    plan = _stage_plan(model, options, summary)
    num_ipus = options.num_ipus
    if plan is not None:
        stage_of, mapping = plan
        num_ipus = max(num_ipus, max(mapping) + 1)
        _configure(num_ipus)
        _assign(model, stage_of)
        model.set_pipelining_options(device_mapping=list(mapping))
        summary.update(stage_of_layer=stage_of, device_mapping=list(mapping))
    model.compile(steps_per_execution=max(options.batch_per_step, 1))
    from keras_ipu.keras import export

    # The export is for the IPUs asked for (the reference's "IPUs that the SavedModel will
    # use"), so that `keras-ipu run --num_ipus` with the same count runs it.
    export.export_model(model, export_dir, batch_size=options.batch_size, purge_export_dir=False,
                        int64_to_int32=options.int64_to_int32_conversion, num_ipus=num_ipus)
    return summary


def _check_export_dir(export_dir: str, options: ConvertOptions) -> None:
    """Refuses, before any work, an export directory the export could not write."""
    if os.path.exists(export_dir) and not (os.path.isdir(export_dir)
                                           and not os.listdir(export_dir)):
        raise ValueError(f"--dir {export_dir}: the export directory must be new or empty.")
    solution_dir = (options.pipeline_cfg or {}).get("solution_dir")
    if solution_dir and os.path.abspath(solution_dir) == os.path.abspath(export_dir):
        raise ValueError(f"solution_dir {solution_dir}: write the solution file beside the "
                         f"export (--dir), not into it.")


def _configure(num_ipus: int) -> None:
    import keras_ipu as ipu
    from keras_ipu.keras.replication import next_power_of_two

    config = ipu.config.IPUConfig()
    # A model on 3 IPUs is given a device of 4, as IPUs are acquired in powers of two.
    config.auto_select_ipus = next_power_of_two(num_ipus)
    config.configure_ipu_system()


def _stage_plan(model, options: ConvertOptions, summary: dict):
    """`(stage of each layer name, device mapping)`, or `None` for one IPU."""
    if options.manual_sharding is not None:
        patterns = [_patterns(p) for p in options.manual_sharding]
        if len(patterns) != options.num_ipus:
            raise ValueError(
                f"--manual_sharding gives {len(patterns)} regex lists for --num_ipus "
                f"{options.num_ipus}: give one per IPU.")
        stage_of = _sharded(model, patterns)
        _check_every_stage_used(stage_of, options.manual_sharding, "--manual_sharding", "IPU")
        return stage_of, tuple(range(len(patterns)))
    config = options.pipeline_cfg
    if config is None:
        return None
    converter = config.get("converter")
    summary["ignored"].update({k: config[k] for k in _PIPELINE_NO_EFFECT if k in config})
    if converter == "manual":
        patterns = [_patterns(p) for p in config.get("manual_pipeline_config") or []]
        mapping = config.get("device_info")
        if (not patterns or not isinstance(mapping, list) or len(mapping) != len(patterns)
                or not all(_is_index(i) for i in mapping)):
            raise ValueError("The manual converter needs `manual_pipeline_config` (one regex list "
                             "per stage) and `device_info` (one IPU per stage).")
        stage_of = _by_patterns(model, patterns)
        _check_every_stage_used(stage_of, config.get("manual_pipeline_config"),
                                "manual_pipeline_config", "stage")
        _write_solution(config.get("solution_dir"), stage_of, mapping, summary)
        return stage_of, tuple(mapping)
    if converter == "load":
        return _load_solution(config.get("solution_path"), [layer.name for layer in _chain(model)])
    if converter == "auto":
        return _auto(model, options, config, summary)
    raise ValueError(f"pipeline_cfg `converter` must be auto, manual or load, got {converter!r}.")


def _chain(model) -> list:
    """The model's layers in execution order, without its inputs."""
    return [layer for layer in model.layers if type(layer).__name__ != "InputLayer"]


def _by_patterns(model, patterns: list[list[re.Pattern]], unmatched: int | None = 0
                 ) -> dict[str, int | None]:
    """Stage of each layer: the first regex list that matches its name, else `unmatched`."""
    stage_of = {}
    for layer in _chain(model):
        stage_of[layer.name] = next(
            (s for s, regexes in enumerate(patterns) if any(r.search(layer.name)
                                                           for r in regexes)), unmatched)
    return stage_of


def _sharded(model, patterns: list[list[re.Pattern]]) -> dict[str, int]:
    """`--manual_sharding`'s stage of each layer: the IPU whose regexes match its name.

    An unmatched layer is IPU 0's, as the reference places it, unless it
    takes a later IPU's output: sharded IPUs pass tensors either way, but a
    stage takes only from the stages before it, so the layer joins the
    latest IPU it takes from.
    """
    inbound = _inbound_names(model)
    stage_of: dict[str, int] = {}
    for name, stage in _by_patterns(model, patterns, unmatched=None).items():
        stage_of[name] = stage if stage is not None else max(
            (stage_of.get(source, 0) for source in inbound.get(name, ())), default=0)
    return stage_of


def _inbound_names(model) -> dict[str, list[str]]:
    """The layers of the chain each layer or operation takes its inputs from, over all its
    calls (a tied layer's too), seen through the operations between them (`h + 3.0`)."""
    assignments = model.get_pipeline_stage_assignment()
    if not all(hasattr(a, "inbound_layers") for a in assignments):  # a Sequential's chain
        names = [layer.name for layer in _chain(model)]
        return {name: [before] for before, name in zip(names, names[1:])}
    direct: dict[str, set[str]] = collections.defaultdict(set)
    for a in assignments:
        direct[_called(a).name].update(layer.name for layer in a.inbound_layers)
    chain = {layer.name for layer in _chain(model)}

    def sources(name: str, seen: set[str]) -> set[str]:
        found = set()
        for source in direct.get(name, ()):
            if source in chain:
                found.add(source)
            elif source not in seen:  # an operation (or an input): what it takes
                seen.add(source)
                found |= sources(source, seen)
        return found

    return {name: sorted(sources(name, set())) for name in direct}


def _check_every_stage_used(stage_of: dict[str, int], given: Sequence[Any], option: str,
                            unit: str) -> None:
    """Raises `ValueError` when a regex list took no layer: its IPU would run no stage."""
    used = set(stage_of.values())
    empty = [f"{unit} {s} ({given[s]!r})" for s in range(len(given)) if s not in used]
    if empty:
        raise ValueError(
            f"{option}: no layer name matches the regexes of {', '.join(empty)}; each "
            f"{unit} needs at least one layer (layers: {', '.join(stage_of)}).")


def _patterns(value: Any) -> list[re.Pattern]:
    regexes = [value] if isinstance(value, str) else list(value)
    try:
        return [re.compile(r) for r in regexes]
    except re.error as error:
        raise ValueError(f"Bad regular expression in the configuration: {error}.") from None


def _auto(model, options: ConvertOptions, config: Mapping[str, Any], summary: dict):
    from keras_ipu.device import partition
    from keras_ipu.device import system as ipu_system

    priority = config.get("priority", "cycle")
    if priority not in ("cycle", "memory"):
        raise ValueError(f"pipeline_cfg `priority` must be cycle or memory, got {priority!r}.")
    hardware = ipu_system.require().hardware
    layers = _chain(model)
    calls = _calls_in_graph(model)
    cycles, memory = zip(*(_layer_cost(layer, calls.get(layer.name, [0]), options.batch_size,
                                       hardware) for layer in layers))
    # Stages are cut only where no layer before the cut takes from one after it (a tied
    # layer called again at the end): the layers between such calls are one block.
    blocks = _uncut_blocks(model, layers)
    minimum = int(config.get("min_ipu_quantity", 2))
    if len(blocks) < min(minimum, len(layers)):
        raise ValueError(
            f"The model can be cut into at most {len(blocks)} pipeline stage(s): layers "
            f"called again later (tied weights, a shared model) keep what lies between their "
            f"calls in one stage. Ask for at most {len(blocks)} IPU(s).")
    split = partition.fewest_stages(
        [sum((cycles if priority == "cycle" else memory)[i] for i in block) for block in blocks],
        [sum(memory[i] for i in block) for block in blocks], hardware.memory_capacity_bytes,
        minimum=minimum, maximum=int(config.get("max_ipu_quantity", 64)))
    stage_of = {layers[i].name: stage for block, stage in zip(blocks, split.stage_of_layer)
                for i in block}
    mapping = tuple(range(len(split.stage_costs)))
    summary.update(priority=priority, stage_costs=list(split.stage_costs),
                   stage_memory=list(split.stage_memory))
    _write_solution(config.get("solution_dir"), stage_of, mapping, summary)
    return stage_of, mapping


def _uncut_blocks(model, layers: list) -> list[list[int]]:
    """The chain's layers (indices) in blocks no stage boundary may cut."""
    position = {layer.name: i for i, layer in enumerate(layers)}
    inbound = _inbound_names(model)
    blocks: list[list[int]] = []
    reach = -1  # the latest layer that a layer so far takes from
    for i, layer in enumerate(layers):
        if not blocks or reach < i:
            blocks.append([])
        blocks[-1].append(i)
        reach = max([reach, i, *(position[s] for s in inbound.get(layer.name, ()))])
    return blocks


def _called(assignment) -> Any:
    """The layer (or nested model) a stage assignment is of."""
    return assignment.nested_model if assignment.is_nested_model else assignment.layer


def _calls_in_graph(model) -> dict[str, list[int]]:
    """Each layer's calls in the model's graph (indices into its `_inbound_nodes`, which
    also hold calls of other graphs: a reloaded Sequential's earlier builds)."""
    calls: dict[str, list[int]] = collections.defaultdict(list)
    for a in model.get_pipeline_stage_assignment():
        # A Sequential's layers are called once (no node index: their first call).
        calls[_called(a).name].append(getattr(a, "node_index", 0))
    return calls


def _layer_cost(layer, node_indices: Sequence[int], batch: int, hardware) -> tuple[float, int]:
    """A layer's estimated cycles (the device model's cost count) and memory bytes, over
    its calls in the graph (a tied layer's too): its weights once, each call's outputs."""
    from keras_ipu.device import accounting

    weights = sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in layer.weights)
    cycles, activations = 0.0, 0
    for node in (layer._inbound_nodes[i] for i in node_indices):
        # Called as the model calls it: with its mask, its other tensor arguments (an
        # attention's value), its keyword arguments.
        arguments = node.arguments
        tensors = arguments.keras_tensors
        specs = [jax.ShapeDtypeStruct((batch, *t.shape[1:]), str(t.dtype)) for t in tensors]

        def call(*values, arguments=arguments, tensors=tensors):
            args, kwargs = arguments.fill_in({id(t): v for t, v in zip(tensors, values)})
            return layer(*args, **kwargs)

        lowered = jax.jit(call).lower(*specs)  # traced once: its cost and its outputs
        cycles += accounting.step_cost(lowered).work_cycles(hardware)
        activations += accounting.tree_bytes(lowered.out_info)
    return cycles, weights + activations


def _assign(model, stage_of: Mapping[str, int]) -> None:
    """Sets the model's pipeline stages: each of its layers' (`_chain`'s) calls to its stage.

    A nested model is one layer of the chain: all its calls run in its stage.
    """
    assignments = model.get_pipeline_stage_assignment()
    inbound = None
    for assignment in assignments:
        target = _called(assignment)
        stage = stage_of.get(target.name)
        if stage is None:  # an operation of the graph (`h + 3.0`): after what it takes
            inbound = _inbound_names(model) if inbound is None else inbound
            stage = max((stage_of.get(s, 0) for s in inbound.get(target.name, ())), default=0)
        _set_stage(assignment, stage)
    model.set_pipeline_stage_assignment(assignments)


def _set_stage(assignment, stage: int) -> None:
    # A nested model's assignment holds its own list (nested models in it too), as
    # `set_pipeline_stage_assignment` takes it; it has no stage of its own to set.
    if assignment.is_nested_model:
        for inner in assignment.pipeline_stage_assignments:
            _set_stage(inner, stage)
    else:
        assignment.pipeline_stage = stage


def _write_solution(directory, stage_of, mapping, summary: dict) -> None:
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SOLUTION_FILE)
    solution = {"device_mapping": list(mapping), "pipeline_mapping": dict(stage_of),
                **{k: summary[k] for k in ("priority", "stage_costs", "stage_memory")
                   if k in summary}}
    with open(path, "w") as f:
        json.dump(solution, f, indent=2)
    summary["solution_path"] = path


def _load_solution(path, layers: Sequence[str]) -> tuple[dict[str, int], tuple[int, ...]]:
    """`(stage of each layer name, device mapping)` of a solution file, checked against `layers`.

    Raises:
        ValueError: A missing or malformed file, a `pipeline_mapping` that
            names layers the model does not have or leaves some out, or a
            `device_mapping` that does not give one IPU per stage.
    """
    if not path or not os.path.isfile(path):
        raise ValueError(f"The load converter needs an existing `solution_path`, got {path!r}.")
    with open(path) as f:
        try:
            solution = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"Solution file {path} is not JSON: {error}.") from None
    # The seed's own example spells it "device_maping".
    mapping = solution.get("device_mapping", solution.get("device_maping"))
    stage_of = solution.get("pipeline_mapping")
    if mapping is None or not isinstance(stage_of, dict):
        raise ValueError(f"{path} is not a pipeline solution file: it needs `device_mapping` "
                         f"and `pipeline_mapping`.")
    if not isinstance(mapping, list) or not all(_is_index(i) for i in mapping):
        raise ValueError(f"`device_mapping` of {path} must be a list of IPU indices (integers "
                         f">= 0), one per pipeline stage; got {mapping!r}.")
    bad = {name: stage for name, stage in stage_of.items() if not _is_index(stage)}
    if bad:
        raise ValueError(f"`pipeline_mapping` of {path} must map each layer to a stage (an "
                         f"integer >= 0); got {bad}.")
    _check_solution(path, stage_of, mapping, layers)
    return dict(stage_of), tuple(mapping)


def _check_solution(path, stage_of: Mapping[str, int], mapping: Sequence[int],
                    layers: Sequence[str]) -> None:
    """Raises `ValueError` unless `stage_of` stages every layer, once, and `mapping` every stage.

    A layer left out would otherwise run on stage 0 and a name the model does
    not have would be dropped, both silently; the seed's solution files list
    every node (§19.2.5).
    """
    unknown = sorted(set(stage_of) - set(layers))
    if unknown:
        raise ValueError(f"`pipeline_mapping` of {path} names layers the model does not have: "
                         f"{unknown}; its layers: {list(layers)}.")
    missing = [name for name in layers if name not in stage_of]
    if missing:
        raise ValueError(f"`pipeline_mapping` of {path} gives no stage to the layers {missing}: "
                         f"give each of the model's layers {list(layers)} a stage.")
    stages = max(stage_of.values()) + 1 if stage_of else 0
    empty = [s for s in range(stages) if s not in set(stage_of.values())]
    if empty:
        raise ValueError(f"`pipeline_mapping` of {path} gives no layer to the stages {empty} "
                         f"(of stages 0 to {stages - 1}): number the stages from 0, each with "
                         f"a layer.")
    if len(mapping) != stages:
        raise ValueError(f"`device_mapping` {list(mapping)} of {path} has {len(mapping)} "
                         f"entries for {stages} pipeline stages: it needs one IPU per stage.")


def read_config_file(path: str) -> dict:
    """The JSON configuration file of the SavedModel tool (`//` comments allowed).

    Raises:
        ValueError: When it cannot be read or parsed.
    """
    try:
        with open(path) as f:
            text = f.read()
    except OSError as error:
        raise ValueError(f"Cannot read --config_file {path!r}: {error.strerror}.") from None
    try:
        values = json.loads(strip_comments(text))
    except json.JSONDecodeError as error:
        raise ValueError(f"--config_file {path!r} is not JSON: {error}.") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config_file {path!r} must hold a JSON object of options by name, "
                         f"not a {type(values).__name__}.")
    return values


def strip_comments(text: str) -> str:
    """JSON text without its `//` comments, those at the end of a line included.

    A `//` inside a string ("http://...") is the string's, not a comment.

    Example:

    >>> strip_comments('{"url": "http://x", // where\\n "n": 1}')
    '{"url": "http://x", \\n "n": 1}'
    """
    kept, in_string, index = [], False, 0
    while index < len(text):
        char = text[index]
        if in_string:
            if char == "\\":  # an escape: the next character is the string's too
                kept.append(text[index:index + 2])
                index += 2
                continue
            in_string = char != '"'
        elif char == '"':
            in_string = True
        elif text.startswith("//", index):
            end = text.find("\n", index)
            index = len(text) if end < 0 else end
            continue
        kept.append(char)
        index += 1
    return "".join(kept)


__all__ = ["ConvertOptions", "convert", "read_config_file", "strip_comments"]
