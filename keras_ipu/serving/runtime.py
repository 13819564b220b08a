"""The serving runtime: loads an export and runs it, without Keras.

It imports JAX and NumPy only, so a serving process that loads and runs an
export never imports Keras. See `keras_ipu.keras.export` for what an export
directory holds.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

FORMAT = "keras_ipu.serving/1"
STEP_FILE = "step.jaxexport"
LOOP_FILE = "loop.jaxexport"
STAGE_FILE = "stage_{stage}.jaxexport"
WEIGHTS_FILE = "weights.npz"
METADATA_FILE = "metadata.json"


class ServingRuntime:
    """A loaded export: call it with one batch, or `run_many` with many.

    Args:
        export_dir: The export directory.

    Raises:
        FileNotFoundError: When a file of the export is missing.
        ValueError: When the directory is not a keras_ipu export, or names
            two inputs (or outputs) alike.

    Example:

    >>> runtime = keras_ipu.serving.load("my_export")
    >>> runtime(np.ones((1, 4), "float32"), input_2=np.ones((1, 4), "float32"))
    """

    def __init__(self, export_dir: str):
        try:
            self._open(export_dir)
        except (FileNotFoundError, ValueError, MemoryError):
            raise
        except Exception as error:  # noqa: BLE001 - a truncated archive, a junk program, ...
            raise ValueError(f"{export_dir!r} holds a damaged keras_ipu export, or one this "
                             f"runtime cannot load ({type(error).__name__}: {error}); export "
                             f"it again.") from error

    def _open(self, export_dir: str) -> None:
        self.export_dir = export_dir
        self.metadata = _read_metadata(export_dir)
        self.inputs = self.metadata["inputs"]
        self.outputs = self.metadata["outputs"]
        _check_distinct(export_dir, "input", [entry["name"] for entry in self.inputs])
        _check_distinct(export_dir, "output", [entry["name"] for entry in self.outputs])
        self.batch_size = int(self.metadata["batch_size"])
        self.iterations = int(self.metadata["iterations"])
        with np.load(os.path.join(export_dir, WEIGHTS_FILE), allow_pickle=False) as stored:
            archive = _Weights(stored, self.metadata.get("weight_dtypes", {}))
            if "stages" in self.metadata:
                self._call_step = _Pipeline(export_dir, self.metadata["stages"], archive)
                self._call_loop = None
            else:
                self._weights = tuple(
                    [jax.device_put(archive[f"{prefix}{i}"]) for i in range(count)]
                    for prefix, count in zip("tn", self.metadata["num_weights"]))
                step = _deserialize(export_dir, STEP_FILE)
                loop = _deserialize(export_dir, LOOP_FILE)
                self._call_step = functools.partial(jax.jit(step.call), *self._weights)
                self._call_loop = functools.partial(jax.jit(loop.call), *self._weights)
        # Per input: (shape, dtype), to check a call's inputs quickly.
        self._expected = [(tuple(e["shape"]), np.dtype(e["dtype"])) for e in self.inputs]

    @property
    def devices(self) -> list:
        """The device each pipeline stage runs on (one entry for an export of one stage)."""
        if isinstance(self._call_step, _Pipeline):
            return self._call_step.devices
        return [self._weights[0][0].device if self._weights[0] else jax.devices()[0]]

    @property
    def input_names(self) -> list[str]:
        """The inputs' names, in order."""
        return [entry["name"] for entry in self.inputs]

    @property
    def output_names(self) -> list[str]:
        """The outputs' names, in order."""
        return [entry["name"] for entry in self.outputs]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs one batch of `batch_size` rows.

        Args:
            *args, **kwargs: The inputs, positionally or by name.

        Returns:
            The output as a NumPy array (one output); several as a list, or as a
            dict by name when they were named (`output_names`, a dict-output model).

        Raises:
            ValueError, TypeError: For missing, unknown, misshapen or
                mistyped inputs, naming the expected signature.
        """
        if not kwargs and self._exported_arrays(args):
            return self._named(self._call_step(*args))
        return self._named(self._call_step(*self._checked(self._bind(args, kwargs), leading=())))

    def _exported_arrays(self, args: Sequence[Any]) -> bool:
        """Whether `args` are NumPy arrays of the exported shapes and dtypes, in order.

        The common call, checked with as little Python as can be: the Python
        run before a device call lengthens the call beyond its own time (the
        general checks, 0.7 µs alone, made a 22 µs call take 26 µs; measured,
        BENCHMARKS.md "Serving").
        """
        if len(args) != len(self._expected):
            return False
        for value, (shape, dtype) in zip(args, self._expected):
            if value.__class__ is not np.ndarray or value.shape != shape or value.dtype != dtype:
                return False
        return True

    def run_many(self, *args: Any, **kwargs: Any) -> Any:
        """Runs many batches, `iterations` per device call (the exported loop).

        Args:
            *args, **kwargs: The inputs with a leading batches axis:
                `[n, batch_size, ...]`, `n` a multiple of `iterations`.

        Returns:
            The outputs with the same leading axis, as `__call__` returns them.

        Raises:
            ValueError, TypeError: As `__call__`, or when `n` is not a multiple
                of `iterations`.
        """
        inputs = self._bind(args, kwargs)
        count = np.shape(inputs[0])[0] if np.ndim(inputs[0]) else 0
        if count == 0 or count % self.iterations:
            raise ValueError(
                f"run_many takes a leading axis of batches that is a multiple of the export's "
                f"{self.iterations} iterations, got {count}."
            )
        inputs = self._checked(inputs, leading=(count,))
        results = []
        if self._call_loop is None:  # a pipeline: batches dispatched one after another
            results = [[o[None] for o in self._call_step(*(x[b] for x in inputs))]
                       for b in range(count)]
        for start in range(0, count if self._call_loop is not None else 0, self.iterations):
            chunk = [x[start:start + self.iterations] for x in inputs]
            results.append(self._call_loop(*chunk))
        joined = [np.concatenate([np.asarray(r[i]) for r in results])
                  for i in range(len(self.outputs))]
        return self._named(joined)

    def signature(self) -> str:
        """The expected inputs and outputs, in words."""
        def entries(items):
            return ", ".join(
                f"{e['name']}{_key_note(e)}: {e['dtype']}{list(e['shape'])}" for e in items)

        return f"inputs ({entries(self.inputs)}) -> outputs ({entries(self.outputs)})"

    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        names = self.input_names
        if len(args) == 1 and not kwargs and isinstance(args[0], Mapping):
            args, kwargs = (), args[0]
        if len(args) == 1 and len(names) > 1 and isinstance(args[0], (list, tuple)):
            args = tuple(args[0])
        kwargs = self.by_name(kwargs)
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(f"Unknown inputs {unknown}; the export expects {self.signature()}.")
        if len(args) > len(names):
            raise TypeError(
                f"{len(args)} inputs given; the export expects {self.signature()}.")
        bound = dict(zip(names, args))
        twice = sorted(set(bound) & set(kwargs))
        if twice:
            raise TypeError(f"Inputs {twice} given twice; the export expects {self.signature()}.")
        bound.update(kwargs)
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"Missing inputs {missing}; the export expects {self.signature()}.")
        return [bound[n] for n in names]

    def by_name(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Inputs by name: a model taking a dict of inputs is also called by its keys.

        Args:
            given: Inputs by name, or by the model's dict keys.

        Returns:
            The inputs by name (names the export does not have are kept, for
            the caller to refuse).

        Raises:
            TypeError: When an input is given twice (by its name and its key).

        Example:

        >>> load(path).by_name({"u": u})   # a model called with {"u": ...}
        {'input_u': u}
        """
        names = self.input_names
        keys = {e["key"]: e["name"] for e in self.inputs if e.get("key") is not None}
        if keys and set(given) == set(keys):  # the model's own dict: by key, whatever the names
            return {keys[key]: value for key, value in given.items()}
        aliases = {key: name for key, name in keys.items() if key not in names}
        named: dict[str, Any] = {}
        spelled: dict[str, str] = {}  # name -> the key that gave it first
        for key, value in given.items():
            name = aliases.get(key, key)
            if name in named:
                raise TypeError(f"Input {name!r} given twice (as {spelled[name]!r} and "
                                f"{key!r}); the export expects {self.signature()}.")
            named[name], spelled[name] = value, key
        return named

    def _checked(self, inputs: list[Any], leading: tuple[int, ...]) -> list[Any]:
        checked = []
        for (shape, dtype), value in zip(self._expected, inputs):
            array = value if isinstance(value, (np.ndarray, jax.Array)) else np.asarray(value)
            if array.shape != (*leading, *shape) or array.dtype != dtype:
                array = self._converted(len(checked), array, leading)
            checked.append(array)
        return checked

    def _converted(self, index: int, array: Any, leading: tuple[int, ...]) -> Any:
        """An input of the wrong shape raises; one of another dtype is cast when safe."""
        entry = self.inputs[index]
        shape, dtype = self._expected[index]
        expected = (*leading, *shape)
        if tuple(array.shape) != expected:
            raise ValueError(
                f"Input {entry['name']!r} has shape {tuple(array.shape)}, expected "
                f"{expected}; the export expects {self.signature()}.")
        try:
            return cast_input(entry["name"], array, dtype)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{error} The export expects {self.signature()}.") from None

    def by_output_name(self, result: Any) -> dict[str, np.ndarray]:
        """A call's result (an array, a list, or a dict) as a dict by output name.

        Example:

        >>> runtime.by_output_name(runtime(x))
        {'output_0': array(...), 'output_1': array(...)}
        """
        if isinstance(result, Mapping):
            return dict(result)
        results = result if isinstance(result, list) else [result]
        return dict(zip(self.output_names, results))

    def _named(self, outputs: Sequence[Any]) -> Any:
        # As the reference: several outputs are a dict when they were named (output_names, or
        # a model returning a dict), else a list. Exports older than the flag: a dict.
        arrays = [np.asarray(o) for o in outputs]
        if len(arrays) == 1:
            return arrays[0]
        if self.metadata.get("named_outputs", True):
            return dict(zip(self.output_names, arrays))
        return arrays


