"""Multi-host training: the launcher, the distributed helpers, fit across instances.

Each job runs as `keras-ipu run --num-instances 2` in fresh processes (CPU,
gloo collectives); every subprocess has a timeout so nothing hangs the suite.
"""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu import cli
from keras_ipu.distributed import launcher, runtime

from conftest import ROOT, configure, fresh_process_env

JOBS = ROOT / "tests" / "multi_host"
TIMEOUT = 240


def launch(*args: str, timeout: int = TIMEOUT, env: dict | None = None):
    """Runs `python -m keras_ipu run ARGS` as a user would; returns the completed process."""
    return subprocess.run(
        [sys.executable, "-m", "keras_ipu", "run", *args],
        env={**fresh_process_env(), **(env or {})}, cwd=JOBS, capture_output=True,
        text=True, timeout=timeout,
    )


@contextlib.contextmanager
def launched(logs: Path, *args: str, timeout: int = TIMEOUT):
    """`launch` in the background, while the test computes its expectations.

    Yields a function that waits for the job (at most `timeout` seconds from
    the start) and returns the completed process; output goes to files in
    `logs`, which no pipe limits while the test is busy. The job is killed if
    the test leaves early.
    """
    started = time.monotonic()
    with open(logs / "stdout", "w+") as out, open(logs / "stderr", "w+") as err:
        process = subprocess.Popen([sys.executable, "-m", "keras_ipu", "run", *args],
                                   env=fresh_process_env(), cwd=JOBS, stdout=out, stderr=err,
                                   text=True)

        def finished() -> subprocess.CompletedProcess:
            process.wait(timeout=max(timeout - (time.monotonic() - started), 1))
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(process.args, process.returncode, out.read(),
                                               err.read())

        try:
            yield finished
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def lines_of(output: str, index: int) -> str:
    """Instance `index`'s output, joined (gloo's C++ prints may share a line with Python's)."""
    prefix = f"[{index}] "
    return "\n".join(line[len(prefix):] for line in output.splitlines()
                     if line.startswith(prefix))


def test_instance_environment_and_launcher_environment_agree():
    env = launcher.instance_environment(1, 2, "127.0.0.1:1234", 4, 2, base={})
    assert runtime.launcher_environment(env) == {
        "coordinator": "127.0.0.1:1234", "num_instances": 2, "instance_index": 1}
    assert env[runtime.NUM_REPLICAS_ENV] == "4" and env[runtime.IPUS_PER_REPLICA_ENV] == "2"
    assert runtime.launcher_environment({}) is None
    with pytest.raises(ValueError, match="KERAS_IPU_INSTANCE_INDEX=2"):
        runtime.launcher_environment({**env, runtime.INSTANCE_INDEX_ENV: "2"})
    # Two instances without their index would both be instance 0, and hang.
    del env[runtime.INSTANCE_INDEX_ENV]
    with pytest.raises(ValueError, match=r"KERAS_IPU_INSTANCE_INDEX=\(not set\)"):
        runtime.launcher_environment(env)
    assert runtime.launcher_environment({runtime.NUM_INSTANCES_ENV: "1"})["instance_index"] == 0


def test_steps_of_a_job_count_every_replicas_batches():
    from types import SimpleNamespace

    from keras_ipu.keras import replication

    two_by_two = SimpleNamespace(count=4, local_count=2, spans_processes=True)
    assert replication.instance_steps(8, two_by_two) == 4
    # Before: "at least 2 (one batch per instance)" for 1, and a confusing error later for 3.
    for steps in (1, 2, 5):
        with pytest.raises(ValueError, match=rf"steps_per_epoch={steps} counts the batches of "
                                             r"all 4 replicas .* at least 4 .* multiple of 2"):
            replication.instance_steps(steps, two_by_two, "steps_per_epoch")


def test_shard_for_instance_shards_every_array_of_nested_data():
    # Before: (x, (y1, y2)) gave y as one empty array, a dict of labels an IndexError.
    x = np.arange(16).reshape(16, 1)
    data = (x, (x * 10, [x * 100]), {"a": x * 1000})
    mine = ipu.distributed.shard_for_instance(data, 2, 1, instance=1, instances=2)
    rows = np.array([2, 3, 6, 7, 10, 11, 14, 15])  # batch i of 2 rows to replica i % 2
    np.testing.assert_array_equal(mine[0][:, 0], rows)
    np.testing.assert_array_equal(mine[1][0][:, 0], rows * 10)
    np.testing.assert_array_equal(mine[1][1][0][:, 0], rows * 100)
    np.testing.assert_array_equal(mine[2]["a"][:, 0], rows * 1000)
    assert isinstance(mine[1], tuple) and isinstance(mine[1][1], list)


