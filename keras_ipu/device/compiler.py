"""The XLA options keras_ipu's programs are compiled with, and the rule that picks them.

XLA:CPU emits its fusions through MLIR ("fusion emitters") by default, or
through its older LLVM IR emitters. A host-dispatched pipeline
(`keras_ipu.keras.pipelined.dispatched`) compiles each IPU's optimizer step
as its own program: elementwise updates of every variable the IPU holds, one
small fusion each, which the MLIR emitters compile slowly (measured,
BENCHMARKS.md "The zoo": a pipelined MobileNetV2's two optimizer steps 9.5 s
and 3.7 s of compile time under load, 3.5 s and 0.9 s with the LLVM IR
emitters; an optimizer step over 160 variables alone 3.7 s against 1.3 s,
and it runs faster too). The updates are the same elementwise arithmetic
either way (the same weights: tests/test_compiler_options.py). Programs
with convolutions, normalizations and reductions keep XLA's defaults:
there the two emitters round differently, and for models without
convolutions the LLVM IR emitters' code runs 8-9% slower. Only keras_ipu's
programs are compiled this way; other JAX work in the process keeps XLA's
defaults. `--xla_compiler_options=default` in `KERAS_IPU_FLAGS` turns the
rule off. The execution report says which options a program was compiled
with, and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from keras_ipu.device import system

TUNED = "tuned"
DEFAULT = "default"
CHOICES = (TUNED, DEFAULT)

STEP = "step"  # a training, evaluation or prediction step (or loop of steps)
OPTIMIZER = "optimizer"  # an optimizer step alone (elementwise updates)
KINDS = (STEP, OPTIMIZER)

# (platform, program kind) -> the XLA options keras_ipu compiles it with.
TUNED_OPTIONS: Mapping[tuple[str, str], Mapping[str, Any]] = {
    ("cpu", OPTIMIZER): {"xla_cpu_use_fusion_emitters": False},
}
_REASONS = {
    OPTIMIZER: "an optimizer step: XLA:CPU's LLVM IR emitters compile its many small "
               "updates about three times as fast",
}


@dataclasses.dataclass(frozen=True)
class CompilerOptions:
    """XLA options for `Lowered.compile`, and why they were chosen.

    Args:
        options: Option name -> value (empty: XLA's defaults).
        reason: Why, in words (shown in the execution report).

    Example:

    >>> choose_options("optimizer", "cpu").options
    {'xla_cpu_use_fusion_emitters': False}
    """

    options: Mapping[str, Any]
    reason: str

    def describe(self) -> str:
        """`name=value, ... (reason)`, or `XLA's defaults (reason)`."""
        named = ", ".join(f"{k}={v}" for k, v in self.options.items()) or "XLA's defaults"
        return f"{named} ({self.reason})"


def configured_choice() -> str:
    """`--xla_compiler_options` of the configured IPU system (`"tuned"` when none is)."""
    configured = system.current()
    return configured.option("xla_compiler_options", TUNED) if configured else TUNED


def choose_options(kind: str, platform: str, choice: str | None = None) -> CompilerOptions:
    """The XLA options for a program of `kind` on `platform`.

    Args:
        kind: `"step"` or `"optimizer"` (see `KINDS`).
        platform: The JAX platform of its devices.
        choice: `"tuned"` (the table above) or `"default"` (XLA's own); by
            default the configured system's `--xla_compiler_options`.

    Returns:
        The `CompilerOptions`.

    Raises:
        ValueError: For an unknown `kind` or `choice`.

    Example:

    >>> choose_options("optimizer", "cpu").options
    {'xla_cpu_use_fusion_emitters': False}
    """
    if kind not in KINDS:
        raise ValueError(f"Unknown program kind {kind!r}; expected one of {KINDS}.")
    choice = choice or configured_choice()
    if choice not in CHOICES:
        raise ValueError(f"Unknown compiler options {choice!r}; expected one of {CHOICES}.")
    if choice == DEFAULT:
        return CompilerOptions({}, "forced (--xla_compiler_options=default)")
    options = TUNED_OPTIONS.get((platform, kind))
    if options:
        return CompilerOptions(dict(options), _REASONS[kind])
    return CompilerOptions({}, f"XLA's defaults for {platform}")


def compile_lowered(lowered: Any, options: CompilerOptions) -> Any:
    """`lowered.compile(...)` with `options`.

    Args:
        lowered: A `jax.stages.Lowered` program.
        options: From `choose_options`.

    Returns:
        The `jax.stages.Compiled` program.

    Example:

    >>> compile_lowered(jax.jit(step).lower(state, batch), choose_options("step", "cpu"))
    """
    return lowered.compile(compiler_options=dict(options.options) or None)