def cast_input(name: str, array: Any, dtype: Any) -> np.ndarray:
    """An input as `dtype`, when its values are `dtype` data (the runtime's and the server's rule).

    NumPy's `same_kind` rule, except between integer dtypes, where the values
    decide: a literal `[0, 128, 255]` (int64) is uint8 data, and `300` is not
    int8 data (it would wrap). A float never becomes an integer, text never a
    number.

    Args:
        name: The input's name, for the messages.
        array: Its values (a NumPy or JAX array).
        dtype: The export's dtype for it.

    Returns:
        The values as a NumPy array of `dtype`.

    Raises:
        TypeError: When the values' dtype does not cast to `dtype`.
        ValueError: When integer values are outside `dtype`'s range.

    Example:

    >>> cast_input("u", np.array([0, 255]), np.uint8)
    array([  0, 255], dtype=uint8)
    """
    array, dtype = np.asarray(array), np.dtype(dtype)
    integers = array.dtype.kind in "iu" and dtype.kind in "iu"
    if not integers and not np.can_cast(array.dtype, dtype, casting="same_kind"):
        kind = {"U": "text", "O": "mixed or null"}.get(array.dtype.kind, str(array.dtype))
        raise TypeError(f"Input {name!r} is not {dtype} data: its values are {kind}, which "
                        f"does not cast to {dtype} (NumPy's same_kind rule).")
    if integers and array.size:
        limits = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < limits.min or high > limits.max:
            raise ValueError(f"Input {name!r} is not {dtype} data: its values {low} to {high} "
                             f"are outside {dtype}'s [{limits.min}, {limits.max}].")
    return array.astype(dtype, copy=False)


