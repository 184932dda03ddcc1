"""Runs the official FeatCal code on `pipeline_cost.py`'s synthetic ViT-B/32-shaped inputs, for `vs_official.py`.

    PYTHONPATH=CHECKOUT/src python benchmarks/official_driver.py --official CHECKOUT \
        --work /tmp/featcal-bench/vit-b32 --experts 8 \
        --examples 32 --threads 1 --out RUN_DIR [--device cuda]

The checkout (github.com/egangu/featcal, read-only, outside this repository) is imported from `CHECKOUT/src`, which
the caller puts first on PYTHONPATH (`vs_official` does); its package is also named `featcal`, so this script must not
import this project's modules and runs in its own process, started by its path rather than as `benchmarks.X`.
Its entry point (`run_ta8.py`) reads Hugging Face hub datasets through a CLIP processor; here its two data hooks
(`load_task_dataset`, `make_clip_loader`) are replaced by the same on-disk pixel tensors our run reads, in order,
batch 16; under transformers 5, whose CLIPVisionModel has no `vision_model` attribute, that attribute is
the model itself. Everything else is the official code as published: Task Arithmetic at its default scaling, then
`CLIPFeatCalibrator.calibrate` with its `FeatCalConfig` defaults (λ = 0.05, ρ = 2.2, α = 0.25, ε = 1e-8), the same
as our config's defaults. Writes RUN_DIR/calibrated/model.safetensors and RUN_DIR/timing.json (seconds from the
merge to the saved model, i.e. without interpreter start and imports)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--official", type=Path, required=True, help="checkout of github.com/egangu/featcal")
    parser.add_argument("--work", type=Path, required=True, help="pipeline_cost.py's inputs: base, experts, data")
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--examples", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--scaling", type=float, default=0.3, help="Task Arithmetic scaling (ours: merge.scaling)")
    parser.add_argument("--device", default="cpu", help="the calibrator's device (cpu, cuda, cuda:N)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    source = (args.official / "src").resolve()
    if not (source / "featcal" / "featcal.py").is_file():
        raise SystemExit(f"--official {args.official}: no src/featcal/featcal.py; expected a checkout of "
                         "github.com/egangu/featcal")

    import torch
    from datasets import load_from_disk
    from torch.utils.data import DataLoader
    from transformers import CLIPVisionModel

    # The official checkout's package (its src/ is first on the path), which ships no type information.
    import featcal
    import featcal.featcal as official  # type: ignore[import-untyped]
    from featcal.merge import save_vision_model, task_arithmetic_merge  # type: ignore[import-untyped]
    from featcal.models import load_vision_model  # type: ignore[import-untyped]

    if Path(featcal.__file__).resolve().parent != source / "featcal":
        raise SystemExit(f"imported featcal from {featcal.__file__}, expected the checkout at {source} "
                         "first on PYTHONPATH")
    torch.set_num_threads(args.threads)
    tasks = [f"task{t}" for t in range(args.experts)]

    def task_pixels(task: str, split: str, cache_dir: object = None) -> torch.Tensor:
        ds = load_from_disk(str(args.work / "data" / task)).with_format("torch")
        return ds["pixel_values"][: args.examples]

    def pixel_batches(pixels: torch.Tensor, processor: object, *, batch_size: int, **_: object) -> DataLoader:
        # A tensor is a map-style dataset (__getitem__, __len__); torch's stubs ask for a Dataset.
        return DataLoader(pixels, batch_size=batch_size, shuffle=False)  # type: ignore[arg-type]

    official.load_task_dataset = task_pixels
    if not hasattr(CLIPVisionModel, "vision_model"):
        # transformers 5 flattened CLIPVisionModel (its embeddings and encoder are its own children); the official
        # code reaches them through the 4.x attribute `vision_model`, which is the model itself here.
        CLIPVisionModel.vision_model = property(lambda self: self)  # type: ignore[attr-defined]  # added here
    official.make_clip_loader = pixel_batches

    start = time.perf_counter()
    experts = {t: str(args.work / "experts" / t) for t in tasks}
    merged = task_arithmetic_merge(base_model_id=str(args.work / "base"), expert_model_ids=experts,
                                   scaling_factor=args.scaling)
    config = official.FeatCalConfig(num_calibration_examples=args.examples)
    device = torch.device(args.device)
    calibrator = official.CLIPFeatCalibrator(config, processor=None, device=device)
    calibrated = calibrator.calibrate(merged_model=merged, base_model=load_vision_model(args.work / "base"),
                                      expert_models=official.load_expert_models(experts), tasks=tasks)
    save_vision_model(calibrated, args.out / "calibrated")
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    (args.out / "timing.json").write_text(json.dumps({"calibration_s": seconds, "config": vars(config),
                                                      "device": str(device), "peak_device_gib": peak}))


if __name__ == "__main__":
    main()
