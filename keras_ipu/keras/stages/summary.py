"""The text of `print_pipeline_stage_assignment_summary`: one row per layer (call)."""

from __future__ import annotations

from typing import Any

from keras_ipu.keras.stages.assignments import name_of
from keras_ipu.keras.stages.graph import FUNCTIONAL, MODEL, SEQUENTIAL, model_kind
from keras_ipu.keras.stages.model_assignment import get_assignment

DEFAULT_LINE_LENGTH = {SEQUENTIAL: 60, FUNCTIONAL: 89, MODEL: 89}
_COLUMNS = {
    SEQUENTIAL: (("Layer (type)", "Pipeline Stage"), (0.5, 1.0)),
    FUNCTIONAL: (("Layer (type) (node index)", "Input Layers", "Pipeline Stage"), (0.4, 0.8, 1.0)),
}


def _summary_row(fields: list, positions: list[int]) -> str:
    line = ""
    for i, field in enumerate(fields):
        if i > 0:
            line = line[:-1] + " "
        line += str(field)
        line = line[: positions[i]]
        line += " " * (positions[i] - len(line))
    return line


def _summary_rows(assignment: Any, columns: int) -> list[list]:
    layer = assignment.layer
    label = f"{name_of(layer)} ({layer.__class__.__name__})"
    node_index = getattr(assignment, "node_index", None)
    if node_index is not None:
        label += f" ({node_index})"
    stage = str(assignment.pipeline_stage)
    if columns == 2:
        return [[label, stage]]
    inbound = [name_of(op) for op in getattr(assignment, "inbound_layers", [])]
    rows = [[label, inbound[0] if inbound else "", stage]]
    rows.extend(["", name, ""] for name in inbound[1:])
    return rows


def assignment_summary(model: Any, line_length: int | None = None) -> list[str]:
    """The lines of `print_pipeline_stage_assignment_summary`.

    Columns: `Layer (type)` and `Pipeline Stage` (Sequential, default width
    60), or `Layer (type) (node index)`, `Input Layers` and `Pipeline Stage`
    (Functional and subclassed, default 89); extra input layers go on
    continuation rows. A nested model prints `Nested Model: "<name>"`, a `-`
    rule and its own rows.

    Args:
        model: A Keras model.
        line_length: Total width; the default depends on the model kind.

    Returns:
        The lines, without line breaks.

    Raises:
        RuntimeError, ValueError: As `get_assignment`.

    Example:

    >>> assignment_summary(model, 65)[0]
    'Model: "sequential"'
    """
    kind = model_kind(model)
    length = line_length or DEFAULT_LINE_LENGTH[kind]
    headers, widths = _COLUMNS[SEQUENTIAL if kind == SEQUENTIAL else FUNCTIONAL]
    positions = [int(length * width) for width in widths]
    lines = [f'Model: "{name_of(model)}"', "_" * length, _summary_row(headers, positions)]
    lines.append("=" * length)

    def emit(assignments: list) -> None:
        for i, assignment in enumerate(assignments):
            if assignment.is_nested_model:
                lines.append(f'Nested Model: "{name_of(assignment.nested_model)}"')
                lines.append("-" * length)
                emit(assignment.pipeline_stage_assignments)
                continue
            for fields in _summary_rows(assignment, len(headers)):
                lines.append(_summary_row(fields, positions))
            last = i + 1 == len(assignments) or assignments[i + 1].is_nested_model
            lines.append(("=" if last else "_") * length)

    emit(get_assignment(model))
    return lines


__all__ = ["DEFAULT_LINE_LENGTH", "assignment_summary"]
