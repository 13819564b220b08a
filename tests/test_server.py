"""`keras-ipu serve`: TensorFlow Serving's REST API on loopback, with a real HTTP client."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys

import aiohttp
import jax
import keras
import numpy as np
import pytest

import keras_ipu as ipu

from conftest import configure, fresh_process_env

CLIENTS, REQUESTS = 32, 100


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An export of a two-input model, its expected predictions, and a server process."""
    configure(1)
    directory = tmp_path_factory.mktemp("serve") / "adder"
    keras.utils.set_random_seed(0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
        h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([a, b]))
        model = keras.Model([a, b], keras.layers.Dense(3)(h))
    model.export_for_ipu_serving(directory, batch_size=8)
    url, process = _start_server(directory)
    yield model, url, process
    _stop(process)


def _start_server(directory):
    """`(the model's URL, the process)` of `keras-ipu serve` on a free port."""
    process = subprocess.Popen(
        [sys.executable, "-m", "keras_ipu", "serve", "--dir", str(directory), "--port", "0"],
        env=fresh_process_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
    assert match, line + process.stderr.read()
    return f"http://127.0.0.1:{match.group(1)}/v1/models/{directory.name}", process


def _stop(process):
    if process.poll() is None:
        process.kill()
        process.wait()


def _rows(rng, count):
    return (rng.normal(size=(count, 4)).astype("float32"),
            rng.normal(size=(count, 2)).astype("float32"))


def test_status_and_metadata(served):
    _, url, _ = served

    async def get():
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as status, session.get(url + "/metadata") as meta:
                return await status.json(), await meta.json()

    status, meta = asyncio.run(get())
    assert status["model_version_status"][0]["state"] == "AVAILABLE"
    signature = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature["inputs"]["a"]["tensor_shape"]["dim"] == [{"size": "-1"}, {"size": "4"}]
    assert signature["inputs"]["b"]["dtype"] == "DT_FLOAT"


def test_concurrent_clients_get_their_own_rows(served):
    model, url, _ = served
    rng = np.random.default_rng(0)
    requests = [[_rows(rng, int(rng.integers(1, 4))) for _ in range(REQUESTS)]
                for _ in range(CLIENTS)]
    flat_a = np.concatenate([a for client in requests for a, _ in client])
    flat_b = np.concatenate([b for client in requests for _, b in client])
    padded = -len(flat_a) % 8
    expected_all = model.predict(
        [np.concatenate([flat_a, np.zeros((padded, 4), "float32")]),
         np.concatenate([flat_b, np.zeros((padded, 2), "float32")])],
        batch_size=8, verbose=0)[:len(flat_a)]

    async def client(session, index):
        answers = []
        for n, (a, b) in enumerate(requests[index]):
            if n % 2:  # row format
                body = {"instances": [{"a": ra.tolist(), "b": rb.tolist()}
                                      for ra, rb in zip(a, b)]}
            else:      # columnar format
                body = {"inputs": {"a": a.tolist(), "b": b.tolist()}}
            async with session.post(url + ":predict", json=body) as response:
                assert response.status == 200, await response.text()
                reply = await response.json()
            answers.append(np.asarray(reply["predictions" if n % 2 else "outputs"], "float32"))
        return answers

    async def everyone():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(client(session, i) for i in range(CLIENTS)))

    answers = asyncio.run(everyone())
    got = np.concatenate([row for client in answers for row in client])
    assert got.shape == expected_all.shape  # none lost
    np.testing.assert_allclose(got, expected_all, atol=1e-5)  # none mixed up


