"""The `keras-ipu` command, through a subprocess: show, run, help and errors."""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_ipu.serving import expressions

from conftest import fresh_process_env


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "keras_ipu", *args], cwd=cwd,
                          env=fresh_process_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    import keras_ipu as ipu

    from conftest import configure

    configure(1)
    directory = tmp_path_factory.mktemp("cli") / "export"
    with ipu.ipu_strategy.IPUStrategy().scope():
        x, y = keras.Input((4,), batch_size=1, name="x"), keras.Input((4,), batch_size=1, name="y")
        model = keras.Model([x, y], keras.layers.Add()([x, y]))
        model.compile(steps_per_execution=4)
    model.export_for_ipu_serving(directory)
    return directory


def test_show_prints_the_signatures_and_metadata(export_dir):
    result = _cli("show", "--dir", str(export_dir))
    assert result.returncode == 0, result.stderr
    for text in ("batch size: 1", "iterations per device call (run_many): 4",
                 "x: dtype float32, shape (1, 4)", "output_0: dtype float32, shape (1, 4)",
                 "platforms: cpu", "stage -> IPU: [0]"):
        assert text in result.stdout


def test_run_prints_or_saves_the_outputs(export_dir, tmp_path):
    np.save(tmp_path / "x.npy", np.full((1, 4), 2, "float32"))
    result = _cli("run", "--dir", str(export_dir), "--inputs", f"x={tmp_path / 'x.npy'}",
                  "--input_exprs", "y=np.ones((1, 4), dtype=np.float32) * 3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "output_0: [[5. 5. 5. 5.]]"
    out = tmp_path / "out"
    args = ("run", "--dir", str(export_dir), "--input_exprs",
            "x=np.zeros((1, 4)); y=np.arange(4.0).reshape((1, 4))")
    refused = _cli(*args)
    assert refused.returncode == 2 and "np.arange(4.0).reshape" in refused.stderr
    args = ("run", "--dir", str(export_dir), "--input_exprs",
            "x=np.zeros((1, 4)); y=np.array([[0, 1, 2, 3]])", "--outdir", str(out))
    assert _cli(*args).returncode == 0
    np.testing.assert_array_equal(np.load(out / "output_0.npy"), [[0, 1, 2, 3]])
    again = _cli(*args)
    assert again.returncode == 2 and "--overwrite" in again.stderr
    assert _cli(*args, "--overwrite").returncode == 0


def test_run_saves_bfloat16_outputs_as_exact_float32(tmp_path):
    """A .npy header cannot name bfloat16: before, the values were saved as raw bytes that
    loaded back as dtype |V2."""
    import ml_dtypes

    import keras_ipu as ipu

    from conftest import configure

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        x = keras.Input((3,), batch_size=1, name="x")
        model = keras.Model(x, keras.layers.Dense(2, dtype="bfloat16")(x))
    model.export_for_ipu_serving(tmp_path / "bf")
    inputs = np.array([[1.0, -2.0, 0.5]], "float32")
    expected = ipu.serving.load(str(tmp_path / "bf"))(inputs)
    assert expected.dtype == ml_dtypes.bfloat16
    result = _cli("run", "--dir", str(tmp_path / "bf"), "--input_exprs",
                  "x=np.array([[1.0, -2.0, 0.5]])", "--outdir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "(bfloat16 values as float32, exactly: .npy cannot name bfloat16)" in result.stdout
    saved = np.load(tmp_path / "out" / "output_0.npy", allow_pickle=False)
    assert saved.dtype == np.float32
    np.testing.assert_array_equal(saved.astype(ml_dtypes.bfloat16), expected)


def test_dtypes_that_npy_cannot_name_are_saved_widened_exactly():
    import ml_dtypes

    from keras_ipu.serving.commands import npy_array

    for dtype, wide in ((ml_dtypes.float8_e5m2, "float32"), (ml_dtypes.float8_e4m3fn, "float32"),
                        (ml_dtypes.int4, "int8"), (ml_dtypes.uint4, "uint8")):
        value = np.array([[0, 1, 3, 7]], dtype)
        saved, note = npy_array(value)
        assert saved.dtype == wide and f"{np.dtype(dtype)} values as {wide}" in note
        np.testing.assert_array_equal(saved.astype(dtype), value)
    for dtype in ("float32", "float16", "int8", "bool"):  # NumPy's own: saved as they are
        value = np.ones(2, dtype)
        saved, note = npy_array(value)
        assert saved is value and note == ""


def test_run_takes_the_saved_model_tools_options(export_dir, tmp_path):
    # The seed's `ipu_saved_model_cli run` line: its required tag set and signature, its
    # IPU options, and inputs separated by ";".
    np.save(tmp_path / "x.npy", np.full((1, 4), 2, "float32"))
    np.save(tmp_path / "y.npy", np.full((1, 4), 5, "float32"))
    result = _cli("run", "--dir", str(export_dir), "--tag_set", "serve", "--signature_def",
                  "serving_default", "--inputs", f"x={tmp_path / 'x.npy'};y={tmp_path / 'y.npy'}",
                  "--init_ipu", "--num_ipus", "1", "--matmul_amp", "0.6", "--conv_amp", "0.3",
                  "--matmul_partial_type", "half", "--conv_partial_type", "float")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "output_0: [[7. 7. 7. 7.]]"


@pytest.mark.parametrize("args, message", [
    (["run", "--dir", "{export}", "--tag_set", "train"], "the export has one tag set, 'serve'"),
    (["run", "--dir", "{export}", "--signature_def", "predict"], "one signature"),
    (["run", "--dir", "{export}", "--num_ipus", "2"], "the export runs on 1 IPU(s)"),
    (["run", "--dir", "{export}", "--matmul_amp", "1.5"], "must be between 0.0 and 1.0"),
    (["run", "--dir", "{export}", "--input_examples", "x=[example]"], "tf.train.Example"),
    (["run", "--dir", "{export}", "--input_exprs", "x=__import__('os').getcwd()"],
     "Only NumPy constructors"),
    (["run", "--dir", "{export}", "--input_exprs", "x=np.load('secret.npy')"],
     "`np.load` is not allowed"),
    (["run", "--dir", "{export}", "--input_exprs", "x=np.ones((2, 4)); y=np.ones((1, 4))"],
     "has shape (2, 4), expected (1, 4)"),
    # Allowed forms that fail: before, a traceback and status 1.
    (["run", "--dir", "{export}", "--input_exprs", 'x=np.ones("abc")'],
     "Cannot evaluate 'np.ones(\"abc\")': 'str' object cannot be interpreted as an integer"),
    (["run", "--dir", "{export}", "--input_exprs", "x=1/0"],
     "Cannot evaluate '1/0': division by zero"),
    (["run", "--dir", "{export}", "--input_exprs", 'x=np.ones((2, 4)) + "x"'],
     "Cannot evaluate 'np.ones((2, 4)) + \"x\"': ufunc 'add' did not contain a loop"),
    (["run", "--dir", "{export}", "--inputs", "x=missing.npy"], "no file 'missing.npy'"),
    (["run", "--dir", "{export}"], "give the inputs"),
    (["show", "--dir", "no/such/export"], "is not a keras_ipu export"),
    (["serve-everything"], "unknown command"),
])
def test_bad_input_is_one_line_and_status_2(args, message, export_dir):
    result = _cli(*(a.format(export=export_dir) for a in args))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_missing_array_or_an_unwritable_outdir_is_one_line_and_status_2(export_dir,
                                                                          tmp_path):
    np.savez(tmp_path / "inputs.npz", a=np.ones((1, 4), "float32"))
    (tmp_path / "a_file").touch()
    (tmp_path / "inputs.json").write_text('{"x": [[1, 2, 3, 4]]}')
    for args, message in (
            (["--inputs", f"x={tmp_path / 'inputs.npz'}[b]"], "has no array 'b'; it has ['a']"),
            # Before: NumPy's "contains pickled (object) data ... allow_pickle=" advice.
            (["--inputs", f"x={tmp_path / 'inputs.json'}"],
             f"'{tmp_path / 'inputs.json'}' is not a .npy or .npz file (--input_exprs"),
            (["--input_exprs", "x=np.ones((1, 4));y=np.ones((1, 4))", "--outdir",
              str(tmp_path / "a_file")],
             "cannot make the folder")):
        result = _cli("run", "--dir", str(export_dir), *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_outputs_named_as_paths_are_refused_before_any_file_is_written(tmp_path, capsys):
    # A dict output's keys are served as names: "../escaped" was written outside --outdir,
    # and "logits/probs" then failed, with the first output already written.
    import keras_ipu as ipu
    from keras_ipu.cli import main

    from conftest import configure

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        x = keras.Input((2,), batch_size=1, name="x")
        model = keras.Model(x, {"../escaped": x + 1, "logits/probs": x * 2, "fine": x})
    model.export_for_ipu_serving(tmp_path / "e")
    out = tmp_path / "deep" / "out"
    status = main(["run", "--dir", str(tmp_path / "e"), "--input_exprs", "x=np.ones((1, 2))",
                   "--outdir", str(out)])
    assert status == 2
    assert "output '../escaped' cannot be saved as a file in --outdir" in capsys.readouterr().err
    assert not (tmp_path / "deep").exists()
    # Printed, they are fine.
    assert main(["run", "--dir", str(tmp_path / "e"), "--input_exprs", "x=np.ones((1, 2))"]) == 0
    assert "logits/probs: [[2. 2.]]" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["show", "run", "serve", "convert", "demo"])
def test_every_command_has_help(command):
    result = _cli(command, "--help")
    assert result.returncode == 0 and "usage: keras-ipu" in result.stdout


def test_a_reader_that_has_gone_ends_the_command_quietly(export_dir):
    # `keras-ipu show ... | head -1`: Python's BrokenPipeError traceback at exit before.
    code = ("import sys; from keras_ipu.cli import main; "
            f"sys.exit(main(['show', '--dir', {str(export_dir)!r}]))")
    process = subprocess.Popen([sys.executable, "-c", code], env=fresh_process_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # gone before anything is written
    errors = process.stderr.read()
    assert process.wait(timeout=300) == 1 and errors == ""


def test_show_and_run_never_import_keras(export_dir):
    code = ("import sys; from keras_ipu.cli import main; "
            f"assert main(['run', '--dir', {str(export_dir)!r}, '--input_exprs', "
            "'x=np.ones((1, 4)); y=np.ones((1, 4))']) == 0; "
            "assert 'keras' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], env=fresh_process_env(),
                            capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_expressions_allow_numpy_constructors_only():
    assert expressions.evaluate("np.full((2,), -1.5)").tolist() == [-1.5, -1.5]
    assert expressions.evaluate("[[1, 2], [3, 4]]").shape == (2, 2)
    assert expressions.evaluate("np.ones(2, dtype=np.int32) * 3").dtype == np.int32
    for bad in ("open('x')", "np.ones(2).tofile('x')", "np.fromfile('x')", "(lambda: 1)()",
                "np.ones(**{'shape': 2})", "x", "np.ones(-1)", "np.ones('abc')", "1/0",
                "np.ones((2, 4)) + 'x'", "np.ones((100000, 100000, 100000))"):
        with pytest.raises(ValueError):
            expressions.evaluate(bad)


def test_run_takes_integer_literals_for_an_integer_input_they_fit(tmp_path, capsys):
    # `np.array([[1, 2, 3]])` is int64: refused for a uint8 input ("has dtype int64, expected
    # uint8"), though the REST server takes the same integers. Out of range, refused.
    import keras_ipu as ipu
    from keras_ipu import cli

    from conftest import configure

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        x = keras.Input((3,), batch_size=1, dtype="uint8", name="x")
        model = keras.Model(x, keras.layers.Rescaling(2.0)(x))
    model.export_for_ipu_serving(tmp_path / "u8")
    assert cli.main(["run", "--dir", str(tmp_path / "u8"), "--input_exprs",
                     "x=np.array([[1, 2, 255]])"]) == 0
    assert capsys.readouterr().out.strip() == "output_0: [[  2.   4. 510.]]"
    assert cli.main(["run", "--dir", str(tmp_path / "u8"), "--input_exprs",
                     "x=np.array([[1, 2, 256]])"]) == 2
    assert "values 1 to 256 are outside uint8's [0, 255]" in capsys.readouterr().err


def test_a_damaged_export_is_one_line_and_status_2(export_dir, tmp_path, capsys):
    # A truncated weights archive or a junk program gave a traceback (BadZipFile, struct.error).
    import shutil

    from keras_ipu import cli

    for damaged, damage in (("weights.npz", b"PK\x03\x04"), ("step.jaxexport", b"junk")):
        copy = tmp_path / damaged
        shutil.copytree(export_dir, copy)
        (copy / damaged).write_bytes(damage)
        assert cli.main(["show", "--dir", str(copy)]) == 2
        error = capsys.readouterr().err
        assert "holds a damaged keras_ipu export" in error and len(error.splitlines()) == 1
    # Before: AttributeError ('list' object has no attribute 'get') and KeyError ('platforms').
    import json

    for metadata, message in (([], "holds a JSON list, not an export's metadata"),
                              (None, "holds a JSON NoneType")):
        copy = tmp_path / f"metadata_{type(metadata).__name__}"
        shutil.copytree(export_dir, copy)
        (copy / "metadata.json").write_text(json.dumps(metadata))
        for command in ("show", "run"):
            assert cli.main([command, "--dir", str(copy)]) == 2
            error = capsys.readouterr().err
            assert message in error and len(error.splitlines()) == 1, error
    # Before: a traceback (TypeError, status 1), or "invalid literal for int()".
    for ipus in (None, "abc", [2], 0):
        copy = tmp_path / f"ipus_{ipus!r}"
        shutil.copytree(export_dir, copy)
        metadata = json.loads((copy / "metadata.json").read_text())
        (copy / "metadata.json").write_text(json.dumps({**metadata, "num_ipus": ipus}))
        for command in ("show", "run"):
            assert cli.main([command, "--dir", str(copy)]) == 2
            error = capsys.readouterr().err
            assert (f"holds a damaged keras_ipu export: its metadata.json gives num_ipus "
                    f"{ipus!r}, not a whole number") in error and len(error.splitlines()) == 1
    copy = tmp_path / "no_platforms"
    shutil.copytree(export_dir, copy)
    metadata = json.loads((copy / "metadata.json").read_text())
    del metadata["platforms"]
    (copy / "metadata.json").write_text(json.dumps(metadata))
    assert cli.main(["show", "--dir", str(copy)]) == 0
    assert "platforms: ?" in capsys.readouterr().out


def test_run_takes_a_dict_inputs_key_as_its_name(tmp_path, capsys):
    # Integer literals given by the input's key were refused (int64 for uint8), not by its name.
    import keras_ipu as ipu
    from keras_ipu import cli

    from conftest import configure

    configure(1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        pixels = keras.Input((3,), batch_size=1, dtype="uint8", name="pix")
        model = keras.Model({"u": pixels}, keras.layers.Rescaling(2.0)(pixels))
    model.export_for_ipu_serving(tmp_path / "keyed")
    for name in ("pix", "u"):
        assert cli.main(["run", "--dir", str(tmp_path / "keyed"), "--input_exprs",
                         f"{name}=np.array([[1, 2, 255]])"]) == 0
        assert capsys.readouterr().out.strip() == "output_0: [[  2.   4. 510.]]"


def test_serve_refuses_a_model_name_its_paths_cannot_hold(export_dir, capsys):
    # The server started, and every request got a plain-text 404.
    from keras_ipu import cli

    assert cli.main(["serve", "--dir", str(export_dir), "--model_name", "resnet:v1"]) == 2
    assert "has no '/', ':', '?', '#' or '%'" in capsys.readouterr().err
    # Before: accepted, and clients dropped what follows '?' or rewrote '.' out of the path.
    for name in ("resnet?v2", "a#b", ".", ".."):
        assert cli.main(["serve", "--dir", str(export_dir), "--model_name", name]) == 2
        assert f"--model_name {name!r}: a model name needs" in capsys.readouterr().err


def test_serve_names_the_model_after_its_folder_given_as_dot(export_dir, monkeypatch):
    # Before: `--dir .` served the model as '.', a path no client keeps.
    from keras_ipu.serving import commands

    monkeypatch.chdir(export_dir)
    assert commands._served_name(None, ".") == export_dir.name
    assert commands._served_name(None, str(export_dir) + "/") == export_dir.name


def test_serve_names_a_host_it_cannot_resolve(export_dir, capsys):
    # Before: "error: [Errno -2] Name or service not known", naming neither.
    from keras_ipu import cli

    assert cli.main(["serve", "--dir", str(export_dir), "--host", "no.such.host.invalid",
                     "--port", "0"]) == 2
    assert "--host 'no.such.host.invalid': cannot resolve it (" in capsys.readouterr().err


@pytest.mark.parametrize("delay", ["nan", "inf", "-1"])
def test_serve_refuses_a_batch_delay_that_never_sends_a_batch(delay, export_dir, capsys):
    # Before, nan and inf started a server whose partial batches were never answered.
    from keras_ipu import cli
    from keras_ipu.serving import load
    from keras_ipu.serving.server import DynamicBatcher

    assert cli.main(["serve", "--dir", str(export_dir), "--max_batch_delay_ms", delay]) == 2
    assert f"--max_batch_delay_ms a finite number >= 0; got 8501 and {float(delay)}" in (
        capsys.readouterr().err)
    with pytest.raises(ValueError, match="max_batch_delay_ms must be a finite number >= 0"):
        DynamicBatcher(load(str(export_dir)), float(delay))


@pytest.mark.parametrize("argv, leaves", [
    (["show", "--dir", "no_such_export"], True),
    (["run", "--dir", "no_such_export"], True),
    (["run", "--num-instances", "0", "job.py"], False),  # the launcher: the job is its own
])
def test_one_process_tools_leave_the_job_they_were_started_in(argv, leaves, monkeypatch):
    from keras_ipu import cli

    job = {"KERAS_IPU_NUM_INSTANCES": "2", "KERAS_IPU_INSTANCE_INDEX": "1",
           "KERAS_IPU_COORDINATOR": "127.0.0.1:1", "SLURM_NTASKS": "4"}
    for name, value in job.items():
        monkeypatch.setenv(name, value)
    assert cli.main(argv) == 2
    assert all((name in os.environ) != leaves for name in job)