def test_the_helpers_refuse_what_has_no_answer():
    with pytest.raises(ValueError, match="an instance index in 0..1, got 2"):
        ipu.distributed.shard_for_instance(np.ones((8, 1)), 2, 1, instance=2, instances=2)
    with pytest.raises(ValueError, match="at least one dimension"):
        ipu.distributed.allgather(np.float32(1))
    halves = np.array([[1.0], [2.0]], "bfloat16")  # two instances' values, stacked
    assert float(runtime.reduce_stacked(halves, "mean")[0]) == 1.5


def test_update_ipu_config_sets_the_multi_replica_distribution_options(monkeypatch):
    for name, value in launcher.instance_environment(1, 2, "127.0.0.1:1234", 4, base={}).items():
        monkeypatch.setenv(name, value)
    config = ipu.config.IPUConfig()
    assert ipu.distributed.update_ipu_config(config) is config
    distribution = config.experimental.multi_replica_distribution
    assert (distribution.process_count, distribution.process_index) == (2, 1)
    assert config.auto_select_ipus == 2  # 4 replicas over 2 instances
    # A replica of 3 pipeline stages takes 4 IPUs, as the pipeline needs.
    assert ipu.distributed.update_ipu_config(ipu.config.IPUConfig(), 3).auto_select_ipus == 8
    # Set by hand, the job's shape is checked (3 replicas over 2 instances gave 1 IPU each,
    # 0 IPUs per replica 2, and -3 gave 8).
    for name, value, message in (
            (runtime.NUM_REPLICAS_ENV, "3", "KERAS_IPU_NUM_REPLICAS=3 must be a multiple of "
                                            "the job's 2 instances"),
            (runtime.NUM_REPLICAS_ENV, "1.5", "KERAS_IPU_NUM_REPLICAS must be a positive "
                                              "integer, got '1.5'"),
            (runtime.IPUS_PER_REPLICA_ENV, "0", "KERAS_IPU_IPUS_PER_REPLICA must be a "
                                                "positive integer, got '0'"),
            (runtime.IPUS_PER_REPLICA_ENV, "-3", "got '-3'")):
        with monkeypatch.context() as patched:
            patched.setenv(name, value)
            with pytest.raises(ValueError, match=re.escape(message)):
                ipu.distributed.update_ipu_config(ipu.config.IPUConfig())
    monkeypatch.setenv(runtime.HEARTBEAT_ENV, "abc")
    with pytest.raises(ValueError, match="KERAS_IPU_HEARTBEAT_TIMEOUT must be a positive"):
        runtime.positive_int_env(runtime.HEARTBEAT_ENV, 100)
    monkeypatch.delenv(runtime.NUM_REPLICAS_ENV)
    config = ipu.distributed.update_ipu_config(ipu.config.IPUConfig())
    assert config.experimental.multi_replica_distribution.process_count == 2
    assert config.auto_select_ipus == ipu.config.IPUConfig().auto_select_ipus


def test_cli_run_dispatches_on_num_instances(capsys):
    assert cli._launches(["--num-instances", "2", "train.py"])
    assert cli._launches(["--num-instances=2", "--", "train.py"])
    assert not cli._launches(["--dir", "export", "--inputs", "x.npy"])
    assert not cli._launches(["--", "train.py", "--num-instances", "2"])
    assert cli.main(["run", "--num-instances", "2", "--num-replicas", "3", "x.py"]) == 2
    assert "multiple of --num-instances" in capsys.readouterr().err
    # Launcher options without --num-instances: before, the export runner's usage (--dir).
    for args in (["--num-replicas", "2", "x.py"], ["--coordinator=h:1", "--", "x.py"]):
        assert cli.main(["run", *args]) == 2
        assert capsys.readouterr().err.startswith(
            f"error: {args[0].split('=')[0]}: `keras-ipu run` starts instances of a script "
            f"only with --num-instances N")
    assert cli.main(["run", "--", "x.py"]) == 2
    assert "error: a script after --: " in capsys.readouterr().err


def test_the_launcher_splits_its_options_from_the_script_and_its_own():
    split = launcher._split
    assert split(["--num-instances", "2", "train.py", "--epochs", "3", "-m", "x"]) == (
        ["--num-instances", "2"], ["train.py", "--epochs", "3", "-m", "x"])
    assert split(["--num-instances=2", "-m", "package.train", "--num-replicas", "8"]) == (
        ["--num-instances=2"], ["-m", "package.train", "--num-replicas", "8"])
    assert split(["--num-replicas", "4", "--num-instances", "2", "--", "--odd-name.py"]) == (
        ["--num-replicas", "4", "--num-instances", "2"], ["--odd-name.py"])


