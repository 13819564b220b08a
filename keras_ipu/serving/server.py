"""A model server speaking TensorFlow Serving's REST API, for one export.

`GET /v1/models/NAME` (status), `GET /v1/models/NAME/metadata` (the
signature) and `POST /v1/models/NAME:predict` with `instances` (row format)
or `inputs` (columnar format), so TensorFlow Serving clients work unchanged.
Requests are batched dynamically: the rows of waiting requests are gathered
up to the export's batch size (waiting at most `max_batch_delay_ms` for more),
a partial batch is padded, and each request gets its own rows back; one device
call runs at a time. Errors use TensorFlow Serving's form, `{"error": "..."}`,
with status 400 (bad request), 404 (unknown model), 413 (body too large).

The HTTP side is aiohttp (the optional extra `keras_ipu[serve]`); the model
side is the Keras-free `ServingRuntime`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import math
import time
import urllib.parse
from typing import Any

import numpy as np

from keras_ipu.serving.runtime import ServingRuntime, cast_input

MAX_BODY_BYTES = 16 * 1024 * 1024
_TF_DTYPES = {"float32": "DT_FLOAT", "float64": "DT_DOUBLE", "float16": "DT_HALF",
              "bfloat16": "DT_BFLOAT16", "int32": "DT_INT32", "int64": "DT_INT64",
              "int8": "DT_INT8", "uint8": "DT_UINT8", "int16": "DT_INT16", "bool": "DT_BOOL",
              "uint16": "DT_UINT16", "uint32": "DT_UINT32", "uint64": "DT_UINT64",
              "complex64": "DT_COMPLEX64", "complex128": "DT_COMPLEX128"}


class RequestError(Exception):
    """A bad request: its message and HTTP status."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class _Pending:
    """One request's rows, waiting for a batch."""

    rows: dict[str, np.ndarray]  # name -> [n, ...]
    future: asyncio.Future
    count: int
    # first row -> (rows, outputs)
    done: dict[int, tuple[int, dict]] = dataclasses.field(default_factory=dict)
    delivered: int = 0  # rows in `done`: counted as they come, not summed at each piece


