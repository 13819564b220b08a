"""`keras-ipu show`, `run` and `serve`: look into an export, run it, serve it, without Keras.

Modelled on the SavedModel command line tool: `show --dir DIR` prints the
signatures, batch size, iterations, IPUs, stage mapping and platforms;
`run --dir DIR --inputs name=file.npy[,...] | --input_exprs 'name=np.ones((1, 4))'`
runs one batch and prints the outputs, or saves them as `.npy` files with
`--outdir` (bfloat16, float8 and int4 widened exactly: `.npy` cannot name
them); `serve --dir DIR` serves it with TensorFlow Serving's REST API
(`keras_ipu.serving.server`). Bad input exits with status 2 and a one-line
error.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
from collections.abc import Sequence

import numpy as np


class CommandError(Exception):
    """A one-line error for the user (no traceback)."""


def show_main(argv: Sequence[str]) -> int:
    """`keras-ipu show --dir DIR`."""
    parser = argparse.ArgumentParser(
        prog="keras-ipu show", description="Show an export's signatures and metadata.")
    parser.add_argument("--dir", required=True, help="the export directory")
    args = parser.parse_args(argv)
    return _guarded(lambda: print(_describe(_load(args.dir))))


def run_main(argv: Sequence[str]) -> int:
    """`keras-ipu run --dir DIR (--inputs ... | --input_exprs ...) [--outdir DIR] [--overwrite]`."""
    parser = argparse.ArgumentParser(
        prog="keras-ipu run", description="Run one batch through an export.",
        epilog="With --num-instances N, `keras-ipu run` starts N instances of a training "
               "script instead (multi-host training): see "
               "`keras-ipu run --num-instances 1 --help`.")
    parser.add_argument("--dir", required=True, help="the export directory")
    parser.add_argument("--inputs", default="",
                        help="name=file.npy pairs, separated by ';' or ',' "
                             "(a .npz file: name=file.npz[key])")
    parser.add_argument("--input_exprs", default="",
                        help="name=expression pairs, semicolon separated; NumPy constructors only, "
                             "e.g. \"x=np.ones((1, 4), dtype=np.float32)\"")
    parser.add_argument("--outdir", help="save each output as OUTDIR/<name>.npy")
    parser.add_argument("--overwrite", action="store_true", help="overwrite existing output files")
    _add_saved_model_run_options(parser)
    args = parser.parse_args(argv)
    return _guarded(lambda: _run(args))


# The SavedModel tool's `run` options: an export has one tag set and one signature.
TAG_SET, SIGNATURE_DEF = "serve", "serving_default"
PARTIAL_TYPES = ("float", "half")


def _add_saved_model_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tag_set", default=TAG_SET, help=f"the export's tag set: {TAG_SET}")
    parser.add_argument("--signature_def", default=SIGNATURE_DEF,
                        help=f"the export's signature: {SIGNATURE_DEF}")
    parser.add_argument("--input_examples", help="tf.train.Example inputs: not supported")
    parser.add_argument("--num_ipus", type=int,
                        help="IPUs the export runs on; checked against the export's")
    parser.add_argument("--init_ipu", action="store_true",
                        help="accepted: an export needs no configured IPU system")
    for name in ("matmul_amp", "conv_amp"):
        parser.add_argument(f"--{name}", type=float,
                            help="available memory proportion (0-1); no effect on the device model")
    for name in ("matmul_partial_type", "conv_partial_type"):
        parser.add_argument(f"--{name}", choices=PARTIAL_TYPES,
                            help="partials type; no effect on the device model")
    parser.add_argument("--tf_debug", action="store_true", help="accepted; no effect")
    parser.add_argument("--worker", help="accepted; no effect")


def _check_saved_model_run_options(args: argparse.Namespace, metadata: dict) -> None:
    if args.tag_set != TAG_SET:
        raise CommandError(f"--tag_set {args.tag_set!r}: the export has one tag set, {TAG_SET!r}")
    if args.signature_def != SIGNATURE_DEF:
        raise CommandError(f"--signature_def {args.signature_def!r}: the export has one "
                           f"signature, {SIGNATURE_DEF!r}")
    if args.input_examples:
        raise CommandError("--input_examples needs TensorFlow's tf.train.Example; give the "
                           "inputs with --inputs or --input_exprs")
    ipus = int(metadata.get("num_ipus", 1))
    if args.num_ipus is not None and args.num_ipus != ipus:
        raise CommandError(f"--num_ipus {args.num_ipus}: the export runs on {ipus} IPU(s)")
    for name in ("matmul_amp", "conv_amp"):
        value = getattr(args, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise CommandError(f"--{name} {value}: must be between 0.0 and 1.0")


def serve_main(argv: Sequence[str]) -> int:
    """`keras-ipu serve --dir DIR [--model_name N] [--port P] [--host H] [...]`."""
    parser = argparse.ArgumentParser(
        prog="keras-ipu serve",
        description="Serve an export with TensorFlow Serving's REST API (Ctrl-C stops it).")
    parser.add_argument("--dir", required=True, help="the export directory")
    parser.add_argument("--model_name", help="the model's name in URLs (default: the directory's)")
    parser.add_argument("--port", type=int, default=8501, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--max_batch_delay_ms", type=float, default=2.0,
                        help="how long a batch waits for more requests' rows")
    args = parser.parse_args(argv)
    return _guarded(lambda: _serve(args))


def _served_name(model_name: str | None, export_dir: str) -> str:
    """The REST name: `--model_name`, or the export folder's own (`--dir .` too)."""
    name = model_name or os.path.basename(os.path.abspath(export_dir))
    if name in ("", ".", "..") or set(name) & set("/:?#%"):  # clients rewrite such paths
        raise CommandError(f"--model_name {name!r}: a model name needs a character, is not '.' "
                           f"or '..', and has no '/', ':', '?', '#' or '%' (the REST paths' "
                           f"separators and URL syntax); give --model_name")
    return name


