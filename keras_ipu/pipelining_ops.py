"""Pipelining operators: the public face of `tensorflow.python.ipu.pipelining_ops`.

`PipelineSchedule` and `RecomputationMode` choose how a pipelined model's stages
run (see `keras_ipu.device.schedules` for the schedule tables they select);
`PipelineStageOptions` holds per-stage Poplar options, accepted for porting.

Example:

```python
import keras_ipu as ipu

model.set_pipelining_options(
    pipeline_schedule=ipu.pipelining_ops.PipelineSchedule.Interleaved)
```
"""

from __future__ import annotations

from typing import Any

from keras_ipu.device.schedules import PipelineSchedule, RecomputationMode


class PipelineStageOptions:
    """Poplar compilation options for one forward, backward or weight-update stage.

    In IPU TensorFlow these override the global convolution and matmul Poplar
    options (such as `availableMemoryProportion`) inside one stage. The device
    model compiles with XLA, not Poplar: the options are kept and can be read
    back, and have no effect.

    Args:
        convolution_options: If provided, a dict of Poplar option flags for all
            the convolution operations in the stage.
        matmul_options: If provided, a dict of Poplar option flags for all the
            matmul operations in the stage.

    Raises:
        TypeError: If an option set is neither a dict nor `None`.

    Example:

    >>> options = PipelineStageOptions(matmul_options={"availableMemoryProportion": "0.2"})
    >>> options.matmul_options
    {'availableMemoryProportion': '0.2'}
    """

    def __init__(
        self,
        convolution_options: dict[str, Any] | None = None,
        matmul_options: dict[str, Any] | None = None,
    ) -> None:
        self.convolution_options = _check_options(convolution_options, "convolution_options")
        self.matmul_options = _check_options(matmul_options, "matmul_options")

    def get_proto(self) -> dict[str, dict[str, str]]:
        """The options as plain data: option name to string value, per kind."""
        return {
            "convolution_options": {k: str(v) for k, v in self.convolution_options.items()},
            "matmul_options": {k: str(v) for k, v in self.matmul_options.items()},
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PipelineStageOptions):
            return NotImplemented
        return self.get_proto() == other.get_proto()

    def __repr__(self) -> str:
        return (
            f"PipelineStageOptions(convolution_options={self.convolution_options!r}, "
            f"matmul_options={self.matmul_options!r})"
        )


def recomputation_checkpoint(tensors: Any, name: str | None = None) -> Any:
    """Marks values a recomputing pipeline stage keeps instead of recomputing.

    The function form of `keras_ipu.keras.layers.RecomputationCheckpoint`:
    under `RecomputationMode.RecomputeAndBackpropagateInterleaved` (the
    Sequential schedule's `Auto`) a stage's backward op recomputes only what
    follows the marked values; under `RecomputeThenBackpropagate` it has no
    effect. The values come back unchanged.

    Args:
        tensors: A tensor or a structure of tensors: symbolic Keras tensors
            (then a `RecomputationCheckpoint` layer is called on them), or
            JAX arrays inside a layer's `call`.
        name: The name of the layer, for Keras tensors.

    Returns:
        The tensors, of the same structure, shapes and types.

    Example:

    >>> hidden = recomputation_checkpoint(keras.layers.Dense(8)(inputs))
    """
    import keras

    from keras_ipu.device import checkpoints

    if any(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten(tensors)):
        from keras_ipu.keras.layers import RecomputationCheckpoint

        return RecomputationCheckpoint(name=name)(tensors)
    return checkpoints.checkpoint(tensors)


def _check_options(options: Any, name: str) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(
            f"PipelineStageOptions {name} must be a dict of Poplar option flags or None, "
            f"got {type(options).__name__} {options!r}."
        )
    return dict(options)


__all__ = ["PipelineSchedule", "PipelineStageOptions", "RecomputationMode",
           "recomputation_checkpoint"]