@pytest.mark.parametrize("body, status, message", [
    (b'{"instances": [1, 2', 400, "JSON Parse error"),
    (b'{"instances": [{"a": [1, 2, 3], "b": [1, 2]}]}', 400, "rows of shape (3,)"),
    (b'{"inputs": {"a": [["x", "y", "z", "w"]], "b": [[1, 2]]}}', 400, "is not float32 data"),
    (b'{"signature": 1}', 400, "Missing 'inputs' or 'instances'"),
    (b'{"signature_name": "other", "inputs": {"a": [[1, 2, 3, 4]], "b": [[1, 2]]}}', 400,
     'Serving signature name: "other" not found'),
    (b'{"inputs": {"a": [[1, 2, 3, 4]]}}', 400, "missing ['b']"),
    (b"[" * 20_000_000, 413, "larger than"),
    # Before, these two were 500s with a plain-text body (json.loads' ValueError and
    # RecursionError were not caught).
    (b'{"inputs": {"a": [[' + b"9" * 5000 + b', 1, 2, 3]], "b": [[1, 2]]}}', 400,
     "JSON Parse error: Exceeds the limit (4300 digits) for integer string conversion"),
    (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "JSON Parse error: the JSON is nested too deeply"),
    # Before, the row format ignored an extra name (200) and misread a misspelt one.
    (b'{"instances": [{"a": [1, 2, 3, 4], "b": [1, 2], "typo": 5}]}', 400,
     "Instance 0's inputs do not match the signature inputs (a: float32[8, 4], "
     "b: float32[8, 2]) -> outputs (output_0: float32[8, 3]): unknown ['typo'], missing []."),
    (b'{"instances": [{"a": [1, 2, 3, 4], "b": [1, 2]}, {"A": [1, 2, 3, 4], "b": [1, 2]}]}',
     400, "Instance 1's inputs do not match the signature inputs (a: float32[8, 4], "
     "b: float32[8, 2]) -> outputs (output_0: float32[8, 3]): unknown ['A'], missing ['a']."),
    # Before: "is an array of shape (0,), not a list of rows" (and, for rows of shape (),
    # 200 with no outputs, after a device call).
    (b'{"inputs": {"a": [], "b": []}}', 400, "Input 'a' has no rows"),
    # Before: "is not float32 data: setting an array element with a sequence ...".
    (b'{"inputs": {"a": [[1, 2, 3, 4], [1, 2, 3]], "b": [[1, 2], [1, 2]]}}', 400,
     "Input 'a' has rows (or values in them) of different lengths: each row needs shape (4,)"),
])
def test_bad_requests_get_4xx_and_the_server_goes_on(served, body, status, message):
    model, url, _ = served

    async def post():
        async with aiohttp.ClientSession() as session:
            async with session.post(url + ":predict", data=body) as response:
                answer = (response.status, await response.json())
            ok = {"inputs": {"a": [[0.0] * 4], "b": [[0.0] * 2]}}
            async with session.post(url + ":predict", json=ok) as response:
                return answer, response.status, await response.json()

    (code, reply), after, good = asyncio.run(post())
    assert code == status and message in reply["error"]
    assert after == 200
    np.testing.assert_allclose(
        good["outputs"],
        model.predict([np.zeros((8, 4)), np.zeros((8, 2))], batch_size=8, verbose=0)[:1],
        atol=1e-5)


def test_an_unknown_model_is_404(served):
    _, url, _ = served

    async def post():
        async with aiohttp.ClientSession() as session:
            async with session.post(url.replace("adder", "other") + ":predict",
                                    json={"instances": [[1]]}) as response:
                return response.status, await response.json()

    code, reply = asyncio.run(post())
    assert code == 404 and "Servable not found" in reply["error"]


def test_the_version_paths_serve_version_1_only(served):
    model, url, _ = served
    body = {"signature_name": "serving_default", "inputs": {"a": [[1.0] * 4], "b": [[1.0] * 2]}}

    async def calls():
        async with aiohttp.ClientSession() as session:
            answers = []
            for method, path, payload in (("get", "/versions/1", None),
                                          ("get", "/versions/1/metadata", None),
                                          ("post", "/versions/1:predict", body),
                                          ("post", "/versions/2:predict", body)):
                async with session.request(method, url + path, json=payload) as response:
                    answers.append((response.status, await response.json()))
            return answers

    status, metadata, predicted, missing = asyncio.run(calls())
    assert status[0] == metadata[0] == predicted[0] == 200
    assert status[1]["model_version_status"][0]["version"] == "1"
    assert "serving_default" in metadata[1]["metadata"]["signature_def"]["signature_def"]
    np.testing.assert_allclose(
        predicted[1]["outputs"],
        model.predict([np.ones((8, 4)), np.ones((8, 2))], batch_size=8, verbose=0)[:1],
        atol=1e-5)
    assert missing == (404, {"error": "Servable not found for request: Specific(adder, 2)"})


