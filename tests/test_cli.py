"""The `featcal` command line: plan computes nothing, bad input exits 2 with the field named."""

from flows.cli import main
from tests.conftest import torch_threads_restored


def test_plan_lists_blocks_modules_and_estimates(tiny_example, tmp_path, capsys):
    assert main(["plan", str(tiny_example / "bert" / "example.yaml")]) == 0
    out = capsys.readouterr().out
    assert "BertForSequenceClassification" in out
    assert "blocks            3" in out and "attention.self.query" in out and "output.LayerNorm" in out
    assert "count (64 ex), negation (64 ex), topic (64 ex)" in out
    assert "GiB" in out and "stages            24" in out


def test_bad_override_is_named_and_exits_2(tiny_example, tmp_path, capsys):
    config = str(tiny_example / "bert" / "example.yaml")
    assert main(["run", config, "--run-dir", str(tmp_path / "r"), "--set", "featcal.alpha=2", "--no-prefect"]) == 2
    err = capsys.readouterr().err
    assert "featcal.alpha" in err and "less than or equal to 1" in err
    assert not (tmp_path / "r").exists()
    assert main(["plan", config, "--set", "featcal.lamda=0.1"]) == 2
    assert "featcal.lamda" in capsys.readouterr().err


def test_run_prints_where_the_results_are(tiny_example, tmp_path, capsys):
    config = str(tiny_example / "bert" / "example.yaml")
    assert (
        main(["run", config, "--run-dir", str(tmp_path / "r"), "--no-prefect", "--set", "evaluation.enabled=false"])
        == 0
    )
    out = capsys.readouterr().out
    assert f"calibrated checkpoint: {tmp_path / 'r' / 'calibrated'}" in out
    assert (tmp_path / "r" / "calibrated" / "model.safetensors").is_file()


def test_runtime_threads_is_applied(tiny_example, tmp_path):
    """A count other than the session's (one thread: tests/conftest.py), so the check can fail."""
    import torch

    wanted = torch.get_num_threads() + 1
    with torch_threads_restored():
        args = ["run", str(tiny_example / "bert" / "example.yaml"), "--run-dir", str(tmp_path / "r"), "--no-prefect",
                "--set", "evaluation.enabled=false", "--set", f"runtime.threads={wanted}"]
        assert main(args) == 0
        assert torch.get_num_threads() == wanted


def test_errors_are_one_line_unless_debug_asks_for_the_traceback(tiny_example, tmp_path, capsys):
    args = ["run", str(tiny_example / "bert" / "example.yaml"), "--run-dir", str(tmp_path / "r"), "--no-prefect",
            "--set", "calibration.data.topic.column=txt"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == ("featcal: error: calibration.data.topic.column: 'txt' is not a column of the data (it has "
                   "['text', 'label'])\n")
    assert main([*args, "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "featcal/data.py" in err
    assert err.endswith("featcal: error: calibration.data.topic.column: 'txt' is not a column of the data (it has "
                        "['text', 'label'])\n")