def test_a_module_runs_in_every_instance_and_bad_launches_say_why():
    done = launch("--num-instances", "2", "-m", "module_job", "--epochs", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    for index in (0, 1):
        assert f"module {index} ['--epochs', '3']" in lines_of(done.stdout, index)
    for args, message in ((["--num-instances", "2"], "give the script to run"),
                          (["--num-instances", "2", "-m"], "give the script to run"),
                          (["--num-instances", "2", "--ipus-per-replica", "0", "x.py"],
                           "--ipus-per-replica must be at least 1, got 0"),
                          (["--num-instances", "2", "--coordinator", "nonsense", "x.py"],
                           "--coordinator must be HOST:PORT"),
                          # Before: each instance waited 2 minutes, then aborted (SIGABRT).
                          (["--num-instances", "2", "--coordinator", "no-such.invalid:1234",
                            "x.py"], "--coordinator no-such.invalid:1234: cannot resolve"),
                          (["--num-instances", "2", "--coordinator", "192.0.2.1:1234", "x.py"],
                           "'192.0.2.1' (192.0.2.1) is not an address of this machine"),
                          # Before: accepted, then each instance asked for no IPU.
                          (["--num-instances", "2", "--ipus-per-replica", "2", "x.py"],
                           "--ipus-per-replica (2) needs --num-replicas"),
                          # Before: each instance printed Python's usage, or a traceback.
                          (["--num-instances", "2", "--coordinatr", "h:1", "x.py"],
                           "unknown option --coordinatr (the launcher's: --num-instances"),
                          (["--num-instances", "2", "missing.py"], "no script 'missing.py'"),
                          # Before: accepted; 100,000 instances were started one by one.
                          (["--num-instances", "1025", "x.py"],
                           "--num-instances must be from 1 to 1024"),
                          (["module_job.py", "--num-instances", "2"],
                           "give the launcher's options (--num-instances, ...) before the "
                           "script")):
        failed = launch(*args)
        assert failed.returncode == 2 and message in failed.stderr, failed.stderr
        assert "Traceback" not in failed.stderr
    # A busy coordinator port: instance 0 died of SIGSEGV starting its coordination service.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        failed = launch("--num-instances", "2", "--coordinator", f"127.0.0.1:{port}",
                        "-m", "module_job")
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert f"--coordinator 127.0.0.1:{port}: its port is in use on this machine" in failed.stderr


def test_a_job_whose_reader_goes_away_stops_as_a_pipes_writer_does(tmp_path):
    # `keras-ipu run ... | head -2`: before, the launcher's output threads died and the
    # instances blocked for ever on their full pipes.
    script = tmp_path / "chatty.py"
    script.write_text("for i in range(10**6):\n    print(i)\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "keras_ipu", "run", "--num-instances", "2", str(script)],
        env=fresh_process_env(), cwd=JOBS, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        first = [process.stdout.readline() for _ in range(2)]
        process.stdout.close()  # the reader goes
        assert process.wait(timeout=60) == 1
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert all(line.startswith(("[0] ", "[1] ")) for line in first)
    assert "Traceback" not in process.stderr.read()


def test_a_folder_with_a_main_module_runs_as_python_runs_it(tmp_path):
    # The review's case: the check for a missing script refused a folder at first.
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("print('hello from app')\n")
    done = launch("--num-instances", "2", str(tmp_path / "app"))
    assert done.returncode == 0, done.stderr
    assert lines_of(done.stdout, 1) == "hello from app"


def test_the_seed_names_are_the_strategies_and_run_as_one_instance():
    from keras_ipu.distributed import strategy

    configure(2)
    seed_replica = ipu.horovod.ipu_multi_replica_strategy.IPUMultiReplicaStrategy
    seed_worker = ipu.ipu_multi_worker_strategy.IPUMultiWorkerStrategy
    assert seed_replica is strategy.IPUMultiReplicaStrategy
    assert seed_worker is strategy.IPUMultiWorkerStrategy
    seed_worker(cluster_resolver=None)
    horovod = ipu.horovod.ipu_horovod_strategy.IPUHorovodStrategy(ipu_device="/device:IPU:0")
    assert isinstance(horovod, strategy.IPUMultiReplicaStrategy)
    with pytest.raises(ValueError, match="add_ipu_cross_replica_reductions=False"):
        seed_replica(add_ipu_cross_replica_reductions=False)
    config = ipu.config.IPUConfig()
    assert seed_replica().update_ipu_config(config) is config  # no launcher: unchanged
    import keras

    with seed_replica().scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
        model.compile("sgd", "mse")
    model.set_weights([np.zeros((3, 1), "float32")])
    # Without a launcher: one instance, its 2 IPUs are the replicas.
    assert (ipu.distributed.num_instances(), ipu.distributed.num_global_replicas()) == (1, 2)
    x = np.arange(24, dtype="float32").reshape(8, 3) / 24
    y = np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=2, verbose=0, shuffle=False)
    # The replicas' gradients are summed (as on IPUs): plain Keras on the two
    # replicas' batches together with twice the learning rate.
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
    plain.compile(keras.optimizers.SGD(0.02), "mse")
    plain.set_weights([np.zeros((3, 1), "float32")])
    plain.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    np.testing.assert_allclose(model.get_weights()[0], plain.get_weights()[0], rtol=1e-6)
    assert np.abs(plain.get_weights()[0]).min() > 0