def test_paths_and_methods_no_route_takes_get_json_errors(served):
    # Before: text/plain "404: Not Found" and "405: Method Not Allowed".
    _, url, _ = served

    async def calls():
        async with aiohttp.ClientSession() as session:
            answers = []
            for method, path in (("post", url + ":classify"), ("get", url + ":predict"),
                                 ("get", url.split("/v1/")[0] + "/v1/models")):
                async with session.request(method, path) as response:
                    answers.append((response.status, response.content_type,
                                    await response.json(), response.headers.get("Allow")))
            return answers

    classify, get_predict, models = asyncio.run(calls())
    assert classify[:2] == (404, "application/json")
    assert classify[2]["error"].startswith("Malformed request: POST /v1/models/adder:classify")
    assert get_predict[:2] == (405, "application/json") and "GET" in get_predict[2]["error"]
    assert get_predict[3] == "POST"  # HTTP's 405 names the methods the path takes
    assert models[0] == 404 and "error" in models[2]


def test_the_metadata_names_unsigned_and_complex_types_as_tensorflow_does():
    from keras_ipu.serving.server import metadata_response

    class Runtime:
        inputs = [{"name": f"in_{t}", "shape": [2], "dtype": t}
                  for t in ("uint16", "uint32", "uint64", "complex64")]
        outputs = [{"name": "out", "shape": [2], "dtype": "complex128"}]
        batch_size = 2

    signature = metadata_response("m", Runtime())["metadata"]["signature_def"][
        "signature_def"]["serving_default"]
    assert [e["dtype"] for e in signature["inputs"].values()] == [
        "DT_UINT16", "DT_UINT32", "DT_UINT64", "DT_COMPLEX64"]
    assert signature["outputs"]["out"]["dtype"] == "DT_COMPLEX128"


def test_ctrl_c_while_the_export_loads_stops_serve_before_it_serves(monkeypatch, capsys):
    # Before: loading ran under Python's own handler, and a Ctrl-C landing in JAX's
    # garbage-collection callback was dropped ("Exception ignored"): the server then served.
    from keras_ipu.serving import commands, server

    loaded, served_with = [], []

    def load_interrupted(export_dir):
        signal.raise_signal(signal.SIGINT)  # held back until the load has ended
        loaded.append(export_dir)
        return object()

    monkeypatch.setattr(commands, "_load", load_interrupted)
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: served_with.append(args))
    assert commands.serve_main(["--dir", "adder", "--port", "0"]) == 0
    assert loaded == ["adder"] and served_with == []
    assert "keras-ipu serve: stopped" in capsys.readouterr().out


def test_a_second_ctrl_c_while_the_export_loads_stops_serve_at_once(monkeypatch, capsys):
    from keras_ipu.serving import commands, server

    loaded, served_with = [], []

    def load_interrupted_twice(export_dir):
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # raises here: the load goes no further
        loaded.append(export_dir)

    monkeypatch.setattr(commands, "_load", load_interrupted_twice)
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: served_with.append(args))
    assert commands.serve_main(["--dir", "adder", "--port", "0"]) == 0
    assert loaded == [] and served_with == []
    assert "keras-ipu serve: stopped" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_stops_the_server_cleanly(served):
    _, _, process = served
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=20) == 0
    assert "stopped" in process.stdout.read()


