"""Degenerate set-ups (featcal/setup_checks.py): each named in `featcal plan` and in the run's log, report.md and
manifest, or refused in one line with `--strict` (and always where the result would be meaningless), with no run
directory created. Also the checkpoint scan that refuses NaN/inf and truncated tensor data before the run directory
is touched (issue 29 §4). Table-driven over the tiny BERT example, as tests/test_bad_input.py."""

import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import save_file

from featcal.modeling import Skeleton
from featcal.setup_checks import (
    NEAR_ZERO,
    expected_head,
    identical_pairs,
    overlap_count,
    row_digests,
    scan_checkpoints,
    squared_distance,
    task_vector_warnings,
)
from flows.cli import main
from storage.checkpoint import CanonicalCheckpoint, CheckpointError
from tests.conftest import one_error_line, plan_or_run_args
from tests.tiny_example_inputs import (
    copied_bert_example,
    edit_example_yaml,
    edit_split,
    own_checkpoint_copy,
    rewrite_tensors,
)

pytestmark = pytest.mark.usefixtures("fresh_console")

PROBE = "bert.encoder.layer.2.output.dense.weight"  # a body tensor late in the file: the scan reads all before it


def _body_of_base(scale: float):
    """The expert's head on the base's body times (1 + scale): a task vector of relative norm `scale` (0: none)."""
    def change(tensors, base):
        return {k: base[k.removeprefix("bert.")] * (1 + scale) if k.removeprefix("bert.") in base else v
                for k, v in tensors.items()}
    return change


def _without_head(tensors, _base):
    return {k: v for k, v in tensors.items() if not k.startswith("classifier.")}


def _nan(tensors, _base):
    tensors[PROBE][0, 3] = math.nan
    return tensors


def _truncate_data(root: Path, field: str) -> None:
    """The header intact, the tensor data cut short: the header check passes, the first full read fails."""
    path = own_checkpoint_copy(root, field) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4096])


def _same_content(root: Path) -> None:
    """experts.negation: a copy of experts.count under another path."""
    own_checkpoint_copy(root, "experts/count")
    (root / "experts" / "count2").mkdir()
    for f in (root / "experts" / "count").iterdir():
        (root / "experts" / "count2" / f.name).write_bytes(f.read_bytes())
    edit_example_yaml(root, lambda raw: raw["experts"].__setitem__("negation", "experts/count2"))


def _calibration_rows_in_test(n: int):
    """The test split with the first `n` calibration rows added."""
    def change(root: Path) -> None:
        cal = datasets.load_from_disk(str(root / "data" / "negation"))["calibration"].select(range(n))
        edit_split(root, "negation", "test", lambda ds: datasets.concatenate_datasets([ds, cal.cast(ds.features)]))
    return change


# (id, how the set-up is made, the words its line holds, refused even without --strict)
CASES = [
    ("expert-is-base", lambda r: edit_example_yaml(r, lambda raw: raw["experts"].__setitem__("topic", "base")),
     ["experts.topic:", "is the base checkpoint itself", "task vector is zero"], False),
    ("zero-task-vector", lambda r: rewrite_tensors(r, "experts/topic", _body_of_base(0.0)),
     ["experts.topic:", "its body equals the base's", "task vector is zero"], False),
    ("near-zero-task-vector", lambda r: rewrite_tensors(r, "experts/negation", _body_of_base(1e-6)),
     ["experts.negation:", "near-zero task vector, ‖θ_t − θ0‖/‖θ0‖ = ", f"below {NEAR_ZERO:g}"], False),
    ("two-tasks-one-path",
     lambda r: edit_example_yaml(r, lambda raw: raw["experts"].__setitem__("negation", "experts/count")),
     ["experts.count and experts.negation are the same checkpoint", "counts twice"], False),
    ("two-tasks-same-content", _same_content,
     ["experts.count and experts.negation are checkpoints of identical content", "count2"], False),
    ("calibration-is-evaluation", lambda r: edit_example_yaml(
        r, lambda raw: raw["evaluation"]["data"]["topic"].update(split="calibration")),
     ["evaluation.data.topic:", "64 of its 64 rows are also calibration rows"], False),
    ("calibration-rows-in-evaluation", _calibration_rows_in_test(10),
     ["evaluation.data.negation:", "10 of its 210 rows are also calibration rows"], False),
    ("expert-without-head", lambda r: rewrite_tensors(r, "experts/topic", _without_head),
     ["experts.topic:", "lacks the head tensors ['classifier.bias', 'classifier.weight']", "chance"], True),
    ("expert-nan", lambda r: rewrite_tensors(r, "experts/count", _nan),
     ["experts.count: tensor encoder.layer.2.output.dense.weight holds 1 NaN/inf value(s)", "experts/count"], True),
    ("base-nan", lambda r: rewrite_tensors(r, "base", lambda t, _: {
        **t, "encoder.layer.0.output.dense.bias": torch.full_like(t["encoder.layer.0.output.dense.bias"], math.inf)}),
     ["base: tensor encoder.layer.0.output.dense.bias holds", "NaN/inf"], True),
    ("expert-data-truncated", lambda r: _truncate_data(r, "experts/negation"),
     ["experts.negation: tensor", "model.safetensors: tensor data ends after", "cut short"], True),
]
WARNED = [c for c in CASES if not c[3]]


