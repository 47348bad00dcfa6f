"""`tunebook plan`: the table and the JSON of a recipe config's plan, the change that fits, one line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import ROOT

from tunebook.cli.plan import plan_command
from tunebook.errors import ConfigError
from tunebook.planning import PARTS

SMALL = ["--packing", "true", "--max_seq_length", "128", "--per_device_train_batch_size", "8"]


def test_json_has_every_part_and_the_verdict(capsys):
    found = plan_command(["sft", *SMALL, "--gpu", "H100-80GB", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(found))
    assert {*PARTS, "total", "device_memory", "fits", "recommendation", "flops_per_token",
            "tokens_per_second"} <= set(printed)  # fmt: skip
    assert printed["total"] == pytest.approx(sum(printed[part] for part in PARTS), rel=0.2)
    assert printed["fits"] and printed["recommendation"] == [] and printed["tokens_per_second"] > 0


def test_a_plan_that_does_not_fit_says_what_to_run_instead(capsys):
    step = ["sft", *SMALL, "--gradient_accumulation_steps", "2"]
    budget = f"{plan_command([*step, '--json'])['total'] * 0.97 / 2**30:.4f}GiB"  # a little short of the plan
    capsys.readouterr()
    found = plan_command([*step, "--gpu_memory", budget])
    text = capsys.readouterr().out
    assert not found["fits"] and "does NOT fit" in text
    command = text.strip().splitlines()[-1].strip()
    assert command.startswith("tunebook train sft ") and "--per_device_train_batch_size" in command
    # The printed command, planned again, fits; the samples per optimizer step are the same.
    args = command.split()[3:]
    again = plan_command(["sft", *args, "--gpu_memory", budget, "--json"])
    assert again["fits"]
    batch = again["micro_batch"]
    assert batch["rows"] * batch["gradient_accumulation_steps"] == 16


def test_an_accelerate_config_and_gpus_shard_the_states(capsys):
    single = plan_command(["sft", *SMALL, "--json"])
    fsdp = plan_command(["sft", *SMALL, "--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml"),
                         "--num_gpus", "4", "--json"])  # fmt: skip
    capsys.readouterr()
    assert fsdp["engine"] == "fsdp2" and fsdp["processes"] == 4
    assert fsdp["optimizer"] == pytest.approx(single["optimizer"] / 4)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["nope"], "plan takes a RECIPE"), (["sft", "--gpu", "Z80"], "--gpu Z80: unknown"),
     (["sft", "--architecture", "/no/such/dir"], "no config.json there"),
     (["sft", "--num_gpus", "two"], "--num_gpus takes a whole number")],
)  # fmt: skip
def test_bad_input_is_one_line(argv, message, capsys):
    with pytest.raises((ConfigError, SystemExit)) as raised:
        plan_command(argv)
    said = str(raised.value) if isinstance(raised.value, ConfigError) else capsys.readouterr().err
    assert message in said


def test_the_command_line_prints_one_line_without_a_traceback():
    done = subprocess.run([sys.executable, "-m", "tunebook.cli", "plan", "sft", "--gpu_memory", "lots"],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--gpu_memory 'lots'" in done.stderr