def test_allreduce_keeps_the_shape_and_dtype_as_horovod():
    ints = np.array([[3, -3, 1], [4, -4, 1]], "int32")  # two instances' values, stacked
    for op, expected in (("mean", [3, -3, 1]), ("sum", [7, -7, 2]), ("max", [4, -3, 1]),
                         ("min", [3, -4, 1])):
        reduced = runtime.reduce_stacked(ints, op)
        assert reduced.dtype == np.int32 and reduced.tolist() == expected, (op, reduced)
    for dtype in ("int8", "int64", "float16", "float32"):
        for op in ("mean", "sum", "max"):
            value = np.array([1, 2], dtype)
            assert ipu.distributed.allreduce(value, op=op).dtype == value.dtype, (dtype, op)
    assert ipu.horovod.allreduce(np.int32(5)).dtype == np.int32
    # An array whatever the reduction (a sum of a 0-d value was a NumPy scalar).
    for op in ("mean", "sum", "max"):
        for value in (np.float32(3), np.int32(7)):
            reduced = runtime.reduce_stacked(np.stack([value, value]), op)
            assert isinstance(reduced, np.ndarray) and reduced.shape == (), (op, value)
    # Truth values average as truth values (all true gave False: trunc(True / 2)).
    truths = np.array([[True, True, False], [True, False, False]])
    reduced = runtime.reduce_stacked(truths, "mean")
    assert reduced.dtype == bool and reduced.tolist() == [True, True, False]
    # An int64 mean past 2**53 is exact (a float64 quotient gave ...976).
    big = np.array([2**60 + 1, 2**60 + 1], np.int64)
    assert int(runtime.reduce_stacked(big, "mean")) == 2**60 + 1
    # A list of Python numbers is one tensor with TensorFlow's dtypes; NumPy scalars in a
    # tuple stay a tree (an int64 among them kept its value).
    assert ipu.horovod.allreduce([1.0, 2.0]).dtype == np.float32
    assert ipu.horovod.allgather([5]).dtype == np.int32
    pair = ipu.horovod.broadcast((np.float32(1.5), np.int64(2**60 + 1)), 0)
    assert int(pair[1]) == 2**60 + 1 and pair[0].dtype == np.float32


def test_the_replica_counts_follow_the_launchers_ipus_per_replica(monkeypatch):
    # As `shard_for_instance` counts them: 2 IPUs per replica on 4 IPUs are 2 replicas.
    configure(4)
    assert ipu.distributed.num_global_replicas() == 4
    monkeypatch.setenv(runtime.IPUS_PER_REPLICA_ENV, "2")
    assert ipu.distributed.num_global_replicas() == 2
    assert ipu.distributed.num_local_replicas() == 2
    assert ipu.distributed.num_global_replicas(ipus_per_replica=1) == 4


def test_helpers_across_two_instances():
    done = launch("--num-instances", "2", "--num-replicas", "4", "--", "helpers_job.py")
    assert done.returncode == 0, done.stdout + done.stderr
    for index in (0, 1):
        out = lines_of(done.stdout, index)
        assert f"index {index} of 2 global 4" in out
        assert "sum 3.0" in out
        assert "mean [0.5 1. ]" in out
        assert "gather [0, 1, 1]" in out
        assert "int mean [3, -3] int32 int32" in out  # 7 / 2 and -7 / 2, truncated
        assert "bcast 5.0 6.0" in out
        assert "ipus [0, 1, 2, 3]" in out  # the job's IPUs, numbered one by one
        assert f"hvd 1.5 3.0 [0, 1, 1] 6.0 {index} 2" in out
        assert "hvd lists [0, 1] [1.0, 2.5] [1, 2]" in out
        assert "wide 2199023255553 int64 float64 [1099511627776, 1099511627777] True" in out
        # Before: garbage in one instance, and a hang.
        assert ("mismatch dtype allreduce needs the same structure, dtypes and shapes on "
                "every instance") in out
        assert "mismatch shape broadcast needs the same structure" in out
        assert "bf16 mean 1.5" in out  # was truncated as an integer's: 1.0
        assert "scalar gather allgather needs the same structure" in out
        # Before: each instance's own value (1.0 and 2.0), and weights that parted silently.
        assert "strategy reduce 3.0 1.5" in out
        assert ("run apply An optimizer applied in `strategy.run` or `ipu_compiler.compile` "
                "sums the gradients of this instance's replicas alone") in out