def _serve(args: argparse.Namespace) -> None:
    import asyncio

    from keras_ipu.device import interrupts

    # Not `< 0`: NaN compares false, and a NaN or infinite delay never sends a batch.
    if not 0 <= args.port <= 65535 or not 0 <= args.max_batch_delay_ms < math.inf:
        raise CommandError("--port must be 0-65535 and --max_batch_delay_ms a finite "
                           f"number >= 0; got {args.port} and {args.max_batch_delay_ms}")
    name = _served_name(args.model_name, args.dir)
    try:
        # Held back while JAX starts and the export loads (a second one stops it at once):
        # a Ctrl-C that lands in JAX's garbage-collection callback is dropped there, and
        # the server went on to serve.
        with interrupts.deferred(second_raises=True):
            from keras_ipu.serving import server

            runtime = _load(args.dir)
        asyncio.run(server.serve(runtime, name, args.host, args.port, args.max_batch_delay_ms,
                                 announce=lambda line: print(line, flush=True)))
    except KeyboardInterrupt:
        print("keras-ipu serve: stopped", flush=True)
    except socket.gaierror as error:  # an OSError naming neither the option nor the host
        raise CommandError(f"--host {args.host!r}: cannot resolve it ({error.strerror})"
                           ) from None
    except (ImportError, OSError, ValueError) as error:
        raise CommandError(str(error)) from None


def convert_main(argv: Sequence[str]) -> int:
    """`keras-ipu convert [ipu] --model MODEL.keras --dir DIR [options]` (needs Keras)."""
    parser = argparse.ArgumentParser(
        prog="keras-ipu convert",
        description="Turn a saved Keras model into an IPU serving export (the SavedModel "
                    "tool's `convert ipu` options).")
    parser.add_argument("--model", required=True, help="the .keras file")
    parser.add_argument("--dir", required=True, help="the export directory (new or empty)")
    parser.add_argument("--batch_size", type=int, help="the export's batch size (default 1)")
    parser.add_argument("--batch_per_step", type=int,
                        help="batches per device call of the exported loop (default 0: 1)")
    parser.add_argument("--num_ipus", type=int, help="IPUs (default 1)")
    parser.add_argument("--precision_mode", help="FP32 (default) or FP16")
    parser.add_argument("--precision_conversion_excluded_nodes", nargs="+",
                        help="regexes of layers kept in float32 with FP16")
    parser.add_argument("--int64_to_int32_conversion", action="store_true", default=None,
                        help="export int64 inputs as int32")
    parser.add_argument("--manual_sharding", nargs="+",
                        help="one regex per IPU: layers matching the i-th go to stage i")
    parser.add_argument("--pipeline_cfg", help="the pipeline configuration, JSON "
                                               "(converter auto, manual or load)")
    parser.add_argument("--config_file", help="a JSON file with any of these options")
    parser.add_argument("--unsafe_deserialization", action="store_true",
                        help="load a model with Python lambdas (Keras' safe_mode=False): "
                             "only a file you trust")
    for name in ("excluded_nodes", "matmul_amp", "conv_amp", "matmul_partial_type",
                 "conv_partial_type", "gelu_replacement", "embedded_runtime_save_config"):
        parser.add_argument(f"--{name}", nargs="*", help="accepted; no effect on the device model")
    for name in ("no_ipu_placement", "remove_excluded_nodes", "merge_subgraphs"):
        parser.add_argument(f"--{name}", action="store_true", default=None,
                            help="accepted; no effect on the device model")
    if argv and argv[0] == "ipu":  # the SavedModel tool's `convert ipu ...`
        argv = argv[1:]
    args = parser.parse_args(argv)
    return _guarded(lambda: _convert(args))


