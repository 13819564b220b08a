"""The executable cache: `--executable_cache_path=DIR` as JAX's persistent compilation cache.

On the IPU the flag names a directory where each compiled executable is
saved, and from which a later process loads it instead of compiling again.
keras_ipu's programs are XLA executables, so the flag turns on JAX's
persistent compilation cache in that directory. Every program is cached,
however quick to compile or small (JAX's defaults skip programs that compile
in under a second), as the IPU's cache kept every executable.

The flag takes effect while a system configured with it is configured:
configuring without it (or `reset_ipu_configuration`) puts JAX's own settings
back as they were. When JAX already had a cache directory of its own (e.g.
`JAX_COMPILATION_CACHE_DIR`), the flag wins, with a warning: the flag is the
program's own request, and a second directory would split one process's
executables over two caches.

Programs that embed host callbacks cannot be cached by JAX (the callback is
a live Python object), so models with asynchronous callbacks
(`set_asynchronous_callbacks(True)`, whose outfeed streams through a host
callback) compile their step loops again in each process; everything else
of a `fit`, `evaluate` and `predict` is loaded from the cache.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

# JAX's settings the flag changes, and the values it gives them: on, in the
# flag's directory, every program (no compile-time or size threshold; -1
# also stops JAX from raising the size threshold for the file system).
_DIRECTORY = "jax_compilation_cache_dir"
_SETTINGS: dict[str, Any] = {
    "jax_enable_compilation_cache": True,
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}

# JAX's settings from before the flag changed them; None while the flag is
# not in effect.
_saved: dict[str, Any] | None = None


def use(path: str | os.PathLike[str] | None) -> str | None:
    """Puts the executable cache in `path`, or takes it away (`None`).

    With a path: creates the directory if needed and points JAX's
    persistent compilation cache at it, caching every program. Calling it
    again with the same path changes nothing; with another path the cache
    moves there. With `None`: puts back the JAX settings from before the
    first call (nothing happens when the cache is not in use). JAX reads
    these settings when it compiles, so this works also after JAX has
    started and compiled programs.

    Args:
        path: The cache directory (`~` is expanded, a relative path is taken
            from the current directory), or None.

    Returns:
        The absolute cache directory, or None.

    Raises:
        ValueError: When the directory cannot be created (e.g. a file is in
            the way, or no permission), naming the flag.

    Warns:
        UserWarning: When JAX had a different cache directory of its own,
            which the flag replaces until the cache is taken away again; when
            the directory cannot be written (it is read, nothing is added).

    Example:

    >>> use("/tmp/ipu_cache")
    '/tmp/ipu_cache'
    >>> jax.config.jax_compilation_cache_dir
    '/tmp/ipu_cache'
    >>> use(None)   # JAX's own settings again
    """
    global _saved
    if path is None:
        if _saved is not None:
            _apply(_saved)
            _saved = None
        return None
    directory = os.path.abspath(os.path.expanduser(os.fspath(path)))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"--executable_cache_path={path}: the cache directory cannot be created "
            f"({error}). Name a directory this process may write to."
        ) from None
    try:  # else JAX warns at each program it fails to write
        handle, probe = tempfile.mkstemp(dir=directory, prefix=".keras_ipu_write_check")
        os.close(handle)
        os.remove(probe)
    except OSError as error:
        # A cache built ahead and shipped read-only still serves its programs.
        warnings.warn(
            f"--executable_cache_path={path}: the cache directory cannot be written "
            f"({error}): programs already in it are read, new ones are not kept.",
            stacklevel=3)
    if _saved is None:
        _saved = {name: getattr(jax.config, name) for name in (_DIRECTORY, *_SETTINGS)}
        own = _saved[_DIRECTORY]
        if own and os.path.abspath(os.path.expanduser(own)) != directory:
            warnings.warn(
                f"--executable_cache_path={path} replaces JAX's compilation cache "
                f"directory {own!r} (jax_compilation_cache_dir) for as long as a system "
                f"configured with the flag is configured. Leave one of them out to keep "
                f"one cache.",
                stacklevel=3,
            )
    _apply({**_SETTINGS, _DIRECTORY: directory})
    return directory


def directory() -> str | None:
    """The executable cache's directory while the flag is in effect, else None.

    Example:

    >>> directory() is None   # no system configured with the flag
    True
    """
    return None if _saved is None else getattr(jax.config, _DIRECTORY)


def _apply(settings: dict[str, Any]) -> None:
    moved = settings[_DIRECTORY] != getattr(jax.config, _DIRECTORY)
    for name, value in settings.items():
        jax.config.update(name, value)
    if moved:
        # JAX opens its cache once, on the first compilation that uses it,
        # and keeps it: forget the open one so the next compilation opens
        # the cache in the new directory (or none).
        compilation_cache.reset_cache()
