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
