"""calibration.views: extra views of each text calibration example with tokens deleted, held out with their
example when hyperparameters are chosen on held-out rows."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from featcal.data import token_views
from flows.cli import main
from flows.pipeline import run_pipeline
from storage.rundir import RunDir
from tests.conftest import example_config, one_error_line

PAD, CLS, SEP = 0, 101, 102


def _batch() -> dict[str, torch.Tensor]:
    """Two rows: a single sentence of 10 word tokens, and a pair (4 + 3 word tokens) with right padding."""
    one = [CLS, *range(1000, 1010), SEP]
    pair = [CLS, 2000, 2001, 2002, 2003, SEP, 3000, 3001, 3002, SEP]
    width = len(one)
    ids = torch.tensor([one, pair + [PAD] * (width - len(pair))])
    mask = (ids != PAD).long()
    types = torch.tensor([[0] * width, [0] * 6 + [1] * 4 + [0] * (width - len(pair))])
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def test_each_row_is_followed_by_its_views_with_a_share_of_its_word_tokens_deleted():
    batch = _batch()
    out = token_views(batch, 3, 0.3, frozenset({CLS, SEP}), PAD, seed=7, first=0)
    assert out["input_ids"].shape == (8, batch["input_ids"].shape[1])
    for i in range(2):
        original = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert torch.equal(out["input_ids"][4 * i], batch["input_ids"][i])  # the example itself, unchanged
        words = [t for t in original if t not in (CLS, SEP)]
        seen = set()
        for v in range(1, 4):
            row, mask = out["input_ids"][4 * i + v], out["attention_mask"][4 * i + v]
            kept = row[mask.bool()].tolist()
            assert (row[~mask.bool()] == PAD).all() and mask[: len(kept)].all()  # left-aligned, then padding
            assert len(original) - len(kept) == round(0.3 * len(words))
            it = iter(original)
            assert all(t in it for t in kept)  # an order-keeping subsequence
            assert kept.count(CLS) == original.count(CLS) and kept.count(SEP) == original.count(SEP)
            seen.add(tuple(kept))
        assert len(seen) > 1  # the views differ from each other
    pair_view = out["token_type_ids"][5][out["attention_mask"][5].bool()].tolist()
    ids = out["input_ids"][5][out["attention_mask"][5].bool()].tolist()
    # segment ids travel with their tokens: the second segment starts right after the first SEP
    assert pair_view == [0] * (ids.index(SEP) + 1) + [1] * (len(ids) - ids.index(SEP) - 1)


def test_separators_are_kept_without_a_tokenizer_and_views_do_not_depend_on_the_batch():
    batch = _batch()
    whole = token_views(batch, 2, 0.5, frozenset(), PAD, seed=7, first=10)
    for i in range(2):  # the pair's middle SEP ends a segment; the first and last tokens are kept by position
        for v in range(1, 3):
            row = whole["input_ids"][3 * i + v][whole["attention_mask"][3 * i + v].bool()].tolist()
            assert row[0] == CLS and row[-1] == SEP and row.count(SEP) == (1 if i == 0 else 2)
    alone = token_views({k: v[1:] for k, v in batch.items()}, 2, 0.5, frozenset(), PAD, seed=7, first=11)
    for name in batch:
        assert torch.equal(alone[name], whole[name][3:])
    other_seed = token_views(batch, 2, 0.5, frozenset(), PAD, seed=8, first=10)
    assert not torch.equal(other_seed["input_ids"], whole["input_ids"])


@pytest.mark.usefixtures("fresh_console")
def test_views_of_images_are_refused_in_one_line(tiny_example, capsys):
    assert main(["plan", str(tiny_example / "clip" / "example.yaml"), "--set", "calibration.views.count=2"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "calibration.views.count: 2 views need token inputs" in line and "gives images" in line, line


def test_a_views_held_out_fold_holds_every_view_of_its_examples(tiny_example, tmp_path):
    """The stored inputs hold each example then its views, the example's rows bit for bit as a run without views
    stores them; block 0's held-out sums equal a brute force over the rows of the held-out examples (examples i
    with i mod 3 = 2) and all their views, read from the stored block input."""
    views, every = 2, 3
    off = {"evaluation": {"enabled": False}, "runtime": {"keep_activations": True}}
    plain = example_config(tiny_example, "bert", featcal={"lambda": "auto", "holdout_every": every}, **off)
    run_pipeline(plain, tmp_path / "plain")
    cfg = example_config(tiny_example, "bert", featcal={"lambda": "auto", "holdout_every": every},
                         calibration__views={"count": views}, **off)
    run_pipeline(cfg, tmp_path / "views")
    task, run = cfg.tasks[0], RunDir(tmp_path / "views")
    ids = run.store.open_array(run.store.location(f"{run.inputs(task)}/input_ids"))[:]
    base = RunDir(tmp_path / "plain").store
    plain_ids = base.open_array(base.location(f"{RunDir(tmp_path / 'plain').inputs(task)}/input_ids"))[:]
    n = plain_ids.shape[0]
    assert ids.shape[0] == n * (1 + views) and np.array_equal(ids[:: 1 + views], plain_ids)
    mask = torch.from_numpy(run.store.open_array(run.store.location(f"{run.inputs(task)}/attention_mask"))[:])
    assert not np.array_equal(ids[1:: 1 + views], plain_ids)  # views are not copies
    x = torch.from_numpy(run.store.open_array(run.store.location(run.acts(task, 0, "merged")))[:]).double()
    held_example = (torch.arange(mask.shape[0]) // (1 + views)) % every == every - 1
    w = (mask * held_example[:, None]).reshape(-1).double()
    stats = load_file(tmp_path / "views" / run.stats(task, 0))
    key = next(k for k in stats if k.endswith(":held_ss") and "query" in k)
    expected = (x * w[:, None]).T @ x
    torch.testing.assert_close(stats[key], expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    record = run.record(f"prepare/{task}")["info"]
    assert record["views_per_example"] == views and record["examples"] == n


def test_stage_keys_leave_out_fields_added_later_while_they_are_off():
    """Runs made before calibration.views and featcal.lambda_choice existed resume from their cache: with those off,
    the sections stage keys hold are what they were."""
    from flows.pipeline import keyed

    before = {"examples_per_task": 8, "seed": 42}
    assert keyed({**before, "views": {"count": 0, "drop": 0.3}}) == before
    assert keyed({**before, "views": {"count": 2, "drop": 0.15}})["views"]["count"] == 2
    assert keyed({"lambda": "auto", "lambda_choice": "lowest"}) == {"lambda": "auto"}
    assert keyed({"lambda_choice": "one_standard_error"}) == {"lambda_choice": "one_standard_error"}