@pytest.mark.parametrize("array", [
    np.random.default_rng(1).normal(size=(3, 64)).astype("float32"),
    np.array([[-0.0, 3.4e38, 1.4e-45, 2.0, -7.0]], "float32"),
    np.random.default_rng(2).normal(size=(2, 3, 4)).astype("float16"),
    np.random.default_rng(3).normal(size=(2, 5)),  # float64: json.dumps
    np.array([[1.0, np.nan, np.inf]], "float32"),   # not finite: json.dumps
    np.arange(6, dtype="int32").reshape(2, 3),
    np.array([[True, False]]),
    # All significant digits before the point: "123456792." is no JSON number.
    np.array([[123456792.0, 1.5], [1e8, 999999936.0]], "float32"),
    np.array([12344.0, 65504.0], "float16"),
    # 0-d (an output summed over the batch): it had a double's 17 digits.
    np.array(2.8977053, "float32"), np.array(123456792.0, "float32"),
], ids=["float32", "float32-extremes", "float16", "float64", "non-finite", "int32", "bool",
        "float32-integral", "float16-integral", "float32-0d", "float32-0d-integral"])
def test_json_array_reads_back_exactly(array):
    from keras_ipu.serving.server import json_array

    text = json_array(array)
    if array.shape == () and array.dtype == np.float32:
        assert text in ("2.89770532", "123456792.0")  # 9 digits, a point
    values = json.loads(text)
    np.testing.assert_array_equal(np.asarray(values, array.dtype), array)
    if array.dtype.kind == "f":  # clients read floats, never ints
        assert all(isinstance(v, float) for v in np.ravel(np.asarray(values, object)))


def test_predict_response_in_both_formats():
    from keras_ipu.serving.server import predict_response

    outputs = {"p": np.array([[0.5, 1.0], [2.0, -3.25]], "float32"),
               "k": np.array([7, 8], "int32")}
    assert json.loads(predict_response(outputs, rows=True)) == {
        "predictions": [{"p": [0.5, 1.0], "k": 7}, {"p": [2.0, -3.25], "k": 8}]}
    assert json.loads(predict_response(outputs, rows=False)) == {
        "outputs": {"p": [[0.5, 1.0], [2.0, -3.25]], "k": [7, 8]}}
    assert json.loads(predict_response({"p": outputs["p"]}, rows=True)) == {
        "predictions": [[0.5, 1.0], [2.0, -3.25]]}


def test_warm_up_feeds_a_model_whose_dict_keys_are_its_other_inputs_names(tmp_path):
    # Inputs named "b" under key "a" and "a" under "b": zeros given by name bound by key
    # (the dict rule), the shapes did not fit, and `keras-ipu serve` exited before listening.
    from keras_ipu.serving import load
    from keras_ipu.serving.server import warm_up

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = {"a": keras.Input((3,), name="b"), "b": keras.Input((2,), name="a")}
        model = keras.Model(inputs, keras.layers.Concatenate()([inputs["a"], inputs["b"]]))
    model.export_for_ipu_serving(tmp_path / "export", batch_size=2)
    runtime = load(str(tmp_path / "export"))
    warm_up(runtime)
    x = {"a": np.ones((2, 3), "float32"), "b": np.full((2, 2), 2.0, "float32")}
    np.testing.assert_allclose(runtime(**x), model.predict(x, batch_size=2, verbose=0))


def test_warm_up_compiles_before_the_first_request(tmp_path):
    """The server runs a batch of zeros before it listens: the first request compiles nothing."""
    import jax

    from keras_ipu.serving import load
    from keras_ipu.serving.server import warm_up

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.export_for_ipu_serving(tmp_path / "export", batch_size=4)
    runtime = load(str(tmp_path / "export"))
    compiles = []

    def listener(name, *_args, **_kwargs):
        if "backend_compile" in name:
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        warm_up(runtime)
        warmed = len(compiles)
        x = np.ones((4, 3), "float32")
        got = runtime(x)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    np.testing.assert_allclose(got, model.predict(x, batch_size=4, verbose=0), atol=1e-6)
    assert warmed >= 1 and len(compiles) == warmed


