"""Image preprocessing as tensor ops (featcal/pixels.py) against the image processor it stands in for: each Pillow
resampling pass bit for bit, whole images bit for bit where Pillow runs its passes in the documented order and within
one 8-bit level where it does not, and the cases it leaves to the processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, CLIPImageProcessorPil

from featcal.config import DataSource
from featcal.pixels import BICUBIC, BILINEAR, device_pixels, pil_resize
from tests.clip_fixture import save_tiny_clip, solid_images


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    """The tiny CLIP fixture's own image processor (shortest edge 16, centre crop 16), loaded as a run loads it."""
    return AutoImageProcessor.from_pretrained(save_tiny_clip(tmp_path_factory.mktemp("clip")), local_files_only=True)


def noise(rng: np.random.Generator, height: int, width: int, channels: int = 3) -> Image.Image:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))


@pytest.mark.parametrize("resample", [BILINEAR, BICUBIC])
@pytest.mark.parametrize("size_in, size_out", [(53, 22), (230, 16), (750, 16), (9, 16), (16, 224), (375, 298)])
def test_one_resampling_pass_is_pillows_bit_for_bit(resample, size_in, size_out):
    """One pass (only one side changes, so Pillow's order cannot matter): the weights, the fixed-point rounding and
    the clamp must all be Pillow's for every pixel of random noise, which overshoots often."""
    rng = np.random.default_rng(size_in * 1000 + size_out)
    for (height, width), (out_height, out_width) in (((4, size_in), (4, size_out)), ((size_in, 4), (size_out, 4))):
        image = noise(rng, height, width, channels=1)
        expected = np.asarray(image.resize((out_width, out_height), resample=resample))
        got = pil_resize(torch.from_numpy(np.array(image)).double()[None, None], out_height, out_width, resample)
        assert np.array_equal(got[0, 0].numpy().astype(np.uint8), expected)


def test_tiny_clip_pixels_equal_the_processors(processor):
    """The fixture's solid-colour images and noise images of sizes where Pillow resizes horizontally first: the
    same float32 pixel values as the processor, bit for bit."""
    rng = np.random.default_rng(0)
    pixels = device_pixels(processor, "cpu")
    assert pixels is not None
    batches = [solid_images(rng, 5),
               [noise(rng, h, w) for h, w in [(37, 53), (500, 375), (31, 300), (13, 9), (16, 16), (37, 53)]]]
    for images in batches:
        expected = processor(images, return_tensors="pt")["pixel_values"]
        got = pixels(images)
        assert got is not None and got.dtype == torch.float32
        assert torch.equal(got, expected)


def test_pixels_are_within_one_level_where_pillow_goes_vertical_first(processor):
    """600 × 230 → 41 × 16: Pillow 13 runs the vertical pass first here, so the 8-bit rounding between passes differs
    and some pixels move by one level, 1/255 before normalisation; never more on smooth images."""
    rng = np.random.default_rng(1)
    yy, xx = np.mgrid[0:600, 0:230]
    smooth = np.stack([np.sin(xx / 17.0 + c) * np.cos(yy / 23.0 - c) for c in range(3)], -1) * 100 + 128
    images = [Image.fromarray(np.clip(smooth + rng.normal(0, 8, smooth.shape), 0, 255).astype(np.uint8))]
    expected = processor(images, return_tensors="pt")["pixel_values"]
    got = device_pixels(processor, "cpu")(images)
    one_level = 1 / 255 / min(processor.image_std)
    gap = (got - expected).abs()
    assert 0 < gap.max() <= one_level * (1 + 1e-4)  # float32 rounding of the two normalised values
    assert (gap > 0).float().mean() < 0.1


def test_clip_sized_preprocessing_equals_the_processor():
    """CLIP's own settings (shortest edge 224, crop 224, bicubic): a 375 × 500 photo-sized image, bit for bit."""
    processor = CLIPImageProcessorPil()
    images = [noise(np.random.default_rng(2), 375, 500)]
    assert torch.equal(device_pixels(processor, "cpu")(images), processor(images, return_tensors="pt")["pixel_values"])


def test_what_it_does_not_cover_is_left_to_the_processor(processor):
    """A filter it does not reproduce, padding, or a backend other than PIL: no tensor path at all; inputs that are
    not PIL images, or images whose crop would need padding: None, so the caller asks the processor."""
    assert device_pixels(CLIPImageProcessorPil(resample=1), "cpu") is None  # Lanczos
    assert device_pixels(CLIPImageProcessorPil(do_pad=True), "cpu") is None
    assert device_pixels(object(), "cpu") is None
    pixels = device_pixels(processor, "cpu")
    rng = np.random.default_rng(3)
    assert pixels([np.asarray(noise(rng, 16, 16))]) is None
    assert pixels([]) is None
    small = device_pixels(CLIPImageProcessorPil(size={"height": 8, "width": 8}, crop_size={"height": 12, "width": 12}),
                          "cpu")
    assert small is not None and small([noise(rng, 16, 16)]) is None


def test_input_builder_uses_the_tensor_path_off_the_cpu(processor, tmp_path, monkeypatch):
    """InputBuilder on an accelerator (simulated: the CPU taken for one) builds its image inputs with the tensor path,
    giving the processor's pixels; on the CPU it keeps the processor."""
    import featcal.data
    from featcal.data import InputBuilder

    base = save_tiny_clip(tmp_path / "clip")
    rows = {"image": solid_images(np.random.default_rng(4), 3)}
    source = DataSource(path=str(tmp_path), column="image")
    on_cpu = InputBuilder(str(base), ("pixel_values",), source, 77, ["image"], "w")
    assert on_cpu.pixels is None
    monkeypatch.setattr(featcal.data, "on_accelerator", lambda device: True)
    builder = InputBuilder(str(base), ("pixel_values",), source, 77, ["image"], "w", "cpu")
    assert builder.pixels is not None
    assert torch.equal(builder(rows)["pixel_values"], on_cpu(rows)["pixel_values"])