@pytest.mark.parametrize("case,makes,words,refused", CASES, ids=[c[0] for c in CASES])
def test_plan_names_each_degenerate_set_up(tiny_example, tmp_path, capsys, case, makes, words, refused):
    """Without --strict: a warning line of the plan, exit 0; or, where the result would be meaningless, one line."""
    root = copied_bert_example(tiny_example, tmp_path)
    makes(root)
    capsys.readouterr()
    code = main(["plan", str(root / "example.yaml")])
    out, err = capsys.readouterr()
    if refused:
        assert code == 2
        line = one_error_line(err)
    else:
        assert code == 0, err
        warned = [line for line in out.splitlines() if line.startswith("warning           ")]
        line = next((w for w in warned if words[0] in w), "")
        assert len(warned) == 1 + (case == "expert-is-base"), out
        if case == "expert-is-base":  # the base, a BertModel, has no head either: a second line
            assert f"warning           experts.topic: {(root / 'base').resolve()} has no task head: the task is " \
                   "calibrated but its accuracy is not measured" in warned
    for word in words:
        assert word in line, (word, line)


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case,makes,words,refused", CASES, ids=[c[0] for c in CASES])
def test_strict_refuses_in_one_line_and_writes_nothing(tiny_example, tmp_path, capsys, command, case, makes, words,
                                                       refused):
    root = copied_bert_example(tiny_example, tmp_path)
    makes(root)
    capsys.readouterr()
    run_dir = tmp_path / "run"
    assert main([*plan_or_run_args(command, root / "example.yaml", run_dir), "--strict"]) == 2
    line = one_error_line(capsys.readouterr().err)
    if not refused:
        assert "runtime.strict (--strict) refuses degenerate set-ups: " in line
    for word in words:
        assert word in line, (word, line)
    assert not run_dir.exists()


@pytest.mark.parametrize("case,makes,words,refused", [c for c in CASES if c[3]], ids=[c[0] for c in CASES if c[3]])
def test_a_refused_run_writes_nothing(tiny_example, tmp_path, capsys, case, makes, words, refused):
    """Before issue 29 §4 a NaN expert or a truncated file was refused by the merge stage, after .lock,
    manifest.json, run.yaml and records/ existed."""
    root = copied_bert_example(tiny_example, tmp_path)
    makes(root)
    capsys.readouterr()
    run_dir = tmp_path / "run"
    assert main(["run", "--no-prefect", str(root / "example.yaml"), "--run-dir", str(run_dir)]) == 2
    line = one_error_line(capsys.readouterr().err)
    for word in words:
        assert word in line, (word, line)
    assert not run_dir.exists()


def test_a_run_with_degenerate_set_ups_lists_them_in_its_report(tiny_example, tmp_path, capsys, caplog):
    """Without --strict the run completes, and the log, report.md, report.json and manifest.json name each one."""
    root = copied_bert_example(tiny_example, tmp_path)
    rewrite_tensors(root, "experts/topic", _body_of_base(0.0))
    edit_example_yaml(root, lambda raw: raw["experts"].__setitem__("negation", "experts/count"))
    edit_example_yaml(root, lambda raw: raw["evaluation"]["data"]["count"].update(split="calibration"))
    run_dir = tmp_path / "run"
    assert main(["run", "--no-prefect", str(root / "example.yaml"), "--run-dir", str(run_dir)]) == 0
    expected = [
        f"experts.topic: its body equals the base's ({root.resolve() / 'experts/topic'}): its task vector is zero, so "
        "the task adds nothing to the merge and calibration aims at the base's own features",
        f"experts.count and experts.negation are the same checkpoint {root.resolve() / 'experts/count'}: its task "
        "vector counts twice in the merge",
        "evaluation.data.count: 64 of its 64 rows are also calibration rows (same raw input values): the report "
        "overstates what calibration wins back on unseen data",
    ]
    assert json.loads((run_dir / "manifest.json").read_text())["warnings"] == expected
    assert json.loads((run_dir / "report.json").read_text())["warnings"] == expected
    report = (run_dir / "report.md").read_text()
    assert "## Warnings\n\n" + "\n".join(f"- {w}" for w in expected) + "\n" in report
    logged = [line for line in capsys.readouterr().err.splitlines() if " WARNING " in line]
    assert [line.split(" WARNING ", 1)[1] for line in logged if "task vector" in line or "rows are" in line] == expected


