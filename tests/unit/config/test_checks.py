"""The checks a run's start makes before anything is written or torch is loaded, as plain functions: the output_dir
(`check_output_dir`) and the inputs (model paths, data files)."""

from __future__ import annotations

import pytest

from tunebook.config import SFTConfig, check_output_dir, parse_config
from tunebook.config.checks import check_data_files
from tunebook.errors import ConfigError


def _checkpoint(output_dir, step: int, complete: bool = True):
    path = output_dir / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "manifest.json").write_text("{}")
    return path


def test_an_earlier_runs_checkpoints_stop_a_fresh_run_naming_the_newest_and_the_ways_on(tmp_path):
    out = tmp_path / "run"
    _checkpoint(out, 5)
    _checkpoint(out, 10)
    with pytest.raises(ConfigError) as error:
        check_output_dir(SFTConfig(output_dir=str(out)))
    assert str(error.value) == (
        f"output_dir {out} holds checkpoints of an earlier run (newest: step-10); continue it with "
        "--resume_from_checkpoint latest, start over with --overwrite_output_dir true (deletes them), or choose "
        "another output_dir"
    )
    check_output_dir(SFTConfig(output_dir=str(out), resume_from_checkpoint="latest"))  # resumes them
    check_output_dir(SFTConfig(output_dir=str(out), overwrite_output_dir=True))  # deletes them, under the run's lock


def test_an_output_dir_without_complete_checkpoints_is_free_and_checking_writes_nothing(tmp_path):
    out = tmp_path / "run"
    check_output_dir(SFTConfig(output_dir=str(out)))
    assert not out.exists()  # a check creates nothing
    _checkpoint(out, 3, complete=False)  # an interrupted save's leftovers are no checkpoint
    (out / "checkpoints" / "step-4.tmp").mkdir()
    (out / "config.yaml").write_text("max_steps: 3\n")
    check_output_dir(SFTConfig(output_dir=str(out)))


def test_an_output_dir_that_is_a_file_or_under_one(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^output_dir .*file is a file, not a directory$"):
        check_output_dir(SFTConfig(output_dir=str(tmp_path / "file")))
    with pytest.raises(ConfigError, match=r"^output_dir .*file/run: .*file is a file, not a directory$"):
        check_output_dir(SFTConfig(output_dir=str(tmp_path / "file" / "run")))


def test_missing_inputs_are_one_line_each(tmp_path):
    with pytest.raises(ConfigError, match=r"^train_data: data file or folder not found: nope\.jsonl$"):
        check_data_files(SFTConfig(train_data="nope.jsonl"))
    with pytest.raises(ConfigError, match=r"^eval_data: data file or folder not found: .*held_out$"):
        check_data_files(SFTConfig(eval_data={"path": str(tmp_path / "held_out"), "split": "test"}))
    with pytest.raises(ConfigError, match=r"^model path not found: \./no_model \(model_name_or_path\)$"):
        parse_config(SFTConfig, overrides={"model_name_or_path": "./no_model"})
