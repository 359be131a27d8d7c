"""run/saved_config.py: a run directory's saved config as a resume, ``sample --weights`` and ``export`` read it."""
from __future__ import annotations

import pytest
import yaml

from diffgrpo.config import RunConfig
from diffgrpo.errors import ConfigError
from diffgrpo.run.saved_config import load, renamed


def _earlier_version(data: dict) -> dict:
    """A config as an earlier version saved it: model.pipeline under its old name model.family."""
    data["model"]["family"] = data["model"].pop("pipeline")
    return data


def test_a_renamed_key_is_read_under_its_new_name():
    data = _earlier_version(RunConfig.from_overrides(["model.pipeline=sd3"]).to_dict())
    out = renamed(data)
    assert "family" not in out["model"] and out["model"]["pipeline"] == "sd3"
    both = {"model": {"family": "flux", "pipeline": "sd3"}}  # the new name, where both are present, wins
    assert renamed(both) == {"model": {"pipeline": "sd3"}}


def test_a_run_saved_by_an_earlier_version_still_loads_for_sample(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(_earlier_version(RunConfig().to_dict())))
    (run / "weights.safetensors").write_bytes(b"")  # load reads the config only
    cfg = load(run, [], command="--weights")
    assert cfg.model.pipeline == "auto" and cfg.log.output_dir == ""


def test_the_old_key_given_by_a_user_is_still_refused_in_one_line():
    with pytest.raises(ConfigError, match="model.family was renamed model.pipeline"):
        RunConfig.from_overrides(["model.family=sd3"])
