"""A base's image processor run as batched tensor ops on an accelerator: resize, centre crop, rescale, normalise.

Why: transformers' PIL image processor resizes one image at a time on the host, so `prepare` runs at the rate of one
CPU core whatever the accelerator. Here only decoding and the RGB conversion stay on the host (the processor's own
`process_image`); the rest runs on `device`, images of one size together. Pillow's 8-bit resampling is integer
arithmetic: each pass (horizontal, then vertical) sums pixel × weight with the weights in fixed point (22
fractional bits), adds half a unit, shifts and clamps to 0–255. Those sums are integers below 2**31, which float64
holds exactly whatever the order of the additions, so a float64 product with a weight matrix reproduces each pass
bit for bit on any device; the weights are computed here in the same double arithmetic, in the same order, as
Pillow's `precompute_coeffs`.

One difference remains: for some pairs of sizes the Pillow we run (13.0) does the vertical pass first, by a rule
its source (as far as we have read it) does not show; there the 8-bit rounding between the passes falls elsewhere
and a value can differ by a level or two (1/255 each before normalisation; at most 2 over 16 mixed photo sizes in
benchmarks/results/pixels_cost.md). tests/test_pixels.py checks each pass bit for bit, whole images bit for bit
where Pillow goes horizontally first, and bounds one vertical-first case. On the CPU Pillow itself stays faster
(about 3-4x in CPU seconds there: it sums only a window of taps), so `featcal.data.InputBuilder` uses this off the
CPU only, and the input cache keys the two apart.

Processors or images this does not cover (another backend, a resample filter other than bilinear or bicubic, padding,
images that are not 8-bit RGB or grey PIL images, a crop larger than the resized image) go through the processor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

PRECISION_BITS = 22  # Pillow's fixed-point weights: 32 bits less 8 for the pixel and 2 for overshoot and sign
BILINEAR, BICUBIC = 2, 3  # PIL.Image.Resampling values


def _bilinear(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def _bicubic(x: float) -> float:
    """Keys' cubic with a = -0.5, term for term as Pillow evaluates it (the weights' last bit depends on it)."""
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


FILTERS: dict[int, tuple[Callable[[float], float], float]] = {BILINEAR: (_bilinear, 1.0), BICUBIC: (_bicubic, 2.0)}


@lru_cache(maxsize=256)
def resample_matrix(in_size: int, out_size: int, resample: int) -> torch.Tensor:
    """[in_size, out_size] float64: output pixel i is Σ_x in[x] · M[x, i] with Pillow's fixed-point weights (integers,
    zero outside pixel i's window), computed in the same double arithmetic and order as Pillow's coefficients."""
    fn, support = FILTERS[resample]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support *= filterscale
    inverse = 1.0 / filterscale
    matrix = np.zeros((in_size, out_size), dtype=np.float64)
    for i in range(out_size):
        center = (i + 0.5) * scale
        first = max(int(center - support + 0.5), 0)
        count = min(int(center + support + 0.5), in_size) - first
        row = [fn((x + first - center + 0.5) * inverse) for x in range(count)]
        total = 0.0
        for w in row:  # summed left to right, as Pillow does
            total += w
        for x, w in enumerate(row):
            w = w / total if total != 0.0 else w
            matrix[first + x, i] = int((0.5 if w >= 0 else -0.5) + w * (1 << PRECISION_BITS))
    return torch.from_numpy(matrix)


def _resample_last(x: torch.Tensor, out_size: int, resample: int) -> torch.Tensor:
    """One Pillow 8-bit pass along the last dimension of x (float64 holding 0–255 integers): a product with the
    weight matrix, exact because every partial sum is an integer below 2**31, then Pillow's rounding and clamp."""
    sums = x @ resample_matrix(x.shape[-1], out_size, resample).to(x.device)
    return torch.floor((sums + (1 << (PRECISION_BITS - 1))) / (1 << PRECISION_BITS)).clamp_(0, 255)


def pil_resize(images: torch.Tensor, height: int, width: int, resample: int) -> torch.Tensor:
    """Images [n, c, h, w] (0–255 integers in float64) resized as PIL's Image.resize does for 8-bit images: the
    horizontal pass first, each pass only where that side changes."""
    if images.shape[-1] != width:
        images = _resample_last(images, width, resample)
    if images.shape[-2] != height:
        images = _resample_last(images.transpose(-1, -2), height, resample).transpose(-1, -2)
    return images


