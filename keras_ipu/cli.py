"""The `keras-ipu` command line tool."""

from __future__ import annotations

import sys

_COMMANDS = {"demo": "keras_ipu.demo"}


def main(argv: list[str] | None = None) -> int:
    """Runs `keras-ipu COMMAND [ARGS]`; commands: `demo`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in _COMMANDS:
        print(f"usage: keras-ipu {{{','.join(_COMMANDS)}}} [args]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(_COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