class _Weights:
    """The weights of an export's archive, each in its exported dtype.

    NumPy's archive stores ml_dtypes' types (bfloat16, float8) as raw bytes
    (`V2`, `V1`); the export records their dtypes, and each is viewed as its
    own again.
    """

    def __init__(self, archive: Any, dtypes: Mapping[str, str]):
        self._archive = archive
        self._dtypes = dtypes

    def __getitem__(self, key: str) -> np.ndarray:
        array = self._archive[key]
        dtype = self._dtypes.get(key)
        # NumPy knows the names of ml_dtypes' types once JAX has imported it.
        return array if dtype is None else array.view(np.dtype(dtype))


class _Pipeline:
    """A pipelined export's stages, each run on its IPU's device, in order.

    A stage's outputs move to the next stage's device; batches dispatched
    one after another overlap across the devices (JAX dispatches
    asynchronously), as the pipeline's stages do.
    """

    def __init__(self, export_dir: str, stages: list[dict], archive: Any):
        devices = jax.devices()
        self._stages = []
        for index, stage in enumerate(stages):
            device = devices[stage["ipu"] % len(devices)]
            weights = [jax.device_put(archive[f"s{index}_{i}"], device)
                       for i in range(stage["num_weights"])]
            program = jax.jit(_deserialize(export_dir, stage["file"]).call)
            self._stages.append((device, weights, program))

    @property
    def devices(self) -> list:
        return [device for device, _, _ in self._stages]

    def __call__(self, *inputs: Any) -> tuple:
        carried: tuple = ()
        for device, weights, program in self._stages:
            carried = program(weights, jax.device_put(list(carried), device),
                              jax.device_put(list(inputs), device))
        return carried


