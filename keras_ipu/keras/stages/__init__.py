"""Which pipeline stage runs each layer call of a model (Keras only; nothing of the device).

The face of the package: `PipelineStage` scopes, the six assignment classes of
`keras.ipu`, the functions behind the models' assignment methods, and
`pipeline_plan(model)`, the `PipelinePlan` a pipelined executor runs.

Modules: `scope` (PipelineStage scopes and their recording hooks),
`assignments` (the public assignment classes), `graph` (model kinds, graphs,
tracing subclassed models), `tree` (an assignment as a tree: structure,
validation, expansion), `plan` (`PipelinePlan` and how a layer call runs),
`model_assignment` (the assignment stored on a model, saving, the plan),
`summary` (the printed summary), `mixins` (the extensions' methods).

Example:

>>> from keras_ipu.keras import stages
>>> model.set_pipeline_stage_assignment([0, 0, 1, 1])
>>> stages.pipeline_plan(model).num_stages
2
"""

from keras_ipu.keras.stages.assignments import (
    FunctionalLayerPipelineStageAssignment,
    FunctionalNestedModelPipelineStageAssignment,
    ModelLayerPipelineStageAssignment,
    NestedModelPipelineStageAssignment,
    SequentialLayerPipelineStageAssignment,
    SequentialNestedModelPipelineStageAssignment,
)
from keras_ipu.keras.stages.graph import FUNCTIONAL, MODEL, SEQUENTIAL, model_kind
from keras_ipu.keras.stages.mixins import (
    FunctionalPipelineMixin,
    ModelPipelineMixin,
    SequentialPipelineMixin,
)
from keras_ipu.keras.stages.model_assignment import (
    assignment_from_config,
    assignment_to_config,
    check_scope_stages,
    get_assignment,
    invalidate_sequential_assignment,
    pipeline_plan,
    reset_assignment,
    set_assignment,
)
from keras_ipu.keras.stages.plan import PipelinePlan, StageCall, TensorKey, call_arguments
from keras_ipu.keras.stages.scope import (
    PipelineStage,
    current_pipeline_stage,
    install,
    recorded_stage,
    recording,
    uninstall,
)
from keras_ipu.keras.stages.summary import assignment_summary
from keras_ipu.keras.stages.tree import check_no_empty_stages

__all__ = [
    "FUNCTIONAL",
    "MODEL",
    "SEQUENTIAL",
    "FunctionalLayerPipelineStageAssignment",
    "FunctionalNestedModelPipelineStageAssignment",
    "FunctionalPipelineMixin",
    "ModelLayerPipelineStageAssignment",
    "ModelPipelineMixin",
    "NestedModelPipelineStageAssignment",
    "PipelinePlan",
    "PipelineStage",
    "SequentialLayerPipelineStageAssignment",
    "SequentialNestedModelPipelineStageAssignment",
    "SequentialPipelineMixin",
    "StageCall",
    "TensorKey",
    "assignment_from_config",
    "assignment_summary",
    "assignment_to_config",
    "call_arguments",
    "check_no_empty_stages",
    "check_scope_stages",
    "current_pipeline_stage",
    "get_assignment",
    "install",
    "invalidate_sequential_assignment",
    "model_kind",
    "pipeline_plan",
    "recorded_stage",
    "recording",
    "reset_assignment",
    "set_assignment",
    "uninstall",
]
