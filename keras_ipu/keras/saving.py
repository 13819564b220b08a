"""Saving inside the scope: files are replaced whole, and bad files are named for what is wrong.

`write_whole` makes `model.save` and `model.save_weights` (and so
`keras.callbacks.ModelCheckpoint`) write to a temporary file next to the
target and move it into place only once complete: a save that fails leaves
the previous file as it was. The file gets the mode a plain Keras save gives
it (the existing file's, else the umask's), and a symbolic link is written
through, as Keras writes through it. Where the user may not write the file, or
may not make one in its folder, Keras writes it as it would (or refuses).
`check_model_file` explains why a `.keras` file cannot be a Keras model (Keras
itself says "File not found" for a file that exists but is not a zip archive);
`install` makes `keras.models.load_model` run it first inside a strategy scope
(outside, Keras' loader runs alone), and routes Keras' `Model.save` and
`save_weights` through `write_whole` for IPU models (other models save as Keras
saves them).
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
import zipfile
from collections.abc import Callable
from typing import Any

# Set while `on_first_instance` runs a save: a save inside it (BackupAndRestore's
# `save_weights`) runs in instance 0 alone, so it must not wait for the others.
_WRITING = threading.local()
# Per file path, the saves of a multi-host job this process made or waited for: the
# n-th save of a path in another instance waits for instance 0's n-th write of it.
_SAVES: dict[str, int] = {}
# How long another instance waits for instance 0 to write (the launcher stops the
# job sooner when instance 0 dies): instances reach a save together, but for the
# work instance 0 alone may do first (evaluating, say).
_WAIT_FOR_WRITER_MS = 10 * 60 * 1000

# The extensions Keras recognises, longest first.
_EXTENSIONS = (".weights.h5", ".keras", ".h5", ".hdf5")
_CONFIG = "config.json"


def write_whole(filepath: Any, overwrite: bool, write: Callable[[str], Any]) -> Any:
    """Calls `write(temporary path)`, then moves the file to `filepath` in one step.

    Args:
        filepath: The target file.
        overwrite: Keras' `overwrite`: when `False` and the file exists, the
            user is asked first (Keras' prompt).
        write: Writes the file at the path it is given.

    Returns:
        What `write` returned (`None` when the user declined to overwrite).

    Raises:
        Whatever `write` raised; the target is then untouched and the
        temporary file removed.

    Example:

    >>> write_whole("m.keras", True, lambda path: keras_save(model, path))
    """
    path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
    suffix = _extension(path) if path is not None else None
    if suffix is None or "://" in path or os.path.isdir(path):
        return write(filepath)  # remote paths, directories, unknown formats: as Keras does
    if not overwrite and os.path.exists(path):
        from keras.src.utils import io_utils

        if not io_utils.ask_to_proceed_with_overwrite(path):
            return None
    path = os.path.realpath(path)  # a link stays a link: its target is replaced
    folder = os.path.dirname(path)
    if not os.path.isdir(folder) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return write(filepath)  # Keras' own error, naming the path it was given
    try:
        temporary = _new_file(folder, f".{os.path.basename(path)}.", suffix)
    except PermissionError:  # a folder the user may not write in: in place, as Keras writes
        return write(filepath)
    try:
        try:
            result = write(temporary)
        except Exception as error:
            if temporary in str(error):  # Keras named the file it was given
                error.add_note(f"{temporary} is the temporary file of the save to {path}.")
            raise
        if os.path.exists(path):
            shutil.copymode(path, temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return result


def _new_file(folder: str, prefix: str, suffix: str) -> str:
    """Creates an empty file of a new name in `folder`, with the umask's mode.

    Unlike `tempfile.mkstemp` (mode 0600), the mode is the one a file that
    Keras creates gets, so the saved file can be shared as a plain save's.
    """
    while True:
        name = os.path.join(folder, f"{prefix}{secrets.token_hex(8)}{suffix}")
        try:
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return name
        except FileExistsError:  # 2**64 names: another try is enough
            continue


def on_first_instance(save: Callable[[], Any], filepath: Any) -> Any:
    """Runs `save` in instance 0 of a multi-host job only; the others wait for it to finish.

    The instances hold the same weights, so one writer suffices, and on a
    shared file system several would overwrite each other. An instance that
    calls it too waits until the file is written (and learns whether it was)
    through the job's coordination service, so that it can load the file as
    soon as `save` returns. Instance 0 waits for no one: a save made in
    instance 0 alone (Horovod's `if hvd.rank() == 0: model.save(...)`, a
    `ModelCheckpoint` given to instance 0 only) writes and goes on.

    Args:
        save: Writes the file.
        filepath: The file: the others wait for instance 0's save of the same
            path, counted (the n-th save of a path waits for the n-th write).

    Returns:
        What `save` returned in instance 0; `None` in the others.

    Raises:
        RuntimeError: In the other instances, when instance 0 failed to write.
        Whatever `save` raised, in instance 0.

    Example:

    >>> on_first_instance(lambda: keras_save(model, "m.keras"), "m.keras")
    """
    import jax

    if (not jax.distributed.is_initialized() or jax.process_count() == 1
            or getattr(_WRITING, "active", False)):
        return save()
    from jax._src import distributed  # the coordination service's key-value store

    client = distributed.global_state.client
    path = str(filepath)  # as every instance names it
    _SAVES[path] = count = _SAVES.get(path, 0) + 1
    key = f"keras_ipu/saved/{path}/{count}"
    if jax.process_index() != 0:
        try:
            written = client.blocking_key_value_get(key, _WAIT_FOR_WRITER_MS)
        except Exception as error:
            if "DEADLINE_EXCEEDED" not in str(error):  # the job's runtime failed
                raise
            raise RuntimeError(
                f"Instance 0 did not save {filepath!r} within {_WAIT_FOR_WRITER_MS / 1000:g} "
                f"seconds. In a job, instance 0 writes the "
                f"files `model.save` and `save_weights` name, and the other instances wait "
                f"for it: save to the same path in every instance, or in instance 0 only; "
                f"for a file of this instance's own, use `keras.saving.save_model(model, "
                f"path)`, which every instance writes itself.") from error
        if written != "written":
            raise RuntimeError(f"Instance 0 failed to save {filepath!r}; see its error.")
        return None
    _WRITING.active = True
    try:
        result = save()
    except BaseException:
        client.key_value_set(key, "failed")  # told to the others before it is raised
        raise
    finally:
        _WRITING.active = False
    client.key_value_set(key, "written")
    return result


def backups_on_first_instance(callbacks: Any) -> None:
    """Makes each `keras.callbacks.BackupAndRestore` of `callbacks` write its backup folder
    (weights, `training_metadata.json`, the final removal) from instance 0 only.

    Keras' callback writes and removes its files in every instance; on one
    file system they race (`FileNotFoundError`). Now the others wait for
    instance 0 as for `save_weights`, and then read what it wrote.

    Example:

    >>> backups_on_first_instance([keras.callbacks.BackupAndRestore("backup")])
    """
    import jax
    from keras.src.callbacks.backup_and_restore import BackupAndRestore

    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return
    for callback in callbacks or ():
        if not isinstance(callback, BackupAndRestore) or "_save_model" in vars(callback):
            continue
        for name in ("_save_model", "on_train_end"):
            write = getattr(callback, name)
            setattr(callback, name,
                    lambda *args, write=write, folder=callback.backup_dir, **kwargs:
                    on_first_instance(lambda: write(*args, **kwargs), folder))


def check_model_file(filepath: Any) -> None:
    """Raises an error that says what is wrong with a `.keras` file that exists.

    Files that do not exist, directories and other formats are left to Keras.

    Args:
        filepath: The file given to `load_model`.

    Raises:
        ValueError: For an empty file, one that is not a zip archive, a
            damaged archive, or an archive without the model's `config.json`.

    Example:

    >>> check_model_file("weights.bin.keras")
    ValueError: weights.bin.keras is not a valid .keras archive: it is not a zip file ...
    """
    if not isinstance(filepath, (str, os.PathLike)):
        return
    path = os.fspath(filepath)
    if not path.endswith(".keras") or not os.path.isfile(path):
        return
    problem = _archive_problem(path)
    if problem:
        raise ValueError(
            f"{path} is not a valid .keras archive: {problem}. A .keras file is the zip "
            f"archive `model.save(...)` writes."
        )


def install(is_ipu_model: Callable[[Any], bool] = lambda model: False) -> None:
    """Makes `keras.models.load_model` (and `keras.saving.load_model`) check the file in a
    scope, and an IPU model's `save` and `save_weights` replace the file whole.

    Keras' own `Model.save` and `save_weights` are routed, as `fit` is: an
    override in the model's class runs first, with the path it was given, and
    its `super().save(...)` writes the file whole (in a multi-host job, in
    instance 0 alone). Idempotent. Outside every strategy scope the wrapped
    loader is Keras' own, and other models save as Keras saves them.

    Args:
        is_ipu_model: Whether a model was made in a strategy scope.

    Example:

    >>> install(lambda model: isinstance(model, ExtensionBase))
    """
    import keras
    from keras.src.models.model import Model

    for namespace in (keras.models, keras.saving):
        original = namespace.load_model
        if getattr(original, "_keras_ipu_checked", False):
            continue
        namespace.load_model = _checked_loader(original)
    for name, whole in (("save", _saved_whole), ("save_weights", _weights_saved_whole)):
        if name not in _KERAS_SAVES:
            _KERAS_SAVES[name] = Model.__dict__[name]
            setattr(Model, name, _routed_save(_KERAS_SAVES[name], whole, is_ipu_model))


# Keras' own `Model.save` and `save_weights`, before `install` routed them.
_KERAS_SAVES: dict[str, Callable[..., Any]] = {}


def _routed_save(original: Callable[..., Any], whole: Callable[..., Any],
                 is_ipu_model: Callable[[Any], bool]) -> Callable[..., Any]:
    import functools

    @functools.wraps(original)
    def save(self, filepath, *args, **kwargs):
        if is_ipu_model(self):
            return whole(original, self, filepath, *args, **kwargs)
        return original(self, filepath, *args, **kwargs)

    return save


def _saved_whole(save, model, filepath, overwrite=True, zipped=None, **kwargs):
    # `zipped=False` writes a folder (Keras refuses `.keras` names): as Keras writes it,
    # given as absolute (Keras writes the assets of a relative one into its temporary
    # folder, and an IPU subclassed model's options are an asset).
    path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
    if zipped is False and path and "://" not in path and not path.endswith(".keras"):
        filepath = os.path.abspath(path)
    return _written(lambda path, overwrite: save(model, path, overwrite, zipped, **kwargs),
                    filepath, overwrite, whole=zipped is not False)


def _weights_saved_whole(save_weights, model, filepath, overwrite=True, max_shard_size=None):
    # Sharded weights: their files as Keras writes them; another name than Keras takes for
    # weights: its error, naming it.
    whole = max_shard_size is None and str(filepath).endswith(".weights.h5")
    return _written(lambda path, overwrite: save_weights(model, path, overwrite, max_shard_size),
                    filepath, overwrite, whole=whole)


def _written(save: Callable[[Any, bool], Any], filepath: Any, overwrite: bool,
             whole: bool) -> Any:
    """`save(path, overwrite)` in instance 0 alone; `whole`: into a file replaced whole."""
    if not whole:
        return on_first_instance(lambda: save(filepath, overwrite), filepath)
    return on_first_instance(lambda: write_whole(
        filepath, overwrite, lambda path: save(path, True)), filepath)


def _checked_loader(original: Callable[..., Any]) -> Callable[..., Any]:
    import functools

    from keras_ipu.keras import context

    @functools.wraps(original)
    def load_model(filepath, *args, **kwargs):
        if context.current_strategy() is not None:
            check_model_file(filepath)
        return original(filepath, *args, **kwargs)

    load_model._keras_ipu_checked = True
    return load_model


def _archive_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    if size == 0:
        return "it is empty (0 bytes)"
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            start = f.read(16)
        return f"it is not a zip file ({size} bytes, starting {start!r})"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError) as error:
        return f"the zip archive is damaged ({error})"
    if damaged is not None:
        return f"the zip archive is damaged (member {damaged!r} fails its checksum)"
    if _CONFIG not in names:
        held = ", ".join(sorted(names)[:5]) or "nothing"
        return f"the zip archive has no {_CONFIG} (it holds: {held})"
    return None


def _extension(path: str) -> str | None:
    return next((ext for ext in _EXTENSIONS if path.endswith(ext)), None)


__all__ = ["check_model_file", "install", "write_whole"]