@pytest.mark.parametrize("how", ["dies", "raise"])
def test_a_failed_instance_stops_the_job_at_once_and_is_named(how):
    """Dead (`os._exit(3)`) or raising `SystemExit(3)` (whose exit would wait in JAX's
    shutdown barrier for instance 0, itself waiting in a collective for instance 1)."""
    started = time.monotonic()
    done = launch("--num-instances", "2", "failing_job.py", *(["raise"] if how == "raise" else []),
                  timeout=120)
    elapsed = time.monotonic() - started
    assert done.returncode == 3, done.stdout + done.stderr
    assert "keras-ipu run: instance 1 failed: it exited with status 3" in done.stderr
    assert "keras-ipu run: stopping instance(s) [0], still running after instance 1 failed" in (
        done.stderr)
    assert "dying" in lines_of(done.stdout, 1)
    # Instance 0 never finishes its second collective: the launcher stops it.
    assert "unreachable" not in lines_of(done.stdout, 0)
    assert elapsed < 60, elapsed  # not the shutdown barrier's 300 s


def test_fit_on_two_instances_equals_four_replicas_in_one_process(tmp_path):
    """Weights, history, metric state, evaluate and predict; `steps_per_epoch` and
    `steps` count the batches of all instances together, as in one process."""
    from multi_host import fit_cases

    with launched(tmp_path, "--num-instances", "2", "--num-replicas", "4", "--", "fit_job.py",
                  str(tmp_path)) as finished:
        configure(4)
        strategy = ipu.ipu_strategy.IPUStrategy()
        x, y = fit_cases.data()
        cases = [(name, fit_cases.run_case(strategy, name, kind, accumulation, x, y))
                 for name, kind, accumulation in fit_cases.CASES]
        done = finished()
    assert done.returncode == 0, done.stdout + done.stderr
    instances = [dict(np.load(tmp_path / f"instance{i}.npz")) for i in (0, 1)]
    for name, expected in cases:
        for key, value in expected.items():
            if key == "predict":
                # Each instance predicts its own data, in its own order.
                for index, results in enumerate(instances):
                    mine = fit_cases.instance_data(index)[0]
                    np.testing.assert_allclose(
                        results[f"{name}/predict"], keras_predict(strategy, value, x, mine),
                        rtol=1e-5, atol=1e-6)
                continue
            for index, results in enumerate(instances):
                np.testing.assert_allclose(results[f"{name}/{key}"], value, rtol=1e-5,
                                           atol=1e-6, err_msg=f"instance {index}: {name}/{key}")
    for results in instances:  # the predict batch hooks saw what predict returned
        np.testing.assert_array_equal(results["hooks/seen"], results["hooks/predict"])


def test_instances_with_different_numbers_of_batches_fail_at_once_and_say_so(tmp_path):
    """64 samples in instance 0, 32 in instance 1: `fit`, `evaluate` and `predict` raise in
    both instances before anything runs, instead of one waiting in a collective until
    JAX's shutdown timeout (300 s)."""
    started = time.monotonic()
    done = launch("--num-instances", "2", "--num-replicas", "4", "--", "fit_job.py",
                  str(tmp_path), "uneven", timeout=120)
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    assert "keras-ipu run: instance " in done.stderr
    counts = ("instance 0 has 16 batches (2 executions of 4 steps per replica), "
              "instance 1 has 8 batches (1 execution of 4 steps per replica).")
    for index in (0, 1):
        out = lines_of(done.stdout, index)
        for mode in ("fit", "evaluate", "predict"):
            assert f"{mode} raised: `{mode}` across 2 instances: " in out, out
        assert out.count(counts) == 3, out
        assert "ipu.distributed.shard_for_instance" in out
        assert "pass `steps_per_epoch`" in out and "pass `steps`" in out
        assert ("epochs raised: `fit` across 2 instances: the instances run different epochs, "
                "so the job would hang waiting for the instance that finished first: instance "
                "0 has epochs=1, initial_epoch=0, instance 1 has epochs=2, initial_epoch=0."
                ) in out, out
        assert "without an error" not in out
    assert elapsed < 60, elapsed