class DynamicBatcher:
    """Gathers requests' rows into full batches and runs them one device call at a time.

    Args:
        runtime: The export's runtime.
        max_batch_delay_ms: How long a batch waits for more rows.

    Raises:
        ValueError: For a delay that is negative, infinite or NaN.

    Example:

    >>> batcher = DynamicBatcher(runtime, max_batch_delay_ms=2)
    >>> outputs = await batcher.predict({"x": rows})  # inside the server's event loop
    """

    def __init__(self, runtime: ServingRuntime, max_batch_delay_ms: float = 2.0):
        if not 0 <= max_batch_delay_ms < math.inf:  # NaN too: no batch would ever leave
            raise ValueError(f"max_batch_delay_ms must be a finite number >= 0, got "
                             f"{max_batch_delay_ms!r}.")
        self.runtime = runtime
        self.delay_s = max_batch_delay_ms / 1000
        self._queue: asyncio.Queue | None = None
        self._device = concurrent.futures.ThreadPoolExecutor(1, "keras_ipu-serve")
        self._task: asyncio.Task | None = None
        self._whole = set(unbatched_outputs(runtime))
        self.device_calls = 0

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._device.shutdown(wait=True)

    async def predict(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs for `rows` (each input `[n, ...]`), by output name."""
        count = len(next(iter(rows.values())))
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(rows, future, count))
        return await future

    async def _run(self) -> None:
        batch = self.runtime.batch_size
        carry: list[tuple[_Pending, int]] = []  # (request, first row not yet run)
        while True:
            carry = _live(carry)
            if not carry:
                first = await self._queue.get()
                carry.append((first, 0))
            deadline = time.monotonic() + self.delay_s
            while _rows_waiting(carry) < batch:
                if not self._queue.empty():  # taken at once: no timer per request
                    carry.append((self._queue.get_nowait(), 0))
                    continue
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    carry.append((await asyncio.wait_for(self._queue.get(), timeout), 0))
                except TimeoutError:
                    break
            pieces, carry = _take(_live(carry), batch)  # one may have gone while it waited
            if not pieces:
                continue
            try:
                await self._run_batch(pieces)
            except Exception as error:  # the batch's requests hear of it; the loop goes on
                _fail(pieces, error)

    async def _run_batch(self, pieces: list[tuple[_Pending, int, int]]) -> None:
        """Runs one padded batch and hands each piece its rows."""
        batch = self.runtime.batch_size
        inputs = {}
        for entry in self.runtime.inputs:
            name = entry["name"]
            rows = [p.rows[name][start:stop] for p, start, stop in pieces]
            filled = sum(len(r) for r in rows)
            pad = np.zeros((batch - filled, *entry["shape"][1:]), entry["dtype"])
            inputs[name] = np.concatenate([*rows, pad]) if filled < batch else np.concatenate(rows)
        try:
            outputs = await asyncio.get_running_loop().run_in_executor(
                # Positionally, in the export's order: the names are no dict keys to map.
                self._device, lambda: self.runtime(*(inputs[e["name"]]
                                                     for e in self.runtime.inputs)))
            self.device_calls += 1
        except Exception as error:  # the device failed: every waiting request hears of it
            _fail(pieces, error)
            return
        outputs = self.runtime.by_output_name(outputs)
        whole = self._whole
        offset = 0
        for pending, start, stop in pieces:
            # An output without the batch dimension belongs to the batch's one request
            # (`parse_predict` holds such requests to exactly one batch of rows).
            part = {n: o if n in whole else o[offset:offset + stop - start]
                    for n, o in outputs.items()}
            offset += stop - start
            _deliver(pending, start, stop - start, part)


def unbatched_inputs(runtime: ServingRuntime) -> list[str]:
    """The inputs without the batch dimension (a `preprocessing_step_signature` scalar).

    Requests are batched by rows, and such an input has none: an export that
    has one runs in the runtime, not in the server.

    Example:

    >>> unbatched_inputs(load("scaled"))   # signature [(None, 3), ()]
    ['input_1']
    """
    return [e["name"] for e in runtime.inputs
            if not e["shape"] or e["shape"][0] != runtime.batch_size]


def outputs_json_cannot_hold(runtime: ServingRuntime) -> list[str]:
    """The outputs whose values JSON has no numbers for (complex ones), with their dtypes.

    Example:

    >>> outputs_json_cannot_hold(load("spectrum"))   # a postprocessing step's FFT
    ['output_0 (complex64)']
    """
    return [f"{e['name']} ({e['dtype']})" for e in runtime.outputs
            if np.dtype(e["dtype"]).kind == "c"]


def unbatched_outputs(runtime: ServingRuntime) -> list[str]:
    """The outputs without the batch dimension (e.g. a postprocessing step's sum over the batch).

    Such an output cannot be split into requests' rows: a request to an
    export that has one must hold exactly one batch of rows, and gets the
    whole value.

    Example:

    >>> unbatched_outputs(load("summed"))   # postprocessing_step=lambda o: jnp.sum(o)
    ['output_0']
    """
    return [e["name"] for e in runtime.outputs
            if not e["shape"] or e["shape"][0] != runtime.batch_size]


def _fail(pieces, error: Exception) -> None:
    for pending, _, _ in pieces:
        if not pending.future.done():
            pending.future.set_exception(error)


def _live(carry: list[tuple[_Pending, int]]) -> list[tuple[_Pending, int]]:
    # A request that failed or was cancelled (its client went) runs no more batches.
    return [(pending, start) for pending, start in carry if not pending.future.done()]


def _rows_waiting(carry: list[tuple[_Pending, int]]) -> int:
    return sum(p.count - start for p, start in carry)


def _take(carry, batch: int):
    """`(pieces of at most batch rows, what is left)`; a piece is `(request, start, stop)`."""
    pieces, left, room = [], [], batch
    for pending, start in carry:
        if room == 0:
            left.append((pending, start))
            continue
        stop = min(pending.count, start + room)
        pieces.append((pending, start, stop))
        room -= stop - start
        if stop < pending.count:
            left.append((pending, stop))
    return pieces, left


def _deliver(pending: _Pending, start: int, rows: int, part: dict[str, np.ndarray]) -> None:
    """Adds a piece's outputs to its request; resolves it when its rows are all done."""
    pending.done[start] = (rows, part)
    pending.delivered += rows
    if pending.delivered == pending.count:
        ordered = [pending.done[k][1] for k in sorted(pending.done)]
        result = ordered[0] if len(ordered) == 1 else {
            n: np.concatenate([p[n] for p in ordered]) for n in ordered[0]}
        if not pending.future.done():
            pending.future.set_result(result)


# --------------------------------------------------------------------------
# TensorFlow Serving's REST API.


def parse_predict(body: bytes, runtime: ServingRuntime) -> tuple[dict[str, np.ndarray], bool]:
    """`(rows by input name, row format?)` from a predict request's body.

    Raises:
        RequestError: Malformed JSON, missing keys, wrong shapes or dtypes.
    """
    request = _json_body(body)
    if not isinstance(request, dict) or ("instances" in request) == ("inputs" in request):
        raise RequestError("Missing 'inputs' or 'instances' keys (exactly one of them).")
    signature = request.get("signature_name", SIGNATURE_NAME)
    if signature not in ("", SIGNATURE_NAME):
        raise RequestError(f'Serving signature name: "{signature}" not found in signature def '
                           f"(an export has one: {SIGNATURE_NAME!r}).")
    if "instances" in request:
        return _arrays(_instance_columns(request["instances"], runtime), runtime), True
    names = runtime.input_names
    inputs = request["inputs"]
    columns = _by_name(inputs, runtime) if isinstance(inputs, dict) else {names[0]: inputs}
    if len(names) > 1 and not isinstance(inputs, dict):
        raise RequestError(f"'inputs' must be an object with the inputs {names}.")
    _check_names(columns, runtime, "Inputs")
    return _arrays(columns, runtime), False


def _by_name(given: dict[str, Any], runtime: ServingRuntime) -> dict[str, Any]:
    """Inputs by name, as the runtime takes them (a dict-input model's by its keys too)."""
    try:
        return runtime.by_name(given)
    except TypeError as error:
        raise RequestError(str(error)) from None


def _json_body(body: bytes) -> Any:
    """The request's JSON value.

    Raises:
        RequestError: For whatever `json.loads` refuses: malformed text and
            bad UTF-8, but also an integer of more digits than Python converts
            (a `ValueError`) and nesting deeper than the interpreter's stack
            (a `RecursionError`); both are the client's error, not the server's.
    """
    try:
        return json.loads(body)
    except RecursionError:
        raise RequestError("JSON Parse error: the JSON is nested too deeply to parse.") from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors too
        # Python's advice for an over-long integer (sys.set_int_max_str_digits) is the
        # server's business, not the client's.
        reason = str(error).partition("; use sys.set_int_max_str_digits")[0]
        raise RequestError(f"JSON Parse error: {reason}") from None


def _instance_columns(instances: Any, runtime: ServingRuntime) -> dict[str, list]:
    """The row format's `instances` as columns by input name.

    Instances are objects by input name, or, for an export of one input,
    that input's rows themselves.

    Raises:
        RequestError: An empty or malformed list, or an instance whose names
            are not the signature's (each is checked, as the columnar format's
            object is: an extra name is refused, not ignored).
    """
    names = runtime.input_names
    if not isinstance(instances, list) or not instances:
        raise RequestError("'instances' must be a non-empty list.")
    objects = [isinstance(i, dict) for i in instances]
    if len(names) == 1 and not all(objects):
        return {names[0]: instances}
    if not all(objects):
        raise RequestError(f"Each instance must be an object with the inputs {names}.")
    instances = [_by_name(instance, runtime) for instance in instances]
    for index, instance in enumerate(instances):
        _check_names(instance, runtime, f"Instance {index}'s inputs")
    return {n: [i[n] for i in instances] for n in names}


def _check_names(columns: dict[str, Any], runtime: ServingRuntime, subject: str) -> None:
    """Raises a `RequestError` naming the unknown and missing (or null) inputs of `columns`."""
    unknown = sorted(set(columns) - set(runtime.input_names))
    missing = [n for n in runtime.input_names if n not in columns or columns[n] is None]
    if unknown or missing:
        raise RequestError(f"{subject} do not match the signature {runtime.signature()}: "
                           f"unknown {unknown}, missing {missing}.")


def _arrays(columns: dict[str, Any], runtime: ServingRuntime) -> dict[str, np.ndarray]:
    """The inputs as arrays of the signature's dtypes, checked: `columns` has its names."""
    arrays, count = {}, None
    for entry in runtime.inputs:
        name = entry["name"]
        if isinstance(columns[name], list) and not columns[name]:  # before it reads as float
            raise RequestError(f"Input {name!r} has no rows: a request needs at least one.")
        array = _cast(name, columns[name], np.dtype(entry["dtype"]), tuple(entry["shape"][1:]))
        if array.ndim and not len(array):  # as `instances` must be a non-empty list
            raise RequestError(f"Input {name!r} has no rows: a request needs at least one.")
        _check_rows(name, array, tuple(entry["shape"][1:]), runtime)
        if count is not None and len(array) != count:
            raise RequestError("Inputs have different numbers of rows.")
        count = len(array)
        arrays[name] = array
    whole = unbatched_outputs(runtime)
    if whole and count != runtime.batch_size:
        raise RequestError(
            f"The export's outputs {whole} have no batch dimension (e.g. a sum over the "
            f"batch): a request must hold exactly {runtime.batch_size} rows, the export's "
            f"batch size, to get them; it holds {count}.")
    return arrays


def _check_rows(name: str, array: np.ndarray, row_shape: tuple, runtime: ServingRuntime) -> None:
    """Raises a `RequestError` unless `array` is a list of rows of `row_shape`."""
    if array.ndim == len(row_shape):  # e.g. `{"inputs": 3.0}` for rows of shape (): no list
        given = "a single value" if array.ndim == 0 else f"an array of shape {array.shape}"
        raise RequestError(
            f"Input {name!r} is {given}, not a list of rows: it needs a list of rows of shape "
            f"{row_shape}, one row as [row] ({runtime.signature()}).")
    if array.ndim != len(row_shape) + 1 or array.shape[1:] != row_shape:
        raise RequestError(
            f"Input {name!r} has rows of shape {array.shape[1:]}, expected {row_shape} "
            f"({runtime.signature()}).")


def _cast(name: str, values: Any, dtype: np.dtype, row_shape: tuple) -> np.ndarray:
    """A JSON input as an array of `dtype`, cast by the runtime's rule (`runtime.cast_input`).

    Raises:
        RequestError: When the values are not `dtype` data, or rows of one shape.
    """
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:
        if "inhomogeneous" in str(error):  # NumPy's word for nested lists of unequal lengths
            raise RequestError(f"Input {name!r} has rows (or values in them) of different "
                               f"lengths: each row needs shape {row_shape}.") from None
        raise RequestError(f"Input {name!r} is not {dtype} data: {error}") from None
    try:
        return cast_input(name, array, dtype)
    except (TypeError, ValueError) as error:
        raise RequestError(str(error)) from None


def predict_response(outputs: dict[str, np.ndarray], rows: bool) -> str:
    """TensorFlow Serving's predict response, as JSON text.

    `{"predictions": ...}` (row format: one entry per row, an object per row
    when there are several outputs; an object of whole outputs when some
    have no batch dimension) or `{"outputs": ...}` (columnar).
    """
    if rows:
        if len(outputs) == 1:
            return '{"predictions": ' + json_array(next(iter(outputs.values()))) + "}"
        counts = {len(o) if np.ndim(o) else None for o in outputs.values()}
        if len(counts) != 1 or None in counts:  # not all rows: no per-row objects
            return '{"predictions": {' + ", ".join(f"{json.dumps(n)}: {json_array(o)}"
                                                    for n, o in outputs.items()) + "}}"
        count = counts.pop()
        per_row = ["{" + ", ".join(f"{json.dumps(n)}: {json_array(o[i])}"
                                   for n, o in outputs.items()) + "}" for i in range(count)]
        return '{"predictions": [' + ", ".join(per_row) + "]}"
    if len(outputs) == 1:
        return '{"outputs": ' + json_array(next(iter(outputs.values()))) + "}"
    return '{"outputs": {' + ", ".join(f"{json.dumps(n)}: {json_array(o)}"
                                        for n, o in outputs.items()) + "}}"


# Significant digits that give a float of each width back exactly, the decimal
# point kept (`2.00000000`: clients read a float, as TensorFlow Serving's `2.0`):
# shorter than a double's repr and formatted in C, a third of the time of
# `json.dumps(array.tolist())` for a row of 64 float32 values.
_ROUND_TRIP_FORMATS = {np.dtype("float32"): "%#.9g", np.dtype("float16"): "%#.5g"}


def json_array(array: np.ndarray) -> str:
    """An array as JSON text, nested as `array.tolist()` is.

    float32 and float16 values are written with the significant digits that
    read back to the same value (9 and 5), with a decimal point; other
    dtypes, and arrays holding NaN or infinities, as
    `json.dumps(array.tolist())` writes them.

    Example:

    >>> json_array(np.array([[0.1, 2.0]], "float32"))
    '[[0.100000001,2.00000000]]'
    """
    fmt = _ROUND_TRIP_FORMATS.get(array.dtype)
    if fmt is None or not np.isfinite(array).all():
        return json.dumps(array.tolist())
    text = _nested_template(array.shape, fmt) % tuple(array.ravel().tolist())
    # A value whose significant digits all precede the point (123456792.) keeps a bare
    # point, which JSON refuses: it gets a zero.
    text = text.replace(".,", ".0,").replace(".]", ".0]")
    return text + "0" if text.endswith(".") else text


@functools.lru_cache(maxsize=64)
def _nested_template(shape: tuple[int, ...], fmt: str) -> str:
    """`%`-template of a JSON array of `shape`, each value written with `fmt`."""
    template = fmt
    for size in reversed(shape):
        template = "[" + ",".join([template] * size) + "]"
    return template


# The export's one signature, as TensorFlow Serving names a SavedModel's default.
SIGNATURE_NAME = "serving_default"
# The one version a server of one export has.
VERSION = "1"


def status_response() -> dict:
    return {"model_version_status": [{"version": VERSION, "state": "AVAILABLE",
                                      "status": {"error_code": "OK", "error_message": ""}}]}


def metadata_response(name: str, runtime: ServingRuntime) -> dict:
    whole = set(unbatched_outputs(runtime))

    def dims(entry):  # the batch dimension is any size (-1); an unbatched output has none
        if entry["name"] in whole:
            return [{"size": str(d)} for d in entry["shape"]]
        return [{"size": "-1"}] + [{"size": str(d)} for d in entry["shape"][1:]]

    def tensors(entries):
        return {e["name"]: {"dtype": _TF_DTYPES.get(e["dtype"], e["dtype"]), "name": e["name"],
                            "tensor_shape": {"dim": dims(e), "unknown_rank": False}}
                for e in entries}

    signature = {"inputs": tensors(runtime.inputs), "outputs": tensors(runtime.outputs),
                 "method_name": "tensorflow/serving/predict"}
    return {"model_spec": {"name": name, "signature_name": "", "version": VERSION},
            "metadata": {"signature_def": {"signature_def": {SIGNATURE_NAME: signature}}}}


def make_app(runtime: ServingRuntime, model_name: str, max_batch_delay_ms: float = 2.0):
    """The aiohttp application serving `runtime` as `model_name`.

    Raises:
        ImportError: Without aiohttp (`pip install keras_ipu[serve]`).

    Example:

    >>> app = make_app(keras_ipu.serving.load("my_export"), "my_model")
    """
    web = _aiohttp_web()
    batcher = DynamicBatcher(runtime, max_batch_delay_ms)

    def error(message: str, status: int):
        return web.json_response({"error": message}, status=status)

    def known(request) -> bool:
        version = request.match_info.get("version", VERSION)
        return request.match_info["name"] == model_name and version == VERSION

    def unknown(request):
        name, version = request.match_info["name"], request.match_info.get("version")
        wanted = f"Specific({name}, {version})" if version is not None else f"Latest({name})"
        return error(f"Servable not found for request: {wanted}", 404)

    async def status(request):
        return web.json_response(status_response()) if known(request) else unknown(request)

    async def metadata(request):
        if not known(request):
            return unknown(request)
        return web.json_response(metadata_response(model_name, runtime))

    async def predict(request):
        if not known(request):
            return unknown(request)
        try:
            body = await request.read()
            rows, row_format = parse_predict(body, runtime)
        except RequestError as bad:
            return error(str(bad), bad.status)
        except web.HTTPRequestEntityTooLarge:
            return error(f"Request body larger than {MAX_BODY_BYTES} bytes.", 413)
        try:
            outputs = await batcher.predict(rows)
        except Exception as failed:  # a device failure answers this request only
            return error(f"Prediction failed: {failed}", 500)
        return web.Response(text=predict_response(outputs, row_format),
                            content_type="application/json")

    async def on_startup(app):
        batcher.start()

    async def on_cleanup(app):
        await batcher.stop()

    @web.middleware
    async def json_errors(request, handler):
        # A path or method no route takes gets its error as JSON too, as every other.
        try:
            return await handler(request)
        except web.HTTPException as failed:
            if failed.status < 400:
                raise
            answer = error(f"Malformed request: {request.method} {request.path} "
                           f"({failed.reason})", failed.status)
            if "Allow" in failed.headers:  # a 405 says which methods the path takes
                answer.headers["Allow"] = failed.headers["Allow"]
            return answer

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_errors])
    app["batcher"] = batcher
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    # TensorFlow Serving's paths, for the latest version and for a given one.
    for model in ("/v1/models/{name:[^/:]+}", "/v1/models/{name:[^/:]+}/versions/{version:\\d+}"):
        app.router.add_get(model, status)
        app.router.add_get(model + "/metadata", metadata)
        app.router.add_post(model + ":predict", predict)
    return app


