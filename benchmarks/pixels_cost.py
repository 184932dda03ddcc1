"""What image preprocessing costs through Pillow (transformers' PIL image processor) and as tensor ops
(featcal/pixels.py) on each device given, on CLIP's settings (shortest edge 224, centre crop 224, bicubic), and how
far the two are apart: the measurement behind `InputBuilder` using the tensor path off the CPU only.

    python -m benchmarks.pixels_cost --devices cpu --out benchmarks/results/pixels_cost.md

The images are seeded smooth patterns with noise at photo sizes (one batch of one size, one of mixed sizes). On the
CPU the figure is CPU seconds of this process (the machine may be shared); on a GPU, wall seconds after a warm-up
with the device synchronised.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.common import command_line, cpu_line, sync
from featcal.pixels import device_pixels
from flows.pipeline import machine

SIZES = {"16 × 375×500": [(375, 500)] * 16,
         "16 mixed sizes": [(375, 500), (600, 230), (480, 640), (224, 224), (1000, 750), (300, 301), (77, 500),
                            (256, 256)] * 2}


def photo(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    """A smooth colour pattern with noise: resampling sees edges and flat parts, as in a photo."""
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(xx / 17.0 + c) * np.cos(yy / 23.0 - c) for c in range(3)], -1) * 100 + 128
    return Image.fromarray(np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8))


def timed(fn, device: str, repeats: int) -> float:
    """Best of `repeats` seconds of fn(): CPU seconds on the CPU, wall seconds (synchronised) elsewhere."""
    clock = time.process_time if device == "cpu" else time.perf_counter
    fn()  # warm-up: weight matrices cached, kernels loaded
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = clock()
        fn()
        sync(device)
        best = min(best, clock() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", nargs="+", default=["cpu"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from transformers import CLIPImageProcessorPil

    torch.set_num_threads(1)
    processor = CLIPImageProcessorPil()
    rows = []
    for name, sizes in SIZES.items():
        rng = np.random.default_rng(0)
        images = [photo(rng, h, w) for h, w in sizes]
        expected = processor(images, return_tensors="pt")["pixel_values"]
        pil = timed(partial(processor, images, return_tensors="pt"), "cpu", args.repeats)
        rows.append(f"| {name} | Pillow (processor) | cpu | {pil:.3f} | – | – |")
        for device in args.devices:
            pixels = device_pixels(processor, device)
            assert pixels is not None
            got = pixels(images)
            assert got is not None
            gap = (got - expected).abs()
            seconds = timed(partial(pixels, images), device, args.repeats)
            std = torch.tensor(processor.image_std).view(1, -1, 1, 1)
            levels = (gap * 255 * std).max().item()  # back to 8-bit levels, channel by channel
            rows.append(f"| {name} | tensor ops | {device} | {seconds:.3f} | {levels:.2f} "
                        f"| {(gap > 0).float().mean().item():.2%} |")
            print(rows[-1], flush=True)
    lines = [
        "# Image preprocessing: Pillow against tensor ops (featcal/pixels.py), CLIP's settings",
        "",
        f"Machine: {machine()}. CPU: {cpu_line()}. Date: {time.strftime('%Y-%m-%d %H:%M %Z')}. 1 thread. "
        f"Command: `{command_line()}`",
        "",
        "| images | path | device | seconds (best of " + str(args.repeats) + ") | largest gap (8-bit levels) "
        "| values that differ |",
        "|---|---|---|---:|---:|---:|",
        *rows,
        "",
        "Seconds: CPU seconds of this process on the CPU (the machine may be shared), wall seconds with the device "
        "synchronised elsewhere. Gap: against the processor's pixels, in 8-bit levels (1 level = 1/255 before "
        "normalisation); Pillow 13 resizes some size pairs vertically first, where the tensor path's "
        "horizontal-first passes round differently.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
