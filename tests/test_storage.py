"""Run-directory storage: atomic writes, checkpoint layouts, activation arrays, records and the lock."""

import json
import weakref

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig

from featcal.adapters import adapter_for
from storage.activations import ActivationError, ActivationStore
from storage.atomic import atomic_path, digest
from storage.checkpoint import (
    CanonicalCheckpoint,
    CheckpointError,
    TensorFiles,
    TensorSpec,
    finite,
    read_metadata,
    write_checkpoint,
    write_streamed,
)
from storage.rundir import MissingOutput, RunDir, RunDirLocked

pytest_plugins = ("tests.s3_server",)


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "half").write_text("x")
            raise RuntimeError("crash mid-write")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_digest_sees_content_changes(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"123")
    before = digest(tmp_path / "d")
    (tmp_path / "d" / "a").write_bytes(b"124")
    assert digest(tmp_path / "d") != before


def specs_of(tensors: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors]


def test_sharded_checkpoint_round_trip(tmp_path):
    tensors = [(f"t{i}", torch.full((100,), float(i))) for i in range(4)] + [
        ("bf", torch.ones(3, dtype=torch.bfloat16))
    ]
    write_checkpoint(tmp_path / "ck", specs_of(tensors), (t for _, t in tensors),
                     extra_files={"heads/a.safetensors": {"w": torch.ones(2)}}, max_shard_bytes=900)
    files = TensorFiles(tmp_path / "ck")
    assert (tmp_path / "ck" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "ck").glob("model-*.safetensors"))) == 2  # [t0 t1] [t2 t3 bf] under 900 bytes
    for name, t in tensors:
        assert torch.equal(files.get(name), t)
    assert (tmp_path / "ck" / "heads" / "a.safetensors").is_file()


def test_a_released_file_kept_as_a_spare_is_written_over_to_the_bytes_of_a_fresh_file(tmp_path):
    """A spare longer or shorter than the new file: written over in place and cut, it holds the same bytes as a
    file written afresh; claims move spares away one at a time, and what is left goes with drop_spares."""
    run = RunDir(tmp_path)
    tensors = [("a", torch.randn(40, 30, dtype=torch.float64)), ("b", torch.arange(7, dtype=torch.float32))]
    fresh = tmp_path / "fresh.safetensors"
    write_streamed(fresh, specs_of(tensors), (t for _, t in tensors))
    for size in (fresh.stat().st_size * 3, 100):
        for name in ("stats/l00/t0.safetensors", "stats/l00/t1.safetensors"):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_bytes(b"\xff" * size)
            run.release(name, "digest", reuse=True)
            assert not (tmp_path / name).exists() and run.output_ok(name, "digest")
        assert not (tmp_path / "stats" / "l00").exists()  # the directory it left empty is tidied, as on a delete
        with atomic_path(tmp_path / "stats" / "l01" / "t0.safetensors") as tmp:
            assert run.claim_spare(tmp) and tmp.stat().st_size == size
            write_streamed(tmp, specs_of(tensors), (t for _, t in tensors))
        assert (tmp_path / "stats" / "l01" / "t0.safetensors").read_bytes() == fresh.read_bytes()
        assert len(list((tmp_path / "spare").iterdir())) == 1
        run.drop_spares()
        assert not (tmp_path / "spare").exists() and not run.claim_spare(tmp_path / "x")
    run.release("stats/l01/t0.safetensors", "digest")  # not for reuse: deleted
    assert not (tmp_path / "spare").exists() and not (tmp_path / "stats" / "l01").exists()


def test_streamed_file_is_what_safetensors_reads_back(tmp_path):
    """Our header-first writer against the library's own reader, every dtype we store, 0-d and empty tensors."""
    tensors = [("w", torch.randn(5, 3, dtype=torch.float64)), ("b", torch.arange(4, dtype=torch.bfloat16)),
               ("h", torch.randn(2, 3).half()), ("m", torch.tensor([True, False, True])), ("i", torch.arange(3)),
               ("s", torch.tensor(2.5)), ("e", torch.empty(0, 7)), ("u", torch.arange(5, dtype=torch.uint8))]
    path = tmp_path / "x.safetensors"
    write_streamed(path, specs_of(tensors), (t for _, t in tensors), {"prompt": "a photo of {}"})
    back = load_file(path)
    assert sorted(back) == sorted(name for name, _ in tensors)
    for name, t in tensors:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert read_metadata(path) == {"format": "pt", "prompt": "a photo of {}"}
    assert (path.stat().st_size - 8 - sum(t.numel() * t.element_size() for _, t in tensors)) % 8 == 0


