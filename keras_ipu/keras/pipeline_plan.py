"""The `PipelinePlan` of a checked assignment: its stages' calls and the tensors between them."""

from __future__ import annotations

from typing import Any

from keras_ipu.keras.pipeline_assignment_classes import _name
from keras_ipu.keras.pipeline_graph import _Graph
from keras_ipu.keras.pipeline_levels import _Keys, _Leaf
from keras_ipu.keras.pipeline_stage import PipelinePlan, StageCall


def _make_plan(
    model: Any,
    graph: _Graph,
    leaves: list[_Leaf],
    input_keys: list[int],
    output_keys: list[int],
    keys: _Keys,
) -> PipelinePlan:
    num_stages = max(leaf.entry.stage for leaf in leaves) + 1
    stages: list[list[StageCall]] = [[] for _ in range(num_stages)]
    produced_in: dict[int, int] = {}
    last_use: dict[int, int] = {key: num_stages for key in output_keys}
    for leaf in leaves:
        stage = leaf.entry.stage
        stages[stage].append(
            StageCall(leaf.entry.node, stage, leaf.input_keys, leaf.output_keys, leaf.path)
        )
        for key in leaf.input_keys:
            last_use[key] = max(last_use.get(key, -1), stage)
        produced_in.update({key: stage for key in leaf.output_keys})
    stage_inputs = [
        sorted({k for c in calls for k in c.input_keys if produced_in.get(k) != s})
        for s, calls in enumerate(stages)
    ]
    stage_outputs = [
        sorted(k for k, p in produced_in.items() if p == s and last_use.get(k, -1) > s)
        for s in range(num_stages)
    ]
    live_after = [
        sorted(k for k, p in produced_in.items() if p <= s < last_use.get(k, -1))
        for s in range(num_stages)
    ]
    return PipelinePlan(
        model_name=_name(model),
        num_stages=num_stages,
        stages=tuple(tuple(calls) for calls in stages),
        input_keys=tuple(input_keys),
        output_keys=tuple(output_keys),
        inputs=graph.inputs,
        outputs=graph.outputs,
        inputs_struct=graph.inputs_struct,
        outputs_struct=graph.outputs_struct,
        tensors=dict(keys.tensors),
        stage_inputs=tuple(map(tuple, stage_inputs)),
        stage_outputs=tuple(map(tuple, stage_outputs)),
        live_after=tuple(map(tuple, live_after)),
    )
