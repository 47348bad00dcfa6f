"""The `tunebook` command's first minutes: `--help` lists every recipe from the one map of recipe names and each
recipe's keys by section; a start that cannot work (a missing input file, model or reward file, an output_dir that
holds an earlier run) stops in the check before the launch, without torch, naming a missing input before an
output_dir conflict, and writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import ASSETS, ROOT, TINY_TEST_MODEL

from tunebook.config.fields import SECTIONS
from tunebook.recipe import RECIPES, recipe_task

# `tunebook ARGS` in a fresh interpreter, through the same error display as the console script, and then whether
# torch was imported: the check before the launch must not load it.
CLI = (
    "import sys\nfrom tunebook.cli import main\ntry:\n    main(sys.argv[1:])\n"
    "except SystemExit as ended:\n    code = ended.code\nexcept BaseException as error:\n"
    "    sys.excepthook(type(error), error, None)\n    code = 1\n"
    "print('imported torch' if 'torch' in sys.modules else 'no torch')\nsys.exit(code)"
)


def tunebook(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def _contents(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _earlier_run(folder):
    """An output_dir an interrupted run left: a complete checkpoint and its files."""
    checkpoint = folder / "checkpoints" / "step-5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text("{}")
    (folder / "metrics.jsonl").write_text("")
    return folder


# --------------------------------------------------------------------------------------------------------------
# Help


def test_tunebook_help_lists_every_recipe_of_the_map():
    result = tunebook("--help")
    assert result.returncode == 0, result.stderr
    recipes = result.stdout.split("\nrecipes (", 1)[1].splitlines()[1:]
    listed = [line.split()[0] for line in recipes if line.startswith("  ")]
    assert listed == list(RECIPES) and "grpo" in listed
    for name in RECIPES:
        assert any(line.split(None, 1)[1] == recipe_task(name)[0] for line in recipes if line.split()[0] == name)
    assert result.stdout.endswith("no torch\n")


@pytest.mark.parametrize("recipe", ["sft", "grpo"])
def test_a_recipes_help_prints_its_sections_in_order_without_torch(recipe):
    result = tunebook("train", recipe, "--help")
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.rstrip(":") in SECTIONS.values()]
    # A section no key of the recipe's config lives in is left out: the generation engine is GRPO's alone.
    expected = [f"{header}:" for name, header in SECTIONS.items() if recipe == "grpo" or name != "generation"]
    assert headers == expected
    assert "  --train_data (str | dict | list | None, default None)" in result.stdout
    assert result.stdout.endswith("no torch\n")


# --------------------------------------------------------------------------------------------------------------
# Checks before the launch


def test_a_missing_file_is_named_before_an_earlier_runs_checkpoints_and_nothing_is_written(tmp_path):
    """The interrupted quick start, then a run on a mistyped file: the file is the error, before torch loads."""
    out = _earlier_run(tmp_path / "run")
    before = _contents(out)
    result = tunebook("train", "sft", "--train_data", "nope.jsonl", "--output_dir", str(out))
    assert (result.returncode, result.stderr) == (1, "tunebook: error: train_data: data file or folder not found: "
                                                     "nope.jsonl\n")  # fmt: skip
    assert result.stdout == "no torch\n"
    result = tunebook("train", "sft", "--output_dir", str(out))  # the file fixed: now the earlier run is the error
    assert result.returncode == 1 and result.stdout == "no torch\n"
    assert result.stderr == (
        f"tunebook: error: output_dir {out} holds checkpoints of an earlier run (newest: step-5); continue it with "
        "--resume_from_checkpoint latest, start over with --overwrite_output_dir true (deletes them), or choose "
        "another output_dir\n"
    )
    assert _contents(out) == before  # no config.yaml, no lock file


@pytest.mark.parametrize(
    ("recipe", "args", "message"),
    [
        ("sft", ["--train_data", "nope.jsonl"], "train_data: data file or folder not found: nope.jsonl"),
        ("sft", ["--model_name_or_path", "./no_model"], "model path not found: ./no_model (model_name_or_path)"),
        ("grpo", ["--reward_functions", "[no_rewards.py:score]"],
         "reward function 'no_rewards.py:score': file not found: no_rewards.py"),
    ],
)  # fmt: skip
def test_a_missing_input_is_one_line_before_torch_and_creates_no_output_dir(tmp_path, recipe, args, message):
    out = tmp_path / "fresh"
    result = tunebook("train", recipe, *args, "--output_dir", str(out))
    assert (result.returncode, result.stderr, result.stdout) == (1, f"tunebook: error: {message}\n", "no torch\n")
    assert not out.exists()


@pytest.mark.slow  # imports torch and the recipe's libraries: ~5 s alone
def test_a_run_from_python_into_an_earlier_runs_output_dir_stops_before_writing(tmp_path):
    """`start_run` checks the output_dir before its lock creates anything (a config built in Python, or
    `accelerate launch recipes/sft.py`, comes here without the CLI's check)."""
    from accelerate.state import AcceleratorState, GradientState

    from tunebook import load_recipe
    from tunebook.errors import ConfigError

    out = _earlier_run(tmp_path / "run")
    before = _contents(out)
    sft = load_recipe("sft")
    config = sft.config(output_dir=str(out), report_to="none", dataloader_num_workers=0, disable_tqdm=True)
    try:
        with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run \(newest: step-5\)"):
            sft.main(config)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert _contents(out) == before  # no .tunebook.lock, no config.yaml


@pytest.mark.slow  # launches the recipe: ~15 s
def test_a_start_that_fails_after_the_launch_writes_nothing(tmp_path):
    """A malformed row is found when the data is read, after the launch and the output_dir's lock: the folders the
    lock created go again with the lock file, and an existing output_dir is left as it was."""
    out = tmp_path / "new" / "run"
    args = ["--model_config", json.dumps(TINY_TEST_MODEL), "--train_data", str(ASSETS / "malformed.jsonl")]
    result = tunebook("train", "sft", *args, "--output_dir", str(out))
    assert result.returncode == 1 and "malformed.jsonl, line 2: malformed JSON" in result.stderr, result.stderr
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    assert tunebook("train", "sft", *args, "--output_dir", str(existing)).returncode == 1
    assert _contents(existing) == ["notes.txt"]


@pytest.mark.slow
def test_a_failed_start_in_a_notebook_is_undone_by_the_next_run(tmp_path):
    """In Python the failed run's exception keeps its frames (and its lock) alive; what it wrote is only the lock's
    folder, removed when the same process starts its next run (one run at a time), and never a config.yaml."""
    from accelerate.state import AcceleratorState, GradientState

    from tunebook import load_recipe
    from tunebook.errors import DataError

    sft = load_recipe("sft")
    first, second = tmp_path / "first", tmp_path / "second"
    for out in (first, second):
        config = sft.config(output_dir=str(out), train_data=str(ASSETS / "malformed.jsonl"),
                            model_config=json.dumps(TINY_TEST_MODEL), report_to="none", dataloader_num_workers=0,
                            disable_tqdm=True)  # fmt: skip
        try:
            with pytest.raises(DataError, match="line 2: malformed JSON"):
                sft.main(config)
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
    assert not first.exists() and _contents(second) == [".tunebook.lock"]