def test_streamed_checkpoint_holds_one_tensor_at_a_time(tmp_path):
    """Each tensor is written before the next is asked for: the writer keeps no reference to the one before."""
    alive: list[bool] = []
    ref: list[weakref.ref] = []

    def tensors():
        for i in range(6):
            alive.append(bool(ref) and ref[-1]() is not None)
            t = torch.full((1000,), float(i))
            ref.append(weakref.ref(t))
            yield t
            del t

    specs = [TensorSpec(f"t{i}", torch.float32, (1000,)) for i in range(6)]
    write_checkpoint(tmp_path / "ck", specs, tensors(), max_shard_bytes=10_000)
    assert alive == [False] * 6
    files = TensorFiles(tmp_path / "ck")
    assert [float(files.get(f"t{i}")[0]) for i in range(6)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(list((tmp_path / "ck").glob("model-*.safetensors"))) == 3  # 2 × 4000 bytes a shard under 10 000


@pytest.mark.parametrize("given,message", [
    ([torch.ones(3), torch.ones(4)], r"tensor b: expected torch.float32 \[3\], got torch.float32 \[4\]"),
    ([torch.ones(3), torch.ones(3).double()], r"tensor b: expected torch.float32 \[3\], got torch.float64 \[3\]"),
    ([torch.ones(3)], r"no tensor came for b: fewer tensors than specs"),
    ([torch.ones(3)] * 3, r"more tensors than the 2 its specs name"),
])
def test_streamed_checkpoint_refuses_tensors_that_do_not_fit_their_specs(tmp_path, given, message):
    specs = [TensorSpec("a", torch.float32, (3,)), TensorSpec("b", torch.float32, (3,))]
    with pytest.raises(ValueError, match=message):
        write_checkpoint(tmp_path / "ck", specs, iter(given))
    assert not (tmp_path / "ck").exists()


def test_tensors_read_back_exactly_and_a_cut_file_is_named(tmp_path):
    tensors = {"w": torch.randn(5, 3, dtype=torch.float64), "b": torch.arange(4, dtype=torch.bfloat16),
               "m": torch.tensor([True, False]), "e": torch.empty(0, 7)}
    save_file(tensors, tmp_path / "model.safetensors")
    files = TensorFiles(tmp_path)
    for name, t in tensors.items():
        assert files.get(name).dtype == t.dtype and torch.equal(files.get(name), t), name
    assert torch.equal(files.get("w", rows=(1, 3)), tensors["w"][1:3])
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor data ends after \d+ of \d+ bytes: the file "
                                              r"is cut short$"):
        [TensorFiles(tmp_path).get(name) for name in tensors]


def test_canonical_names_across_prefixes(tmp_path):
    adapter = adapter_for(BertConfig(architectures=["BertForSequenceClassification"]))
    probe = adapter.probe_key
    for name, prefix in (("bare", ""), ("prefixed", "bert.")):
        (tmp_path / name).mkdir()
        save_file(
            {prefix + probe: torch.zeros(3), prefix + "encoder.x": torch.ones(1), "classifier.weight": torch.ones(2)},
            str(tmp_path / name / "model.safetensors"),
        )
    bare, prefixed = (
        CanonicalCheckpoint(tmp_path / "bare", adapter),
        CanonicalCheckpoint(tmp_path / "prefixed", adapter),
    )
    assert bare.names() == prefixed.names() == sorted([probe, "encoder.x", "classifier.weight"])
    assert prefixed.file_name("encoder.x") == "bert.encoder.x"
    (tmp_path / "other").mkdir()
    save_file({"vision_model.something": torch.zeros(1)}, str(tmp_path / "other" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="not a checkpoint of the BertAdapter family"):
        CanonicalCheckpoint(tmp_path / "other", adapter)
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        TensorFiles(tmp_path)


def test_activation_array_streams_and_checks_rows(tmp_path):
    blocks = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones((2, 4), dtype=np.float32)]
    store = ActivationStore(str(tmp_path))
    store.write_array(str(tmp_path / "a"), (5, 4), 3, "float32", blocks)
    got = torch.cat(list(store.iter_row_blocks(str(tmp_path / "a"), 2)))
    assert torch.equal(got, torch.from_numpy(np.concatenate(blocks)))
    with pytest.raises(ActivationError, match="wrote 3 rows, expected 5"):
        store.write_array(str(tmp_path / "b"), (5, 4), 3, "float32", blocks[:1])
    assert not (tmp_path / "b").exists()
    (tmp_path / "empty").mkdir()  # a directory without an array, and no path at all: both are named
    for name in ("b", "empty"):
        with pytest.raises(ActivationError, match=f"activation array {tmp_path / name} is missing"):
            store.open_array(str(tmp_path / name))
    assert not (tmp_path / "b").exists()  # opening for reading created nothing


