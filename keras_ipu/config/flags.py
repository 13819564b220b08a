"""Poplar-style flags from the environment: TF_POPLAR_FLAGS and KERAS_IPU_FLAGS.

Ported programs set `TF_POPLAR_FLAGS` (e.g. `--use_ipu_model --ipu_model_tiles=8`);
keras_ipu reads it, and `KERAS_IPU_FLAGS` after it, so a flag in
`KERAS_IPU_FLAGS` wins over the same flag in `TF_POPLAR_FLAGS`. Flags are
written `--flag` or `--flag=value`; values with spaces may be quoted as in a
shell.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import warnings
from collections.abc import Callable, Mapping

# Read in this order; a later variable wins on conflicts.
FLAG_VARIABLES = ("TF_POPLAR_FLAGS", "KERAS_IPU_FLAGS")

_TRUE = ("", "true", "1", "yes")
_FALSE = ("false", "0", "no")


@dataclasses.dataclass(frozen=True)
class PoplarFlags:
    """The flags keras_ipu understands, as read from the environment.

    Args:
        use_ipu_model: `--use_ipu_model`. The device model is always an IPU
            model, so this has no further effect.
        ipu_model_tiles: `--ipu_model_tiles=N`: tiles per IPU when the
            config's `ipu_model.tiles_per_ipu` is 0; None when not given.
        use_synthetic_data: `--use_synthetic_data`: no host data is
            transferred; the runtime makes the inputs on the device.
        synthetic_data_initializer: `--synthetic_data_initializer=X`: how
            synthetic data is initialised; None when not given.
        executable_cache_path: `--executable_cache_path=DIR`: where compiled
            programs are saved, and loaded from by later processes instead
            of compiling (JAX's persistent compilation cache, turned on by
            `configure_ipu_system`); None when not given.
        execution_loop: `--execution_loop=auto|scan|host` (keras_ipu's own):
            how an execution strings its steps together: `scan` (an
            on-device loop), `host` (one compiled step dispatched per step),
            or `auto` (the default: chosen per program and platform, see
            `keras_ipu.device.loops`).
        xla_compiler_options: `--xla_compiler_options=tuned|default`
            (keras_ipu's own): `tuned` (the default) compiles keras_ipu's
            programs with the XLA options `keras_ipu.device.compiler` gives
            for their kind and platform (on CPUs, a host-dispatched
            pipeline's optimizer steps with the LLVM IR emitters, which
            compile them about three times as fast); `default` uses XLA's
            defaults for every program.
        background_loop_compile: `--background_loop_compile=auto|true|false`
            (keras_ipu's own): whether a program's first executions run its
            step dispatched per step while its on-device loop compiles on a
            host thread (`auto`, the default: on accelerators, not on CPUs;
            see `keras_ipu.device.background`).
        unknown: The flags not understood, as written.

    Example:

    >>> read_flags({"TF_POPLAR_FLAGS": "--use_ipu_model --ipu_model_tiles=8"}).ipu_model_tiles
    8
    """

    use_ipu_model: bool = False
    ipu_model_tiles: int | None = None
    use_synthetic_data: bool = False
    synthetic_data_initializer: str | None = None
    executable_cache_path: str | None = None
    execution_loop: str = "auto"
    xla_compiler_options: str = "tuned"
    background_loop_compile: str = "auto"
    unknown: tuple[str, ...] = ()


# Each parser takes the text after "=" (None for a bare `--flag`) and returns
# the value, or raises ValueError saying what the flag expects.


def _switch(text: str | None) -> bool:
    word = "" if text is None else text.lower()
    if word in _TRUE + _FALSE:
        return word in _TRUE
    raise ValueError("expects no value, or one of true/false/1/0")


def _count(text: str | None) -> int:
    try:
        count = int(text or "")
    except ValueError:
        raise ValueError("expects a whole number >= 0, e.g. --ipu_model_tiles=8") from None
    if count < 0:
        raise ValueError("expects a whole number >= 0, e.g. --ipu_model_tiles=8")
    return count


def _loop_form(text: str | None) -> str:
    forms = ("auto", "scan", "host")
    if text not in forms:
        raise ValueError(f"expects one of {', '.join(forms)}, e.g. --execution_loop=scan")
    return text


def _compiler_choice(text: str | None) -> str:
    choices = ("tuned", "default")
    if text not in choices:
        raise ValueError(f"expects one of {', '.join(choices)}, "
                         "e.g. --xla_compiler_options=default")
    return text


def _auto_switch(text: str | None) -> str:
    word = "" if text is None else text.lower()
    if word == "auto":
        return word
    try:
        return "true" if _switch(word) else "false"
    except ValueError:
        raise ValueError("expects auto, true or false, e.g. "
                         "--background_loop_compile=false") from None


def _text(text: str | None) -> str:
    if not text:
        raise ValueError("expects a value, written --flag=value")
    return text


_PARSERS: dict[str, Callable[[str | None], object]] = {
    "use_ipu_model": _switch,
    "ipu_model_tiles": _count,
    "use_synthetic_data": _switch,
    "synthetic_data_initializer": _text,
    "executable_cache_path": _text,
    "execution_loop": _loop_form,
    "xla_compiler_options": _compiler_choice,
    "background_loop_compile": _auto_switch,
}


def read_flags(environ: Mapping[str, str] | None = None) -> PoplarFlags:
    """Parses the flags in `TF_POPLAR_FLAGS` and `KERAS_IPU_FLAGS`.

    Flags are `--flag` or `--flag=value`. A flag given twice takes its last
    value, and `KERAS_IPU_FLAGS` is read after `TF_POPLAR_FLAGS`. Flags that
    keras_ipu does not understand (many Poplar flags tune the compiler) are
    collected in `unknown` and reported in one warning.

    Args:
        environ: The environment to read. Defaults to `os.environ`.

    Returns:
        The `PoplarFlags`.

    Raises:
        ValueError: For a known flag with a bad value, or unbalanced quotes,
            naming the variable and the flag.

    Example:

    >>> flags = read_flags({"KERAS_IPU_FLAGS": "--executable_cache_path=/tmp/cache"})
    >>> flags.executable_cache_path
    '/tmp/cache'
    """
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    unknown: list[tuple[str, str]] = []
    for variable in FLAG_VARIABLES:
        for token in _tokens(variable, environ.get(variable, "")):
            name, equals, text = token.removeprefix("--").partition("=")
            parse = _PARSERS.get(name) if token.startswith("--") else None
            if parse is None:
                unknown.append((variable, token))
                continue
            try:
                values[name] = parse(text if equals else None)
            except ValueError as error:
                raise ValueError(f"{variable}: flag {token!r} {error}.") from None
    if unknown:
        listed = ", ".join(f"{token} (in {variable})" for variable, token in unknown)
        warnings.warn(
            f"keras_ipu ignores unknown flag(s): {listed}. Known flags: "
            f"{', '.join('--' + name for name in _PARSERS)}.",
            stacklevel=2,
        )
    return PoplarFlags(**values, unknown=tuple(token for _, token in unknown))


def _tokens(variable: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as error:
        raise ValueError(f"{variable} cannot be parsed ({error}): {text!r}.") from None