def run_inline_on_cpu() -> None:
    """Makes this process run CPU programs on the calling thread; call before JAX starts.

    JAX runs CPU programs on worker threads by default, which lets training
    overlap the host with the device; for serving one small batch at a time,
    waking a worker costs more than the program (about 50 µs against 10 µs
    for a 3-layer MLP, measured in BENCHMARKS.md). The setting is fixed when
    JAX creates its CPU backend, so it only takes effect before that; the
    serving commands call this first.

    Example:

    >>> run_inline_on_cpu()  # first thing in a serving process
    """
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def load(export_dir: str) -> ServingRuntime:
    """Loads an export written by `export_for_ipu_serving` or `export_keras`.

    Args:
        export_dir: The export directory.

    Returns:
        A `ServingRuntime`.

    Raises:
        FileNotFoundError, ValueError: As `ServingRuntime`.

    Example:

    >>> predict = keras_ipu.serving.load("my_export")
    >>> predict(np.ones((1, 4), "float32"), np.ones((1, 4), "float32"))
    """
    ipus = _read_metadata(export_dir).get("num_ipus", 1)
    if isinstance(ipus, bool) or not isinstance(ipus, int) or ipus < 1:
        raise ValueError(f"{export_dir!r} holds a damaged keras_ipu export: its "
                         f"{METADATA_FILE} gives num_ipus {ipus!r}, not a whole number of "
                         f"IPUs (1 or more); export it again.")
    _request_cpu_devices(ipus)
    return ServingRuntime(export_dir)


def _request_cpu_devices(count: int) -> None:
    """Asks JAX for one CPU device per IPU (at most `MAX_CPU_DEVICES`, which more IPUs
    share, as in training), when it has not started yet (else keeps its own)."""
    from keras_ipu.device.system import MAX_CPU_DEVICES

    count = min(count, MAX_CPU_DEVICES)
    if count > 1 and jax.config.jax_num_cpu_devices < count:
        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError:
            pass  # JAX already runs: its devices are the ones there are


def _read_metadata(export_dir: str) -> dict:
    path = os.path.join(export_dir, METADATA_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{export_dir!r} is not a keras_ipu export: it has no {METADATA_FILE}.")
    with open(path) as f:
        try:
            metadata = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path!r} is not JSON: {error}.") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{path!r} holds a JSON {type(metadata).__name__}, not an export's "
                         f"metadata (an object): the export is damaged.")
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"{export_dir!r} holds an export of format {metadata.get('format')!r}; this "
            f"runtime reads {FORMAT!r}.")
    return metadata


def _check_distinct(export_dir: str, kind: str, names: list[str]) -> None:
    """Raises `ValueError` when two inputs (or outputs) share a name: binding would mix them."""
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(
            f"The export in {export_dir!r} names several {kind}s {twice} (its {kind}s: "
            f"{names}); inputs are bound by name, so each needs its own: export it again "
            f"with this keras_ipu, which names them apart.")


def _deserialize(export_dir: str, name: str) -> Any:
    path = os.path.join(export_dir, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"The export in {export_dir!r} has no {name}.")
    with open(path, "rb") as f:
        return jax.export.deserialize(bytearray(f.read()))


def _key_note(entry: Mapping[str, Any]) -> str:
    """` (key 'u')` for an input the model's dict knows by another key than its name."""
    key = entry.get("key")
    return f" (key {key!r})" if key not in (None, entry["name"]) else ""


__all__ = ["ServingRuntime", "cast_input", "load", "run_inline_on_cpu"]