def test_an_output_without_the_batch_dimension_is_served_whole(tmp_path):
    """As the reference's example, a postprocessing step sums over the batch: a request of one
    batch of rows gets the sum; any other request is refused with 400, and the server goes on.

    (Before, slicing the sum into rows killed the batcher: every request hung.)
    """
    import jax.numpy as jnp

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        inputs = keras.Input((3,), name="x")
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.export_for_ipu_serving(tmp_path / "summed", batch_size=2,
                                 postprocessing_step=lambda o: (o, jnp.sum(o)))
    x = np.random.default_rng(5).normal(size=(2, 3)).astype("float32")
    expected = model.predict(x, batch_size=2, verbose=0)
    url, process = _start_server(tmp_path / "summed")

    async def calls():
        answers = []
        async with aiohttp.ClientSession() as session:
            for body in ({"inputs": {"x": x.tolist()}}, {"instances": x.tolist()},
                         {"instances": x[:1].tolist()}, {"inputs": {"x": x.tolist()}}):
                async with session.post(url + ":predict", json=body) as response:
                    answers.append((response.status, await response.json()))
            async with session.get(url + "/metadata") as response:
                answers.append((response.status, await response.json()))
        return answers

    try:
        columns, rows, one_row, again, metadata = asyncio.run(asyncio.wait_for(calls(), 60))
    finally:
        _stop(process)
    for status, reply in (columns, again):
        assert status == 200, reply
        np.testing.assert_allclose(reply["outputs"]["output_0"], expected, atol=1e-5)
        np.testing.assert_allclose(reply["outputs"]["output_1"], expected.sum(), atol=1e-5)
    assert rows[0] == 200
    np.testing.assert_allclose(rows[1]["predictions"]["output_0"], expected, atol=1e-5)
    np.testing.assert_allclose(rows[1]["predictions"]["output_1"], expected.sum(), atol=1e-5)
    assert one_row[0] == 400 and "must hold exactly 2 rows" in one_row[1]["error"]
    outputs = metadata[1]["metadata"]["signature_def"]["signature_def"]["serving_default"][
        "outputs"]
    assert outputs["output_1"]["tensor_shape"]["dim"] == []


def test_the_batcher_gives_a_dict_models_inputs_by_name_not_again_by_key(tmp_path):
    # Keys that are the other inputs' names: the batcher's call by name was read as the
    # model's dict keys, swapping the inputs (201 where predict gives 102).
    import warnings

    from keras_ipu.serving import load
    from keras_ipu.serving.server import DynamicBatcher, parse_predict

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        first, second = keras.Input((1,), name="b"), keras.Input((1,), name="a")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model = keras.Model({"a": first, "b": second}, 2 * first + second)
    model.export_for_ipu_serving(tmp_path / "e", batch_size=1)
    runtime = load(str(tmp_path / "e"))
    rows, _ = parse_predict(b'{"inputs": {"a": [[1.0]], "b": [[100.0]]}}', runtime)

    async def served():
        batcher = DynamicBatcher(runtime, max_batch_delay_ms=1)
        batcher.start()
        try:
            return await batcher.predict(rows)
        finally:
            await batcher.stop()

    expected = model.predict({"a": np.ones((1, 1)), "b": np.full((1, 1), 100.0)}, batch_size=1,
                             verbose=0)
    np.testing.assert_allclose(expected, [[102.0]])
    np.testing.assert_allclose(asyncio.run(served())["output_0"], expected)


def test_json_inputs_cast_by_the_runtimes_same_kind_rule(tmp_path):
    from keras_ipu.serving import load
    from keras_ipu.serving.server import RequestError, parse_predict

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        tokens = keras.Input((2,), dtype="int32", name="tokens")
        model = keras.Model(tokens, keras.layers.Embedding(10, 3)(tokens))
    model.export_for_ipu_serving(tmp_path / "e", batch_size=2)
    runtime = load(str(tmp_path / "e"))
    rows, _ = parse_predict(b'{"instances": [[1, 2], [3, 4]]}', runtime)
    assert rows["tokens"].dtype == np.int32
    np.testing.assert_array_equal(
        runtime(**rows),
        model.predict(np.array([[1, 2], [3, 4]], "int32"), batch_size=2, verbose=0))
    # Before, 1.9 became 1 and "7" became 7, silently.
    for body, message in ((b'{"instances": [[1.9, 2.7], [3, 4]]}', "values are float64"),
                          (b'{"inputs": [["7", "1"], [3, 4]]}', "values are text"),
                          (b'{"inputs": [[1, null], [3, 4]]}', "values are mixed or null"),
                          (b'{"inputs": [[1, 4294967296], [3, 4]]}', "are outside int32's")):
        with pytest.raises(RequestError, match=f"Input 'tokens' is not int32 data: .*{message}"):
            parse_predict(body, runtime)
    # Before, an empty list read as float64 data: "is not int32 data".
    with pytest.raises(RequestError, match="Input 'tokens' has no rows"):
        parse_predict(b'{"inputs": {"tokens": []}}', runtime)