def shortest_edge_size(height: int, width: int, shortest: int) -> tuple[int, int]:
    """(height, width) with the shorter side `shortest` and the longer scaled and truncated, as transformers does."""
    if width <= height:
        return int(shortest * height / width), shortest
    return shortest, int(shortest * width / height)


class DevicePixels:
    """A PIL image processor's steps as tensor ops on `device`; built by `device_pixels`, which checks that the
    processor is one it covers."""

    def __init__(self, processor: Any, device: torch.device | str):
        self.processor = processor
        self.device = torch.device(device)
        self.size: dict[str, int] | None = ({k: v for k, v in dict(processor.size).items() if v is not None}
                                            if processor.do_resize else None)
        self.resample = int(processor.resample)
        self.crop = (processor.crop_size["height"], processor.crop_size["width"]) if processor.do_center_crop else None
        self.scale = float(processor.rescale_factor) if processor.do_rescale else None
        self.mean_std = ((np.asarray(processor.image_mean, dtype=np.float32),
                          np.asarray(processor.image_std, dtype=np.float32)) if processor.do_normalize else None)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """An image's (height, width) after the processor's resize."""
        if self.size is None:
            return height, width
        if "shortest_edge" in self.size:
            return shortest_edge_size(height, width, self.size["shortest_edge"])
        return self.size["height"], self.size["width"]

    def __call__(self, images: Sequence[Any] | np.ndarray) -> torch.Tensor | None:
        """The processor's pixel values [n, c, h, w] (float32, on the CPU) for these images; None when they are
        not all 8-bit RGB or grey PIL images that end up the same size (the processor then does them)."""
        from PIL import Image

        if len(images) == 0 or not all(isinstance(im, Image.Image) for im in images):
            return None
        arrays = [self.processor.process_image(im, do_convert_rgb=self.processor.do_convert_rgb) for im in images]
        if any(a.dtype != np.uint8 or a.ndim != 3 or a.shape[0] not in (1, 3) for a in arrays):
            return None
        final = {self._final_size(a.shape[1], a.shape[2]) for a in arrays}
        if len(final) != 1 or None in final or len({a.shape[0] for a in arrays}) != 1:
            return None
        out: list[torch.Tensor | None] = [None] * len(arrays)
        for shape in sorted({a.shape for a in arrays}):  # images of one size are resized together
            which = [i for i, a in enumerate(arrays) if a.shape == shape]
            batch = torch.from_numpy(np.stack([arrays[i] for i in which])).to(self.device)
            for i, pixels in zip(which, self._pixels(batch), strict=True):
                out[i] = pixels
        return torch.stack([p for p in out if p is not None]).cpu()

    def _final_size(self, height: int, width: int) -> tuple[int, int] | None:
        """An image's size after resize and crop; None where the crop would need padding."""
        height, width = self.resized_size(height, width)
        if self.crop is None:
            return height, width
        return None if self.crop[0] > height or self.crop[1] > width else self.crop

    def _pixels(self, batch: torch.Tensor) -> torch.Tensor:
        """Resize, crop, rescale, normalise a [n, c, h, w] uint8 batch of one size, in the processor's dtypes."""
        x = batch.double()
        if self.size is not None:
            x = pil_resize(x, *self.resized_size(*batch.shape[-2:]), self.resample)
        if self.crop is not None:
            top, left = (x.shape[-2] - self.crop[0]) // 2, (x.shape[-1] - self.crop[1]) // 2
            x = x[..., top:top + self.crop[0], left:left + self.crop[1]]
        x = (x * self.scale).float() if self.scale is not None else x.float()
        if self.mean_std is not None:
            mean, std = (torch.from_numpy(v).to(x.device).view(-1, 1, 1) for v in self.mean_std)
            x = (x - mean) / std
        return x


def device_pixels(processor: Any, device: torch.device | str) -> DevicePixels | None:
    """`DevicePixels` for an image processor whose steps it reproduces (transformers' PIL backend, resize by shortest
    edge or to a fixed size with a bilinear or bicubic filter, no padding); None otherwise."""
    if getattr(processor, "backend", None) != "pil" or not hasattr(processor, "process_image"):
        return None
    size = {k for k, v in dict(processor.size or {}).items() if v is not None} if processor.do_resize else set()
    if processor.do_resize and (int(processor.resample) not in FILTERS or size not in (
            {"shortest_edge"}, {"height", "width"})):
        return None
    if getattr(processor, "do_pad", False):
        return None
    return DevicePixels(processor, device)