async def serve(runtime: ServingRuntime, model_name: str, host: str, port: int,
                max_batch_delay_ms: float, announce=print) -> None:
    """Serves until cancelled (Ctrl-C); announces the address it listens on.

    Raises:
        ValueError: For an export with an input that has no batch dimension, or an
            output JSON cannot hold.
    """
    unbatched, complex_outputs = unbatched_inputs(runtime), outputs_json_cannot_hold(runtime)
    if unbatched or complex_outputs:
        what = (f"inputs {unbatched} have no batch dimension: the server batches requests by "
                f"rows" if unbatched else
                f"outputs {complex_outputs} are complex, which JSON has no numbers for")
        raise ValueError(
            f"The export's {what}, so it cannot serve this export. Run it with the serving "
            f"runtime (keras_ipu.serving.load) or `keras-ipu run`.")
    web = _aiohttp_web()
    warm_up(runtime)
    # No access log: formatting a line per request costs more than a small model's call.
    runner = web.AppRunner(make_app(runtime, model_name, max_batch_delay_ms),
                           handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    if ":" in bound_host:  # an IPv6 address, bracketed in a URL
        bound_host = f"[{bound_host}]"
    # Quoted: the announced address works as printed (a space in the name: %20).
    announce(f"keras-ipu serve: model {model_name!r} at "
             f"http://{bound_host}:{bound_port}/v1/models/{urllib.parse.quote(model_name)}")
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def warm_up(runtime: ServingRuntime) -> None:
    """Runs one batch of zeros, so that the first request does not wait for XLA to compile.

    (TensorFlow Serving's model warm-up does the same with recorded requests.)
    """
    # In signature order: by name, names that are also the model's dict keys (swapped
    # ones) would bind by key, as a request's do, and misshapen zeros were refused.
    runtime(*[np.zeros(e["shape"], e["dtype"]) for e in runtime.inputs])


def _aiohttp_web():
    try:
        from aiohttp import web
    except ImportError as error:
        raise ImportError(
            "keras-ipu serve needs aiohttp: `pip install keras_ipu[serve]` "
            "(or `pip install aiohttp`)."
        ) from error
    return web


__all__ = ["DynamicBatcher", "make_app", "serve", "unbatched_inputs", "unbatched_outputs"]