@pytest.fixture(scope="module")
def pixels(tmp_path_factory):
    """The runtime of an export with a uint8 input `img` (rows of 2) and a scalar-row `gain`."""
    from keras_ipu.serving import load

    configure(1)
    directory = tmp_path_factory.mktemp("pixels") / "e"
    with ipu.ipu_strategy.IPUStrategy().scope():
        img, gain = keras.Input((2,), dtype="uint8", name="img"), keras.Input((), name="gain")
        scaled = keras.layers.Rescaling(1 / 255)(img) * keras.ops.expand_dims(gain, -1)
        model = keras.Model([img, gain], scaled)
    model.export_for_ipu_serving(directory, batch_size=2)
    return load(str(directory))


def test_json_integers_are_unsigned_data_when_in_range(pixels):
    from keras_ipu.serving.server import RequestError, parse_predict

    # Before, every JSON integer was refused for uint8: "int64, which does not cast to uint8".
    for body in (b'{"instances": [{"img": [0, 255], "gain": 1}, {"img": [3, 4], "gain": 2}]}',
                 b'{"inputs": {"img": [[0, 255], [3, 4]], "gain": [1, 2]}}'):
        rows, _ = parse_predict(body, pixels)
        assert rows["img"].dtype == np.uint8
        np.testing.assert_array_equal(rows["img"], [[0, 255], [3, 4]])
        np.testing.assert_allclose(pixels(**rows), [[0, 1], [6 / 255, 8 / 255]], atol=1e-6)
    for body, message in ((b'{"inputs": {"img": [[0, 256]], "gain": [1]}}', "0 to 256"),
                          (b'{"inputs": {"img": [[-1, 2]], "gain": [1]}}', "-1 to 2"),
                          (b'{"inputs": {"img": [[1.0, 2]], "gain": [1]}}', "values are float64")):
        with pytest.raises(RequestError, match=f"Input 'img' is not uint8 data: .*{message}"):
            parse_predict(body, pixels)


def test_a_single_value_is_refused_as_not_a_list_of_rows(pixels):
    from keras_ipu.serving.server import RequestError, parse_predict

    # Before: "Input 'gain' has rows of shape (), expected ()", which contradicts itself.
    for body, given, shape in ((b'{"inputs": {"img": [[1, 2]], "gain": 3.0}}', "a single value",
                                "()"),
                               (b'{"inputs": {"img": [1, 2], "gain": [3.0]}}',
                                "an array of shape (2,)", "(2,)")):
        name = "gain" if shape == "()" else "img"
        with pytest.raises(RequestError) as refused:
            parse_predict(body, pixels)
        assert str(refused.value).startswith(
            f"Input {name!r} is {given}, not a list of rows: it needs a list of rows of shape "
            f"{shape}, one row as [row] (inputs (img: uint8[2, 2], gain: float32[2])")


def test_an_export_with_an_input_without_the_batch_dimension_is_not_served(tmp_path):
    # Requests are batched by rows: before, every request for it failed (400 or 500).
    from keras_ipu.serving import server

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    runtime = model.export_for_ipu_serving(
        tmp_path / "e", batch_size=2, preprocessing_step=lambda x, scale: x * scale,
        preprocessing_step_signature=[keras.Input((3,)), jax.ShapeDtypeStruct((), "float32")])
    assert server.unbatched_inputs(runtime) == ["input_1"]
    with pytest.raises(ValueError, match=r"inputs \['input_1'\] have no batch dimension"):
        asyncio.run(server.serve(runtime, "e", "127.0.0.1", 0, 2.0))


