"""Which IPU holds each stage's layers, and the sharing a device mapping must respect.

An IPU holds the variables of the layers its stages call, and updates them
with its own optimizer copy: a layer, or a variable, that stages on two
IPUs use would be two copies, each updated on its own. Such stages must
share an IPU (`set_pipelining_options(device_mapping=...)`).

Example:

```python
layers_of = layers_per_ipu(plan, device_mapping)   # per IPU, its layers, each once
```
"""

from __future__ import annotations

from collections.abc import Sequence


def layers_per_ipu(plan, device_mapping: Sequence[int]) -> list[list]:
    """Per IPU, the layers its stages call (each once, in first-call order; a layer
    without variables is listed for every IPU that calls it).

    Args:
        plan: The model's `PipelinePlan`.
        device_mapping: Per stage, its IPU.

    Returns:
        For IPUs `0 .. max(device_mapping)`, their layers.

    Raises:
        ValueError: When stages on different IPUs call one layer that holds
            variables (weights, a seed generator's state), or use one
            trainable variable (a layer holding another's: a tied embedding),
            naming the layer or variable, its stages and their IPUs.
    """
    layers_of: list[list] = [[] for _ in range(max(device_mapping) + 1)]
    owner: dict[int, tuple[int, int]] = {}  # layer -> (its first stage, that stage's IPU)
    for s, ipu in enumerate(device_mapping):
        for layer in plan.stage_layers(s):
            first, first_ipu = owner.setdefault(id(layer), (s, ipu))
            if all(known is not layer for known in layers_of[ipu]):
                layers_of[ipu].append(layer)
            # A layer without state (`ReLU`) is the same function on every IPU.
            if first_ipu != ipu and getattr(layer, "variables", None):
                held = ", ".join(v.path for v in layer.variables)
                raise ValueError(
                    f"Layer {layer.name} is used by pipeline stages {first} and {s}, on IPUs "
                    f"{first_ipu} and {ipu}, and holds state ({held}): stages that share a "
                    f"layer with state must be mapped to the same IPU (set `device_mapping` "
                    f"accordingly), or each stage must call a layer of its own."
                )
    _check_variables_on_one_ipu(plan, device_mapping)
    return layers_of


def _check_variables_on_one_ipu(plan, device_mapping: Sequence[int]) -> None:
    """Raises unless the layers using each trainable variable run on one IPU."""
    users: dict[int, list] = {}
    for s in range(len(device_mapping)):
        for layer in plan.stage_layers(s):
            for variable in getattr(layer, "trainable_variables", []):
                users.setdefault(id(variable), [variable]).append((layer, s))
    for variable, *used in users.values():
        if len({device_mapping[s] for _, s in used}) > 1:
            raise ValueError(_shared_variable_message(variable, used, device_mapping))


def _shared_variable_message(variable, used: list, device_mapping: Sequence[int]) -> str:
    ipus = sorted({device_mapping[s] for _, s in used})
    stages = sorted({s for _, s in used})
    where = ", ".join(f"layer `{layer.name}` in stage {s} (IPU {device_mapping[s]})"
                      for layer, s in used)
    return (
        f"Variable {variable.path} (`{variable.name}` of layer "
        f"`{_owner_name(variable, [layer for layer, _ in used])}`) is used by pipeline stages "
        f"on IPUs {' and '.join(map(str, ipus))}: {where}. Stages that share a variable must "
        f"be mapped to the same IPU: set `device_mapping` so that stages "
        f"{' and '.join(map(str, stages))} share an IPU (the mapping is {list(device_mapping)})."
    )


def _owner_name(variable, layers) -> str:
    """The name of the layer (among `layers` and the layers they hold) that created `variable`:
    the innermost one holding it (a layer lists the weights of the layers it holds too)."""
    owner = None
    for layer in layers:
        for sublayer in layer._flatten_layers(include_self=True):  # outer layers first
            if any(v is variable for v in sublayer.trainable_weights):
                owner = sublayer
        if owner is not None:
            return owner.name
    return variable.path.rpartition("/")[0]


__all__ = ["layers_per_ipu"]
