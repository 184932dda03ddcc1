"""Every bad config field is named in the error."""

import pytest

from featcal.config import ConfigError, config_from_dict, load_config
from tests.tiny_example_inputs import set_key

GOOD = {
    "base": "base",
    "experts": {"a": "ea", "b": "eb"},
    "calibration": {"data": {"a": {"path": "da"}, "b": {"path": "db"}}},
}


def _with(**changes):
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GOOD.items()}
    for dotted, value in changes.items():
        set_key(raw, dotted, value, sep="__")
    return raw


def test_good_config_defaults(tmp_path):
    cfg = config_from_dict(GOOD, tmp_path)
    assert cfg.tasks == ["a", "b"]
    assert cfg.featcal.lam == 0.05 and cfg.featcal.rho == 2.2 and cfg.featcal.alpha == 0.25
    assert cfg.merge.method == "task_arithmetic" and cfg.merge.scaling == 0.3


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"featcal": {"alpha": 1.5}}, "featcal.alpha"),
        ({"featcal": {"lambda": -1}}, "featcal.lambda"),
        ({"merge": {"method": "magic"}}, "merge.method"),
        ({"calibration__examples_per_task": 0}, "calibration.examples_per_task"),
        ({"experts": {}}, "experts"),
        ({"featcal": {"lamda": 0.1}}, "featcal.lamda"),
        ({"calibration": {"data": {"a": {"path": "da"}}}}, "calibration.data has no entry for task(s) ['b']"),
    ],
)
def test_bad_field_is_named(tmp_path, changes, field):
    raw = {**GOOD, **{k: v for k, v in changes.items() if "__" not in k}}
    for k, v in changes.items():
        if "__" in k:
            raw = _with(**{k: v})
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, tmp_path)
    assert field in str(err.value)


def test_overrides_and_relative_paths(tmp_path):
    (tmp_path / "base").mkdir()
    path = tmp_path / "c.yaml"
    path.write_text("base: base\nexperts: {a: ea}\ncalibration: {data: {a: {path: da}}}\n")
    cfg = load_config(path, ["featcal.lambda=0.1", "merge.method=ties"])
    assert cfg.featcal.lam == 0.1 and cfg.merge.method == "ties"
    assert cfg.base == str((tmp_path / "base").resolve())
    with pytest.raises(ConfigError, match="KEY.PATH=VALUE"):
        load_config(path, ["featcal.lambda"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_errors_say_whether_the_bad_value_came_from_set_or_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: base\nexperts: {a: ea}\ncalibration: {data: {a: {path: da}}}\nfeatcal: {alpha: 3}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["featcal.lamda=0.1"])
    assert str(err.value) == (
        "featcal.alpha: Input should be less than or equal to 1 (got 3, from " + str(path) + "); "
        "featcal.lamda: Extra inputs are not permitted (got 0.1, from --set featcal.lamda=0.1)")
    with pytest.raises(
        ConfigError, match=r"--set 'featcal.alpha.x=1': featcal.alpha is not a section \(the config has 3"
    ):
        load_config(path, ["featcal.alpha.x=1"])
    with pytest.raises(ConfigError, match=r"--set 'featcal.rho=\[1': the value is not valid YAML"):
        load_config(path, ["featcal.rho=[1"])


def test_bad_yaml_is_one_line_with_its_position(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: x\nexperts: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "\n" not in str(err.value) and f"config file {bad} is not valid YAML at line 3, column 1" in str(err.value)
