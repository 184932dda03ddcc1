"""benchmarks/goal_figures.py and the rules' --bench parser: figures read from hand-made results, checked by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import bench_arguments
from benchmarks.goal_figures import Rows

REPO = Path(__file__).resolve().parent.parent
LABELS = [0, 1, 0, 1]


def _result(bench: Path, name: str, predictions: dict[str, dict[str, list[int]]]) -> None:
    """A result as a method run writes it: per task, each model's accuracy and per-example predictions."""
    accuracy = {t: {m: sum(p == y for p, y in zip(ps, LABELS)) / len(LABELS) for m, ps in models.items()}
                for t, models in predictions.items()}
    (bench / "results").mkdir(parents=True, exist_ok=True)
    (bench / "results" / f"{name}.json").write_text(json.dumps(
        {"accuracy": accuracy, "predictions": predictions, "labels": {t: LABELS for t in predictions}}))


@pytest.fixture
def bench(tmp_path: Path) -> Path:
    right, wrong1, wrong2 = [0, 1, 0, 1], [1, 1, 0, 1], [1, 0, 0, 1]
    _result(tmp_path, "ta", {"a": {"merged": wrong2, "calibrated": wrong1},
                             "b": {"merged": wrong1, "calibrated": right}})
    _result(tmp_path, "full", {"a": {"calibrated": right}, "b": {"calibrated": right}})
    _result(tmp_path, "few", {"a": {"calibrated": wrong1}, "b": {"calibrated": wrong1}})  # draw 0: 75 % a task
    _result(tmp_path, "few_draw1", {"a": {"calibrated": wrong2}, "b": {"calibrated": right}})  # 50 %, 100 %
    _result(tmp_path, "few.check", {"a": {"calibrated": right}, "b": {"calibrated": right}})  # not a run
    return tmp_path


def test_rows_read_models_and_draws(bench):
    rows = Rows(bench)
    assert rows.tasks == ["a", "b"]
    assert rows.average("ta:merged") == pytest.approx(62.5)  # (50 + 75) / 2
    assert rows.average("ta") == pytest.approx(87.5)
    assert rows.average("few") == pytest.approx(75.0)  # draws 75 and 75
    assert rows.per_task("few") == pytest.approx({"a": 62.5, "b": 87.5})
    assert [len(c["a"]) for c in rows.correct("few")] == [4, 4]
    with pytest.raises(SystemExit, match="no result of run nope"):
        rows.average("nope")


def test_tool_picks_the_best_rows_and_the_share_of_the_gain(bench, tmp_path):
    out = tmp_path / "goal.md"
    subprocess.run([sys.executable, "-m", "benchmarks.goal_figures", "--bench", str(bench), "--title", "t",
                    "--out", str(out), "--best", "calibrated", "full=ta:merged", "few=ta:merged",
                    "--best", "plain", "ta:merged", "--few", "few=full", "--reference", "ta:merged"],
                   cwd=REPO, check=True, capture_output=True)
    text = out.read_text()
    assert "| `full` **best** | 100.00 | 1 | b +25.0 (from `ta:merged`) |" in text  # a +50, b +25
    assert "| `few` | 75.00 | 2 | a +12.5 (from `ta:merged`) |" in text
    assert "Best calibrated (`full`) minus best plain (`ta:merged`): +37.50" in text
    # gain over TA 62.5: full +37.5; few's draws +12.5 and +12.5, each a third of it
    assert ("`few` keeps 33 % of `full`'s gain over task arithmetic (75.00 against 100.00, TA 62.50; per draw 33 %, "
            "33 %)") in text


def test_bench_arguments_name_directory_split_and_rows():
    assert bench_arguments(["m=d/x", "demo=d/y:train:200"]) == {
        "m": (Path("d/x"), "validation", None), "demo": (Path("d/y"), "train", 200)}
    with pytest.raises(SystemExit, match="expected NAME=DIR"):
        bench_arguments(["just-a-dir"])