# ---- the detection functions against brute force ---------------------------------------------------------------
class _Adapter:
    """What CanonicalCheckpoint needs of an adapter: names as stored, one probe tensor."""
    file_prefixes, file_renames, probe_key = ("",), (), "w"


def _checkpoint(tmp_path: Path, name: str, tensors: dict[str, torch.Tensor]) -> CanonicalCheckpoint:
    (tmp_path / name).mkdir()
    save_file(tensors, tmp_path / name / "model.safetensors")
    return CanonicalCheckpoint(tmp_path / name, _Adapter())


def test_scan_matches_brute_force_norms_and_finds_identical_experts(tmp_path, monkeypatch):
    """Large tensors are read by rows (forced here with a tiny chunk): the same norms and pairs as whole reads."""
    import featcal.merging
    import featcal.setup_checks

    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(40, 7, generator=g), "b": torch.randn(7, generator=g),
            "classifier.w": torch.randn(3, 7, generator=g), "ids": torch.arange(5)}
    tau = {k: 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v * 0 for k, v in base.items()}
    experts = {
        "experts.a": {k: v + tau[k] for k, v in base.items()},
        "experts.b": {**base, "classifier.w": torch.randn(3, 7, generator=g)},  # only its head differs
        "experts.c": {k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in base.items()},
    }
    # The same sums as a (its head negated: the same squares), other content.
    experts["experts.e"] = {**experts["experts.a"], "classifier.w": -experts["experts.a"]["classifier.w"]}
    experts["experts.d"] = {k: v.clone() for k, v in experts["experts.a"].items()}
    ckpts = {o: _checkpoint(tmp_path, o, t) for o, t in experts.items()}
    is_head = lambda n: n.startswith("classifier.")  # noqa: E731
    whole = scan_checkpoints(_checkpoint(tmp_path, "base", base), ckpts, is_head)
    monkeypatch.setattr(featcal.setup_checks, "chunk_rows",
                        lambda shape, cfg: featcal.merging.chunk_rows(shape, cfg, max_elements=20))  # w: 2 rows a read
    monkeypatch.setattr(featcal.setup_checks, "_PIECE", 3)
    by_rows = scan_checkpoints(CanonicalCheckpoint(tmp_path / "base", _Adapter()), ckpts, is_head)
    body = [k for k in base if not is_head(k)]
    norm0 = math.sqrt(sum(float(base[k].double().square().sum()) for k in body))
    for owner, tensors in experts.items():
        diff = math.sqrt(sum(float((tensors[k].double() - base[k].double()).square().sum()) for k in body))
        assert whole[owner].relative_norm == pytest.approx(diff / norm0, rel=1e-8)  # float32 differences
        assert by_rows[owner].relative_norm == pytest.approx(diff / norm0, rel=1e-8)
    assert whole["experts.b"].relative_norm == 0.0
    assert 1e-4 < whole["experts.c"].relative_norm < 1e-2  # bf16 rounding is not a near-zero task vector
    brute = [(a, b) for i, a in enumerate(experts) for b in list(experts)[i + 1:]
             if all(torch.equal(experts[a][k], experts[b][k]) for k in base)]
    assert brute == [("experts.a", "experts.d")]
    assert whole["experts.a"].signature == whole["experts.e"].signature  # the candidates byte comparison rules out
    assert identical_pairs(ckpts, whole) == identical_pairs(ckpts, by_rows) == brute


@pytest.mark.parametrize("where", ["base", "body", "head"])
def test_scan_refuses_non_finite_values(tmp_path, where):
    base = {"w": torch.ones(2, 2), "classifier.w": torch.ones(2)}
    expert = {"w": torch.full((2, 2), 2.0), "classifier.w": torch.ones(2)}
    bad, name = (base, "w") if where == "base" else (expert, "w" if where == "body" else "classifier.w")
    bad[name] = bad[name].clone().reshape(-1)
    bad[name][1] = math.nan if where != "head" else -math.inf
    bad[name] = bad[name].reshape(base[name].shape)
    owner = "base" if where == "base" else "experts.x"
    with pytest.raises(CheckpointError, match=rf"^{owner}: tensor {name} holds 1 NaN/inf value\(s\) of "):
        scan_checkpoints(_checkpoint(tmp_path, "base", base), {"experts.x": _checkpoint(tmp_path, "x", expert)},
                         lambda n: n.startswith("classifier."))


