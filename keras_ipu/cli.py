"""The `keras-ipu` command line tool (also `python -m keras_ipu`)."""

from __future__ import annotations

import importlib
import os
import sys

# Command -> (module, function): each takes the command's arguments, returns the exit status.
_COMMANDS = {
    "demo": ("keras_ipu.demo", "main"),
    "show": ("keras_ipu.serving.commands", "show_main"),
    "run": ("keras_ipu.serving.commands", "run_main"),
    "serve": ("keras_ipu.serving.commands", "serve_main"),
    "convert": ("keras_ipu.serving.commands", "convert_main"),
}
_HELP = {
    "demo": "train a model on virtual IPUs and print its report",
    "show": "show an export's signatures and metadata",
    "run": "run one batch through an export; with --num-instances N, start N instances "
           "of a training script",
    "serve": "serve an export with TensorFlow Serving's REST API",
    "convert": "turn a saved Keras model into an export (pipeline: manual, load or auto)",
}


def main(argv: list[str] | None = None) -> int:
    """Runs `keras-ipu COMMAND [ARGS]`.

    Args:
        argv: The arguments after the program name (default: `sys.argv[1:]`).

    Returns:
        The exit status.

    Example:

    >>> main(["show", "--dir", "my_export"])
    0
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        status = _dispatch(argv)
        sys.stdout.flush()  # a reader gone is seen here, not as the interpreter exits
        return status
    except BrokenPipeError:  # `keras-ipu show ... | head -1`: the reader has gone
        # As Python's documentation advises: the exit's flush then writes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] not in _COMMANDS:
        print(f"error: unknown command {argv[0]!r}; commands: {', '.join(_COMMANDS)}",
              file=sys.stderr)
        return 2
    module, function = _COMMANDS[argv[0]]
    if argv[0] == "run" and _launches(argv[1:]):
        module, function = "keras_ipu.distributed.launcher", "main"
    elif argv[0] == "run" and (stray := _launcher_options(argv[1:])):
        given = ", ".join(a for a in stray if a != "--") or "a script after --"
        print(f"error: {given}: `keras-ipu run` starts instances of a script only with "
              f"--num-instances N (`keras-ipu run --num-instances 2 --num-replicas 4 -- "
              f"train.py`); without it, it runs an export (--dir DIR).", file=sys.stderr)
        return 2
    else:  # a tool of one process, even when a job's instance starts it
        from keras_ipu.distributed import runtime

        runtime.leave_job_environment()
    return getattr(importlib.import_module(module), function)(argv[1:])


def _launches(args: list[str]) -> bool:
    """Whether `run ARGS` starts instances of a script rather than running an export."""
    options = args[: args.index("--")] if "--" in args else args
    return any(a == "--num-instances" or a.startswith("--num-instances=") for a in options)


def _launcher_options(args: list[str]) -> list[str]:
    """The launcher's own options (and `--`) among `run ARGS` that start no instances."""
    options = args[: args.index("--") + 1] if "--" in args else args
    return [a.split("=")[0] for a in options
            if a == "--" or a.split("=")[0] in _LAUNCHER_OPTIONS]


# Options only the launcher takes; the export runner's are spelt with underscores.
_LAUNCHER_OPTIONS = ("--num-replicas", "--ipus-per-replica", "--coordinator")


def _usage() -> str:
    lines = [f"usage: keras-ipu {{{','.join(_COMMANDS)}}} [args]", "", "commands:"]
    lines += [f"  {name:6s} {text}" for name, text in _HELP.items()]
    lines.append("\nRun `keras-ipu COMMAND --help` for a command's arguments.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
