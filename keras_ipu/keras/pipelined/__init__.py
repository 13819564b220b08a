"""How a `PipelinePlan` runs on IPUs: program building, the state layout, training, gradients.

The face of the package, for the trainer: `plan_of(model, x)` (the stage
plan, or `None` when the model is not pipelined), `device_mapping`,
`accumulation_steps` and `program_for` (the cache key and builder of a run's
pipelined program).

Modules: `program` (the trainer's side: checks, schedule, cost model, the
`Run`), `model` (the model split over IPUs: packed state, the stage runner,
the inference program), `codec` (the mesh, moving state and batches, the
data and outfeed layout), `instances` (placing them across the instances of
a multi-host job), `training` (the pipelined fit program), `dispatched` (the
host-dispatched fit), `gradients` (how gradients accumulate per IPU).

Example:

>>> from keras_ipu.keras import pipelined
>>> plan = pipelined.plan_of(model, x)
>>> pipelined.device_mapping(plan, options)
(0, 1)
"""

from keras_ipu.keras.pipelined.program import (
    accumulation_steps,
    device_mapping,
    plan_of,
    program_for,
)

__all__ = ["accumulation_steps", "device_mapping", "plan_of", "program_for"]