def test_records_verify_release_and_require(tmp_path):
    run = RunDir(tmp_path)
    (tmp_path / "out").write_text("data")
    rec = {"stage": "s/1", "key": "k", "outputs": {"out": digest(tmp_path / "out")}}
    run.save_record(rec)
    assert run.verified("s/1", "k") == rec
    assert run.verified("s/1", "other-key") is None
    run.release("out", rec["outputs"]["out"])
    assert not (tmp_path / "out").exists()
    assert run.verified("s/1", "k") == rec  # released deliberately: still done
    with pytest.raises(MissingOutput) as err:
        run.require({"out": "s/1"})
    assert err.value.producers == ["s/1"]
    assert run.verified("s/1", "k") is None  # once needed again, the release no longer counts
    (tmp_path / "out").write_text("corrupted")
    assert run.verified("s/1", "k") is None


def test_second_run_on_one_directory_is_refused(tmp_path):
    run = RunDir(tmp_path)
    with run.lock():
        with pytest.raises(RunDirLocked, match="pid"):
            with RunDir(tmp_path).lock():
                pass
    with run.lock():  # released after the first holder finished
        pass


def test_events_skip_a_line_cut_by_a_kill(tmp_path):
    run = RunDir(tmp_path)
    run.event("a", "start")
    with open(tmp_path / "records" / "events.jsonl", "a") as fh:
        fh.write('{"stage": "b", "ev')
    assert [e["stage"] for e in run.events()] == ["a"]
    assert json.loads((tmp_path / "records" / "events.jsonl").read_text().splitlines()[0])["event"] == "start"


def test_activation_store_on_s3_publishes_whole_arrays_only(s3_options, s3_bucket):
    store = ActivationStore(f"s3://{s3_bucket}/runs/r1", s3_options)
    store.check_writable()
    blocks = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones((2, 4), dtype=np.float32)]
    group = store.location("acts/t/inputs")
    assert group == f"{s3_bucket}/runs/r1/t/inputs"
    with store.staged(group) as tmp:
        store.write_array(f"{tmp}/input_ids", (5, 4), 3, "float32", blocks)
        store.write_array(f"{tmp}/attention_mask", (5, 4), 3, "float32", blocks)
        assert not store.exists(group)  # nothing under the final name until the group is complete
    assert store.array_names(group) == ["attention_mask", "input_ids"]
    got = torch.cat(list(store.iter_row_blocks(f"{group}/input_ids", 2)))
    assert torch.equal(got, torch.from_numpy(np.concatenate(blocks)))
    first = store.digest(group)
    store.write_array(f"{group}/input_ids", (5, 4), 3, "float32", blocks)  # rewritten: same bytes, same digest
    assert store.digest(group) == first
    store.write_array(f"{group}/input_ids", (5, 4), 3, "float32", blocks[::-1])
    assert store.digest(group) != first
    with pytest.raises(ActivationError, match="wrote 3 rows, expected 5"):
        store.write_array(f"{group}/more", (5, 4), 3, "float32", blocks[:1])
    store.fs.invalidate_cache()
    assert not store.exists(f"{group}/more") and not store.fs.glob(f"{group}/more.partial-*")
    with pytest.raises(ActivationError, match=rf"activation array s3://{s3_bucket}/runs/r1/t/inputs/more is missing"):
        store.open_array(f"{group}/more")
    store.remove(group)
    assert not store.exists(group)


def test_activation_store_that_cannot_be_reached_is_named(s3_options):
    with pytest.raises(ActivationError, match=r"runtime.activation_store: cannot write to s3://featcal-no-such-bucket/r"):
        ActivationStore("s3://featcal-no-such-bucket/r", s3_options).check_writable()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_counts_every_bad_value_and_passes_sums_that_overflow(dtype, tmp_path):
    big = torch.finfo(dtype).max
    overflowing = torch.full((4, 3), big, dtype=dtype)  # finite values whose sum is inf: not a bad tensor
    assert finite(overflowing, "w", "experts.a", tmp_path) is overflowing
    ints = torch.arange(6)
    assert finite(ints, "ids", "experts.a", tmp_path) is ints
    for bad, count in [((float("nan"),), 1), ((float("inf"), float("-inf")), 2), ((float("inf"),), 1)]:
        t = torch.ones(5, 7, dtype=dtype)
        t.view(-1)[: len(bad)] = torch.tensor(bad, dtype=dtype)  # +inf and −inf: a sum of NaN
        with pytest.raises(CheckpointError, match=rf"experts.a: tensor w holds {count} NaN/inf value\(s\) of 35 "):
            finite(t, "w", "experts.a", tmp_path)