def test_what_would_stop_one_instance_only_is_told_or_stops_every_instance():
    # EarlyStopping (model.stop_training) in instance 0 alone hung the job; validation_freq
    # differing aborted it in gloo ("collective mismatch"); so did generators of unequal
    # lengths, or hung it.
    done = launch("--num-instances", "2", "--num-replicas", "4", "--", "disagree_job.py")
    assert done.returncode == 0, done.stdout + done.stderr
    for index in (0, 1):
        lines = lines_of(done.stdout, index)
        assert ("stop raised: `fit` across 2 instances: they disagree on model.stop_training "
                "(instance 0: [1]; instance 1: [0])") in lines, lines
        assert ("validation raised: `fit` across 2 instances: they disagree on the epochs it "
                "validates (1 for each) (instance 0: [1, 1]; instance 1: [0, 1])") in lines
        for run, mode, flag in (("batch", "fit", "training"), ("evaluate", "evaluate",
                                                               "evaluating"),
                                ("predict", "predict", "predicting")):
            assert (f"{run} stop raised: `{mode}` across 2 instances: they disagree on "
                    f"model.stop_{flag} (instance 0: [0]; instance 1: [1])") in lines, lines
        assert "agreeing fit ran 2 epochs" in lines
        # Unequal generators: one execution each (4 batches of each instance's 2 replicas).
        assert "generator fit ran 2 steps" in lines, lines
        assert "generator predict (16, 3)" in lines and "generator validation ['loss', " \
            "'val_loss']" in lines
    evaluated = {re.search(r"generator evaluate (\S+)", lines_of(done.stdout, i))[1]
                 for i in (0, 1)}
    assert len(evaluated) == 1  # the same global loss in both
    assert "The input of another instance of the job ran out of data" in done.stderr


def test_instances_configured_with_different_ipus_are_told_so():
    # Before: "give each instance the same number of batches", which they had.
    done = launch("--num-instances", "2", "--", "fit_job.py", "unused", "ipus", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for index in (0, 1):
        assert ("fit raised: `fit` across 2 instances: the instances configured different "
                "numbers of IPUs (instance 0 counts 4 replicas, instance 1 counts 2 replicas)"
                ) in lines_of(done.stdout, index)


def test_instances_describe_a_loss_as_keras_computes_it():
    from keras_ipu.keras.replication import _loss_described

    class DoubledMSE(keras.losses.MeanSquaredError):
        def call(self, y_true, y_pred):
            return 2 * super().call(y_true, y_pred)

    spellings = ["mse", "mean_squared_error", keras.losses.mean_squared_error,
                 keras.losses.MeanSquaredError(name="mine")]
    assert len({_loss_described(loss) for loss in spellings}) == 1
    assert _loss_described("sparse_categorical_crossentropy") == _loss_described(
        keras.losses.SparseCategoricalCrossentropy())
    # Before: a subclass with its own `call`, or another dtype, was described as "mse".
    for other in (DoubledMSE(), keras.losses.MeanSquaredError(dtype="bfloat16"),
                  keras.losses.MeanSquaredError(reduction="sum"),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True)):
        assert _loss_described(other) not in (_loss_described("mse"), _loss_described(
            "sparse_categorical_crossentropy")), other