def _convert(args: argparse.Namespace) -> None:
    from keras_ipu.keras import convert

    try:
        values = convert.read_config_file(args.config_file) if args.config_file else {}
        given = {k: v for k, v in vars(args).items() if v is not None and k not in (
            "model", "dir", "config_file", "unsafe_deserialization")}
        if args.unsafe_deserialization:
            import keras

            keras.config.enable_unsafe_deserialization()
        if "pipeline_cfg" in given:
            given["pipeline_cfg"] = _json_option("--pipeline_cfg", given["pipeline_cfg"])
        if "manual_sharding" in given:  # one regex per IPU on the command line
            given["manual_sharding"] = [[regex] for regex in given["manual_sharding"]]
        options = convert.ConvertOptions.from_mapping({**values, **given})
        if not os.path.isfile(args.model):
            raise CommandError(f"--model: no file {args.model!r}")
        summary = convert.convert(args.model, args.dir, options)
    except (ValueError, RuntimeError, TypeError, OSError) as error:
        message = str(error).splitlines()[0]
        located = re.search(r"Could not locate (class|function) '[^']*'", str(error))
        if located:  # Keras' cause, deep in its message: a custom class it cannot import
            message = (f"--model {args.model}: {located.group(0)}. keras-ipu convert imports "
                       f"none of your code: convert from Python after importing the module "
                       f"that registers it (keras_ipu.keras.convert.convert).")
        if isinstance(error, OSError) and _names_the_model(error, args.model):
            message = f"--model {args.model}: {message}"  # h5py's too: no HDF5 file
        if "safe_mode" in str(error):  # Keras' advice is for Python; this is the command's
            message += " (keras-ipu convert: --unsafe_deserialization, for a file you trust)"
        raise CommandError(message) from None
    print(f"export written to {args.dir}")
    for key, value in summary.items():
        if value:
            print(f"  {key}: {value}")


def _names_the_model(error: OSError, model: str) -> bool:
    """Whether an error reading or writing files is the model file's (or names no file)."""
    culprit = getattr(error, "filename", None)
    return culprit is None or os.path.abspath(str(culprit)) == os.path.abspath(model)