def test_an_export_with_a_complex_output_is_not_served_and_runs_in_the_runtime(tmp_path):
    # Before: served, and every request got aiohttp's plain-text 500 (complex is no JSON).
    from keras_ipu.serving import server

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    runtime = model.export_for_ipu_serving(tmp_path / "e", batch_size=2,
                                           postprocessing_step=jax.numpy.fft.fft)
    assert server.outputs_json_cannot_hold(runtime) == ["output_0 (complex64)"]
    with pytest.raises(ValueError, match=r"outputs \['output_0 \(complex64\)'\] are complex, "
                                         r"which JSON has no numbers for"):
        asyncio.run(server.serve(runtime, "e", "127.0.0.1", 0, 2.0))
    x = np.arange(8, dtype="float32").reshape(2, 4)
    np.testing.assert_allclose(runtime(x), np.fft.fft(model.predict(x, batch_size=2, verbose=0)),
                               rtol=1e-5, atol=1e-5)


def test_an_ipv6_address_is_announced_in_brackets(pixels):
    import socket

    from keras_ipu.serving.server import serve

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    announced = []

    async def announce_then_stop():
        task = asyncio.ensure_future(serve(pixels, "m", "::1", 0, 2.0, announced.append))
        while not announced and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(announce_then_stop())
    # Before: "http://::1:PORT/...", which URL parsers read as host ":".
    assert re.fullmatch(r"keras-ipu serve: model 'm' at http://\[::1\]:\d+/v1/models/m",
                        announced[0])


def test_the_announced_address_works_as_printed_for_a_name_with_a_space(pixels):
    # Before: "http://127.0.0.1:PORT/v1/models/my model", which urllib refuses.
    import urllib.request

    from keras_ipu.serving.server import serve

    announced, answers = [], []

    async def announce_ask_stop():
        task = asyncio.ensure_future(serve(pixels, "my model", "127.0.0.1", 0, 2.0,
                                           announced.append))
        while not announced and not task.done():
            await asyncio.sleep(0.01)
        url = announced[0].split(" at ")[1]
        with await asyncio.get_running_loop().run_in_executor(
                None, urllib.request.urlopen, url) as reply:
            answers.append((reply.status, json.loads(reply.read())))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(announce_ask_stop())
    assert announced[0].endswith("/v1/models/my%20model")
    assert answers[0][0] == 200 and answers[0][1]["model_version_status"][0]["state"] == "AVAILABLE"


class _EchoRuntime:
    """A runtime of batch size 1 that returns its input: the batcher alone, no device."""

    batch_size = 1
    inputs = [{"name": "x", "shape": [1, 2], "dtype": "float32"}]
    outputs = [{"name": "y", "shape": [1, 2], "dtype": "float32"}]

    def __call__(self, x):
        return x

    def by_output_name(self, outputs):
        return {"y": outputs}


def test_the_batcher_answers_a_many_batch_request_whole_and_drops_a_cancelled_one():
    # A request was answered after summing the rows of all its delivered pieces at each
    # piece (quadratic: minutes for a request of 350,000 batches); a cancelled one ran on.
    from keras_ipu.serving.server import DynamicBatcher

    rows = np.arange(4000, dtype=np.float32).reshape(2000, 2)

    async def served():
        batcher = DynamicBatcher(_EchoRuntime(), max_batch_delay_ms=0)
        batcher.start()
        try:
            whole = await batcher.predict({"x": rows})
            calls = batcher.device_calls
            cancelled = asyncio.ensure_future(batcher.predict({"x": rows}))
            while batcher.device_calls < calls + 10:
                await asyncio.sleep(0)
            cancelled.cancel()
            after = await batcher.predict({"x": rows[:1]})
            return whole, calls, batcher.device_calls - calls, after
        finally:
            await batcher.stop()

    whole, calls, more, after = asyncio.run(served())
    np.testing.assert_array_equal(whole["y"], rows)
    assert calls == 2000 and more < 100  # the cancelled request's 1,990 batches never ran
    np.testing.assert_array_equal(after["y"], rows[:1])