def test_squared_distance_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(1000, 3, generator=g), torch.randn(1000, 3, generator=g).to(torch.bfloat16)
    assert squared_distance(x) == pytest.approx(float((x.double() ** 2).sum()), rel=1e-12)
    # Differences in float32 (bf16 widened first), squares summed in float64; within 1e-6 of float64 differences.
    assert squared_distance(x, y) == pytest.approx(float(((x - y.float()).double() ** 2).sum()), rel=1e-12)
    assert squared_distance(x, y) == pytest.approx(float(((x.double() - y.double()) ** 2).sum()), rel=1e-6)
    assert squared_distance(x.double(), y.double()) == pytest.approx(float(((x.double() - y.double()) ** 2).sum()),
                                                                     rel=1e-12)
    assert squared_distance(x, x) == 0.0
    assert math.isinf(squared_distance(torch.tensor([1.0, math.inf])))


def test_task_vector_warnings_by_kind(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "base")
    experts = {"a": str(tmp_path / "link"), "b": "/x/b", "c": "/x/c", "d": "/x/d", "e": "/x/e", "f": "/x/d"}
    norms = {"a": 0.0, "b": 0.0, "c": NEAR_ZERO / 2, "d": NEAR_ZERO, "e": 0.5, "f": NEAR_ZERO}
    warnings = task_vector_warnings(str(tmp_path / "base"), experts, norms, [("d", "e")])
    assert [w.split(":")[0] for w in warnings] == [
        "experts.a", "experts.b", "experts.c",
        "experts.d and experts.e are checkpoints of identical content (/x/d, /x/e)",
        "experts.d and experts.f are the same checkpoint /x/d"]
    assert "is the base checkpoint itself" in warnings[0] and "its body equals the base's" in warnings[1]
    assert f"= {NEAR_ZERO / 2:.2g} over the body" in warnings[2]  # NEAR_ZERO itself is not below the threshold


def test_row_digests_and_overlap_match_brute_force():
    cal = datasets.Dataset.from_dict({"text": ["a", "b", "c", "a"], "pair": ["x", "y", "z", "w"],
                                      "label": [0, 1, 0, 1]})
    ev = datasets.Dataset.from_dict({"text": ["a", "b", "d", "a"], "pair": ["x", "q", "z", "x"], "label": [1, 1, 1, 1]})
    for columns in (["text"], ["text", "pair"]):
        seen = {tuple(r[c] for c in columns) for r in cal}
        brute = sum(tuple(r[c] for c in columns) in seen for r in ev)
        assert overlap_count(row_digests(cal, columns), row_digests(ev, columns)) == brute
    assert overlap_count(row_digests(cal, ["text"]), row_digests(ev, ["text"])) == 3
    assert overlap_count(row_digests(cal, ["text", "pair"]), row_digests(ev, ["text", "pair"])) == 2
    ids = datasets.Dataset.from_dict({"input_ids": [[1, 2], [1, 2, 3]]})
    assert overlap_count(row_digests(ids, ["input_ids"]), row_digests(ids.select([1]), ["input_ids"])) == 1
    assert len(set(row_digests(ids, ["input_ids"]))) == 2


def test_expected_head_is_what_the_class_holds(tiny_example):
    from transformers import AutoConfig, BertForSequenceClassification, BertModel

    expert = AutoConfig.from_pretrained(tiny_example / "bert" / "experts" / "topic")
    base = AutoConfig.from_pretrained(tiny_example / "bert" / "base")
    brute = sorted(n for n in BertForSequenceClassification(expert).state_dict() if n.startswith("classifier."))
    assert expected_head(Skeleton(expert)) == brute == ["classifier.bias", "classifier.weight"]
    base_head = [n for n in BertModel(base).state_dict() if n.startswith("classifier.")]
    assert expected_head(Skeleton(base)) == base_head == []


def test_row_digests_of_images_are_their_bytes():
    """Two copies of one image (other arrays, one encoding) are one row; another image is not."""
    import numpy as np
    from PIL import Image

    pixels = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    images = [Image.fromarray(pixels.copy()), Image.fromarray(pixels.copy()), Image.fromarray(pixels[::-1].copy())]
    ds = datasets.Dataset.from_dict({"image": images}, features=datasets.Features({"image": datasets.Image()}))
    digests = row_digests(ds, ["image"])
    assert digests[0] == digests[1] != digests[2]
    assert overlap_count(digests[:1], digests) == 2