def _json_option(name: str, text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise CommandError(f"{name} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise CommandError(f"{name} must be a JSON object")
    return value


def _run(args: argparse.Namespace) -> None:
    runtime = _load(args.dir)
    _check_saved_model_run_options(args, runtime.metadata)
    inputs = {**_file_inputs(args.inputs), **_expression_inputs(args.input_exprs)}
    if not inputs:
        raise CommandError("give the inputs with --inputs or --input_exprs")
    try:
        outputs = runtime(**inputs)
    except (TypeError, ValueError) as error:
        raise CommandError(str(error)) from None
    outputs = runtime.by_output_name(outputs)
    if args.outdir is None:
        for name, value in outputs.items():
            print(f"{name}: {np.array2string(value, threshold=64)}")
        return
    paths = _output_paths(args.outdir, list(outputs), args.overwrite)
    try:
        os.makedirs(args.outdir, exist_ok=True)
    except OSError as error:
        raise CommandError(f"--outdir {args.outdir!r}: cannot make the folder ({error})") from None
    for (name, value), path in zip(outputs.items(), paths):
        value, note = npy_array(np.asarray(value))
        try:
            np.save(path, value)
        except OSError as error:
            raise CommandError(f"--outdir: cannot write {path!r} ({error})") from None
        print(f"{name}: saved to {path}{note}")


def _output_paths(outdir: str, names: list[str], overwrite: bool) -> list[str]:
    """`OUTDIR/<name>.npy` per output, checked before any is written.

    Raises:
        CommandError: For a name that is no file name (a dict output's key
            such as `"logits/probs"` or `".."`), or a file that exists
            without `overwrite`.
    """
    for name in names:
        if name in ("", ".", "..") or "/" in name or os.path.basename(name) != name:
            raise CommandError(
                f"output {name!r} cannot be saved as a file in --outdir (its name is a "
                f"path); export the model with `output_names` that are file names, or "
                f"leave out --outdir to print the outputs")
    paths = [os.path.join(outdir, f"{name}.npy") for name in names]
    for path in paths:
        if os.path.exists(path) and not overwrite:
            raise CommandError(f"{path} exists; pass --overwrite to replace it")
    return paths


def npy_array(value: np.ndarray) -> tuple[np.ndarray, str]:
    """`(the array to save as .npy, a note on what was changed)`.

    A `.npy` header names NumPy's own dtypes only: ml_dtypes' bfloat16,
    float8 and int4 types are written as raw bytes (`|V2`) that load back as
    no numbers at all. Their values are saved widened instead, exactly:
    floats as float32, integers as int8 or uint8.

    Example:

    >>> npy_array(np.array([1.5], ml_dtypes.bfloat16))[0]
    array([1.5], dtype=float32)
    """
    if _npy_names(value.dtype):
        return value, ""
    import ml_dtypes  # JAX's own dependency: no new one

    try:
        wide = np.dtype("int8" if ml_dtypes.iinfo(value.dtype).min < 0 else "uint8")
    except ValueError:  # not an integer type: bfloat16 and the float8 types
        wide = np.dtype("float32")
    return value.astype(wide), (f" ({value.dtype} values as {wide}, exactly: .npy cannot name "
                                f"{value.dtype})")


def _npy_names(dtype: np.dtype) -> bool:
    """Whether a `.npy` file's header gives `dtype` back."""
    try:
        return np.lib.format.descr_to_dtype(np.lib.format.dtype_to_descr(dtype)) == dtype
    except (TypeError, ValueError):  # float8_e5m2's '<f1' is no dtype NumPy reads back
        return False


def _file_inputs(spec: str) -> dict:
    inputs = {}
    # Pairs separated by ";" as in the SavedModel tool, or by ",".
    for name, value in _pairs(spec.replace(";", ","), ",", "--inputs"):
        key = None
        if value.endswith("]") and "[" in value:
            value, key = value[:-1].split("[", 1)
        if not os.path.isfile(value):
            raise CommandError(f"--inputs {name}: no file {value!r}")
        try:
            loaded = np.load(value, allow_pickle=False)
        except ValueError:  # NumPy's advice on unpickling is none for a shell user
            raise CommandError(f"--inputs {name}: {value!r} is not a .npy or .npz file "
                               f"(--input_exprs takes Python expressions)") from None
        except OSError as error:
            raise CommandError(f"--inputs {name}: cannot read {value!r} ({error})") from None
        if isinstance(loaded, np.lib.npyio.NpzFile):
            if key is None and len(loaded.files) != 1:
                raise CommandError(f"--inputs {name}: name the array of {value!r}: {loaded.files}")
            if key is not None and key not in loaded.files:
                raise CommandError(f"--inputs {name}: {value!r} has no array {key!r}; it has "
                                   f"{loaded.files}")
            loaded = loaded[key or loaded.files[0]]
        inputs[name] = loaded
    return inputs


def _expression_inputs(spec: str) -> dict:
    from keras_ipu.serving import expressions

    inputs = {}
    for name, expression in _pairs(spec, ";", "--input_exprs"):
        try:
            # Integer literals have no width (`np.array([[1, 2]])` is int64): the runtime
            # casts them to the input's integer dtype when they fit it.
            inputs[name] = expressions.evaluate(expression)
        except ValueError as error:
            raise CommandError(f"--input_exprs {name}: {error}") from None
    return inputs


def _pairs(spec: str, separator: str, option: str) -> list[tuple[str, str]]:
    pairs = []
    for item in filter(None, (part.strip() for part in spec.split(separator))):
        name, equals, value = item.partition("=")
        if not equals or not name.strip() or not value.strip():
            raise CommandError(f"{option}: expected name=value, got {item!r}")
        pairs.append((name.strip(), value.strip()))
    return pairs


def _load(export_dir: str):
    from keras_ipu.serving import runtime

    runtime.run_inline_on_cpu()  # a serving process: small programs, one at a time
    try:
        return runtime.load(export_dir)
    except (FileNotFoundError, ValueError) as error:
        raise CommandError(str(error)) from None


def _describe(runtime) -> str:
    meta = runtime.metadata

    def entries(items):
        return [f"    {e['name']}: dtype {e['dtype']}, shape {tuple(e['shape'])}" for e in items]

    lines = [
        f"export: {runtime.export_dir} (model {meta.get('model_name')!r}, keras_ipu "
        f"{meta.get('keras_ipu_version')})",
        f"batch size: {meta['batch_size']}",
        f"iterations per device call (run_many): {meta['iterations']}",
        f"IPUs: {meta.get('num_ipus', 1)}; pipeline stages: {meta.get('pipeline_stages', 1)}; "
        f"stage -> IPU: {meta.get('device_mapping', [0])}",
        f"platforms: {', '.join(meta.get('platforms', ['?']))}",
        "inputs:", *entries(meta["inputs"]),
        "outputs:", *entries(meta["outputs"]),
    ]
    return "\n".join(lines)


def _guarded(action) -> int:
    try:
        action()
    except CommandError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


__all__ = ["convert_main", "run_main", "serve_main", "show_main"]
