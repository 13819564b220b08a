"""The README's first command runs this demo: it must train and report."""

from __future__ import annotations

from keras_ipu import cli, demo


def test_demo_trains_replicated_and_prints_the_report():
    lines = []
    result = demo.run(num_ipus=2, epochs=2, gradient_accumulation=2, pipelined=False,
                      print_fn=lines.append)
    history = result["history"]
    assert history["loss"][1] < history["loss"][0]
    assert result["evaluation"][1] > 0.5  # 10 classes: chance is 0.1
    report = result["report"]
    assert [ipu.index for ipu in report.ipus] == [0, 1] and report.replicas == 2
    text = "\n".join(lines)
    assert "effective batch size 128" in text and "est. cycles" in text


def test_cli_rejects_unknown_commands(capsys):
    assert cli.main(["train"]) == 2
    assert "unknown command 'train'; commands: demo, show, run" in capsys.readouterr().err


def test_demo_trains_pipelined_and_replicated():
    lines = []
    result = demo.run(num_ipus=4, epochs=2, print_fn=lines.append)
    assert result["evaluation"][1] > 0.5
    report = result["report"]
    assert [ipu.index for ipu in report.ipus] == [0, 1, 2, 3] and report.replicas == 2
    assert report.pipeline.schedule == "Grouped" and report.pipeline.num_stages == 2
    assert "2-stage pipeline, 2 replica(s)" in "\n".join(lines)


def test_bad_demo_arguments_are_one_line_errors(capsys):
    import pytest

    for args, message in ((["--ipus", "1"], "--ipus must be at least 2 (a 2-stage pipeline"),
                          (["--ipus", "0", "--no-pipeline"], "--ipus must be at least 1, got 0"),
                          (["--steps-per-execution", "0"], "--steps-per-execution must be at")):
        with pytest.raises(SystemExit) as exited:
            demo.main(args)
        assert exited.value.code == 2 and message in capsys.readouterr().err
    # Numbers keras_ipu refuses: its own message, before anything trains.
    assert demo.main(["--ipus", "2", "--steps-per-execution", "7", "--epochs", "1"]) == 2
    assert ("the current `steps_per_execution` value (set to 7) is not divisible by "
            "`gradient_accumulation_steps_per_replica` (5)" in capsys.readouterr().err)


def test_the_demo_trains_on_any_number_of_ipus():
    # Its data are whole executions of every replica: 16 IPUs (a POD16) are 8 replicas of
    # 2 stages, which 3,840 samples in batches of 32 did not fit ("divisor of ... (15)").
    lines = []
    result = demo.run(num_ipus=16, epochs=1, print_fn=lines.append)
    assert result["report"].replicas == 8 and len(result["report"].ipus) == 16
    assert "2-stage pipeline, 8 replica(s)" in "\n".join(lines)