def test_instances_with_different_programs_are_told_what_differs():
    # Before: the job aborted in gloo ("collective mismatch", status 134), naming nothing.
    done = launch("--num-instances", "2", "--num-replicas", "4", "--", "fit_job.py", "unused",
                  "programs", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = {
        "width": "instance 0 has 'trainable_variables[0]: float32[6, 8]' where instance 1 "
                 "has 'trainable_variables[0]: float32[6, 16]'",
        "options": "instance 0 has 'option gradient_accumulation_steps_per_replica: 1' "
                   "where instance 1 has 'option gradient_accumulation_steps_per_replica: 2'",
        "dtype": "instance 0 has 'batch input 0: int32[4, 6]' where instance 1 has "
                 "'batch input 0: float32[4, 6]'",
        "loss": "instance 0 has \"loss: keras.src.losses.losses.mean_squared_error{} reduced "
                "by 'sum_over_batch_size' in float32, weights None\" where instance 1 has "
                "\"loss: keras.src.losses.losses.mean_absolute_error{} reduced by "
                "'sum_over_batch_size' in float32, weights None\"",
        "loss weights": "reduced by 'sum_over_batch_size' in float32, weights [1.0]\" where "
                        "instance 1 has \"loss: keras.src.losses.losses.mean_squared_error{} "
                        "reduced by 'sum_over_batch_size' in float32, weights [2.0]\"",
        "calls": "The point the instances' runs are at differs between the 2 instances, so "
                 "their collectives would not match and the job would abort: instance 0 has "
                 "'a call of `fit`' where instance 1 has 'a call of `evaluate`'",
        "callback call": "instance 0 has 'a call of `evaluate`' where instance 1 has '`fit` "
                         "checking model.stop_training'"}
    for index in (0, 1):
        out = lines_of(done.stdout, index)
        for case, difference in expected.items():
            assert (f"{case} raised: " in out and difference in out
                    and "their collectives would not match" in out), (case, out)
        assert "prefetch ran without an error" in out, out
        assert "loss spellings ran without an error" in out, out
        assert ("host embedding raised: Host embedding 'table' is trained on its host, and "
                "each of the 2 instances") in out, out


def test_an_instance_raising_outside_the_launcher_ends_at_once_and_the_others_follow():
    # Before: the raising instance waited in JAX's shutdown barrier, the other in a
    # collective for it: both hung 300 s, then aborted (SIGABRT), its status lost.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**fresh_process_env(), "KERAS_IPU_COORDINATOR": f"127.0.0.1:{port}",
           "KERAS_IPU_NUM_INSTANCES": "2", "KERAS_IPU_HEARTBEAT_TIMEOUT": "5"}
    started = time.monotonic()
    instances = [subprocess.Popen([sys.executable, "failing_job.py", "exception"],
                                  env={**env, "KERAS_IPU_INSTANCE_INDEX": str(i)}, cwd=JOBS,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in (0, 1)]
    try:
        outputs = [instance.communicate(timeout=120) for instance in instances]
    finally:
        for instance in instances:
            instance.kill()
    elapsed = time.monotonic() - started
    assert instances[1].returncode == 1, outputs[1]
    assert "RuntimeError: instance 1 gives up" in outputs[1][1]
    assert instances[0].returncode != 0 and "unreachable" not in outputs[0][0], outputs[0]
    assert elapsed < 90, elapsed  # not the shutdown barrier's 300 s


def keras_predict(strategy, predictions, x, mine):
    """The rows of `predictions` (of all of `x`) for the samples `mine`, in its order."""
    rows = {sample.tobytes(): row for sample, row in zip(x, predictions)}
    return np.stack([rows[sample.tobytes()] for sample in mine])


def test_checkpoints_of_a_two_instance_fit_are_written_once_and_reload(tmp_path):
    done = launch("--num-instances", "2", "--num-replicas", "4", "--", "save_job.py",
                  str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    every_epoch = "seen [['ckpt_1.weights.h5'], ['ckpt_1.weights.h5', 'ckpt_2.weights.h5']]"
    for index, writes in ((0, 2), (1, 0)):
        out = lines_of(done.stdout, index)
        assert every_epoch in out  # the file exists in every instance once its epoch ends
        assert f"written {writes}" in out  # instance 0 alone writes, once per epoch
        assert "reloaded True True" in out  # ckpt and model.keras load the final weights
        # BackupAndRestore: written and removed once, by instance 0.
        assert "backup 1 ['latest.weights.h5', 'training_metadata.json']" in out
        assert "backup 3 None" in out
        assert "backup by batch ['latest.weights.h5', 'training_metadata.json']" in out
    # Instance 0 alone saving (Horovod's idiom) neither hangs nor breaks the fit's collectives.
    assert "first only ['first_only.weights.h5', 'saved_by_first.weights.h5']" in lines_of(
        done.stdout, 0)
    for index in (0, 1):  # Before: each instance trained its own weights.
        out = lines_of(done.stdout, index)
        for name in ("train_on_batch", "test_on_batch"):
            assert f"on batch `{name}` runs on this instance's IPUs alone" in out
    own = lines_of(done.stdout, 1)
    assert (f"own path Instance 0 did not save {str(tmp_path / 'own_1.weights.h5')!r} "
            "within 3 seconds") in own
    listed = next(line for line in own.splitlines() if line.startswith("own files"))
    assert "'own_1.keras'" in listed and "own_1.weights.h5" not in listed
    for index in (0, 1):
        out = lines_of(done.stdout, index)
        assert ("export ['loop.jaxexport', 'metadata.json', 'step.jaxexport', "
                "'weights.npz'] True") in out, out
        assert "event files 1" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "backup_by_batch", "ckpt_1.weights.h5", "ckpt_2.weights.h5", "export",
        "first_only.weights.h5", "model.keras",
        "own_0.keras", "own_0.weights.h5", "own_1.keras", "saved_by_first.weights.h5", "tb"]


def test_pipeline_on_two_instances_equals_two_pipelined_replicas_in_one_process(tmp_path):
    """2 instances × a 2-stage pipeline (arrays, and a PyDataset of each instance's
    data) equal a 2-stage pipeline × 2 replicas on 4 IPUs in one process."""
    from multi_host import pipeline_cases

    with launched(tmp_path, "--num-instances", "2", "--num-replicas", "2", "--ipus-per-replica",
                  "2", "--", "pipeline_job.py", str(tmp_path)) as finished:
        configure(4)
        x, y = pipeline_cases.data()
        expected = pipeline_cases.run_case(ipu.ipu_strategy.IPUStrategy(), x, y)
        done = finished()
    assert done.returncode == 0, done.stdout + done.stderr
    instances = [dict(np.load(tmp_path / f"instance{i}.npz")) for i in (0, 1)]
    for index, results in enumerate(instances):
        mine = pipeline_cases.instance_data(index)[0]
        # The host-dispatched form runs one replica: across instances the schedule program runs.
        assert "span instances" in str(results["arrays/loop"])
        for feed in pipeline_cases.FEEDS:
            for key, value in expected.items():
                if key == "loop" or f"{feed}/{key}" not in results:
                    continue  # evaluate and predict: arrays only
                if key == "predict":
                    value = keras_predict(None, value, x, mine)
                np.testing.assert_allclose(results[f"{feed}/{key}"], value, rtol=1e-5,
                                           atol=1e-6, err_msg=f"instance {index}: {feed}/{key}")


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return "\tZ" not in next(line for line in status if line.startswith("State:"))
    except FileNotFoundError:
        return False


def test_an_interrupted_launcher_starts_no_more_instances(monkeypatch):
    # Before: it went on starting instances after SIGTERM (which those never got), and
    # stopped them only when the grace period ran out.
    started = []

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        if len(started) == 3:
            signal.raise_signal(signal.SIGTERM)  # to the launcher, as `timeout` sends it
        return started[-1]

    real_popen = subprocess.Popen
    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    job = launcher.Job(sleeper, 20, "127.0.0.1:1", output=sys.stdout, errors=sys.stdout)
    begun = time.monotonic()
    assert job.run() == 128 + signal.SIGTERM
    assert len(started) == 3 and all(p.poll() is not None for p in started)
    assert time.monotonic() - begun < launcher.INTERRUPT_GRACE_SECONDS


@pytest.mark.parametrize("signum, job", [(signal.SIGINT, []), (signal.SIGTERM, ["join"])],
                         ids=["ctrl_c", "sigterm_joined"])
def test_a_signal_reaches_every_instance_and_its_workers_and_the_launcher_says_so(signum, job):
    # Before: the instances' workers were left running (and held the output 20 s), and
    # JAX's preemption service took SIGTERM: the instances trained on until killed.
    launcher_process = subprocess.Popen(
        [sys.executable, "-m", "keras_ipu", "run", "--num-instances", "2", "--num-replicas",
         "2", "--", "interrupt_job.py", *job], env=fresh_process_env(), cwd=JOBS,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    error_lines: list[str] = []
    readers = [threading.Thread(target=lambda: [lines.put(line) for line in
                                                launcher_process.stdout], daemon=True),
               threading.Thread(target=lambda: error_lines.extend(launcher_process.stderr),
                                daemon=True)]
    for reader in readers:
        reader.start()
    workers = {}
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2:  # queue.Empty past the deadline
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01)).split()
            if line[1:2] == ["ready"]:
                workers[line[0]] = int(line[2])
        launcher_process.send_signal(signum)
        signalled = time.monotonic()
        launcher_process.wait(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if launcher_process.poll() is None:
            launcher_process.kill()
            launcher_process.wait()
    for reader in readers:
        reader.join(timeout=10)
    output, errors = "".join(lines.queue), "".join(error_lines)
    assert launcher_process.returncode == 128 + signum, output + errors
    assert took < 5, errors  # no instance waited out the 10 s grace
    time.sleep(0.5)  # the kill is sent; its delivery is the kernel's
    assert not [pid for pid in workers.values() if _running(pid)]
    name = signal.Signals(signum).name
    assert f"keras-ipu run: interrupted by {name}, forwarded to every instance" in errors
    assert f"keras-ipu run: job interrupted, exiting with status {128 + signum}" in errors
    if signum == signal.SIGINT:
        for index in (0, 1):
            assert "interrupted" in lines_of(output, index)
            assert "KeyboardInterrupt" in lines_of(errors, index)


def test_a_multi_instance_reduce_inside_run_is_this_instances_and_outside_every_ones(
        monkeypatch):
    # Inside `run` (one replica: a value that is no tracer) it made a host collective while
    # tracing, and baked its result into the program.
    configure(1)
    strategy = ipu.distributed.IPUMultiReplicaStrategy()
    calls = []
    monkeypatch.setattr(runtime, "num_instances", lambda: 2)
    monkeypatch.setattr(runtime, "allreduce",
                        lambda value, op: calls.append(op) or np.asarray(value) * 2)
    inside = strategy.run(lambda: strategy.reduce("SUM", np.float32(1.0)))
    assert float(inside) == 1.0 and calls == []
    assert float(strategy.reduce("MEAN", np.float32(1.0))) == 2.0 and calls == ["mean"]


def test_a_coordinator_host_is_local_when_any_of_its_addresses_is(monkeypatch):
    # `localhost` may resolve to an IPv6 address first where IPv6 is off: before, only the
    # first address was tried, and a valid --coordinator was refused.
    unbindable = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fe80::1:2:3:4", 0, 0, 0))
    local = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: [unbindable, local])
    assert launcher._not_local("localhost") is None
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: [unbindable])
    assert "is not an address of this machine" in launcher._not_local("localhost")
