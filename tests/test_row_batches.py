"""featcal.data.row_batches: fixed-shape array columns as numpy batches, every other column as before."""

import datasets
import numpy as np

from featcal.data import row_batches


def test_array_columns_come_as_numpy_and_the_rest_as_lists():
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((5, 3, 4, 4)).astype(np.float32)
    features = datasets.Features({"pixel_values": datasets.Array3D((3, 4, 4), "float32"),
                                  "label": datasets.Value("int64"), "text": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"pixel_values": pixels, "label": [0, 1, 2, 3, 4],
                                     "text": list("abcde")}, features=features)
    batches = list(row_batches(ds, 2))
    assert [len(b["label"]) for b in batches] == [2, 2, 1]  # the last batch short
    for i, batch in enumerate(batches):
        assert isinstance(batch["pixel_values"], np.ndarray) and batch["pixel_values"].dtype == np.float32
        np.testing.assert_array_equal(batch["pixel_values"], pixels[2 * i:2 * i + 2])
        assert batch["label"] == list(range(2 * i, min(2 * i + 2, 5)))  # Python lists, as the rows were
        assert batch["text"] == list("abcde"[2 * i:2 * i + 2])
    assert ds.format["type"] is None  # the caller's dataset keeps its format


def test_datasets_without_array_columns_are_read_as_lists():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "label": [0, 1]})
    (batch,) = row_batches(ds, 4)
    assert batch == {"input_ids": [[1, 2], [3]], "label": [0, 1]}
