"""`tunebook train` passes `accelerate launch` the values it would otherwise pick and warn about, as it would pick
them (the launches themselves: tests/recipes/test_launch_errors.py, tests/recipes/test_run_log.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import accelerate.commands.launch as accelerate_launch
import pytest

from tunebook.cli.launch import complete_launch_args


def _args(*argv: str):
    return accelerate_launch.launch_command_parser().parse_args([*argv, "recipe.py"])


def _config(**values):
    return SimpleNamespace(**{"compute_environment": "LOCAL_MACHINE", "use_cpu": False, "num_processes": 1,
                              "num_machines": 1, **values})  # fmt: skip


def test_without_a_config_file_the_defaults_accelerate_would_pick_are_passed():
    args = _args()
    filled = complete_launch_args(args, None, device_count=0, physical_cores=8, environ={})
    # A CPU-only machine: 0 devices (accelerate starts one process), one machine, no mixed precision, no dynamo.
    assert filled == {"num_processes": 0, "num_machines": 1, "mixed_precision": "no", "dynamo_backend": "no"}
    assert (args.num_processes, args.num_machines, args.mixed_precision, args.dynamo_backend) == (0, 1, "no", "no")
    assert args.num_cpu_threads_per_process is None  # not --cpu: accelerate leaves the threads to OMP_NUM_THREADS


def test_several_gpus_and_no_config_file_is_multi_gpu_on_all_of_them():
    args = _args()
    assert complete_launch_args(args, None, device_count=4, physical_cores=32, environ={})["num_processes"] == 4
    assert args.multi_gpu is True


def test_what_the_command_line_says_is_kept():
    args = _args("--num_processes", "1", "--mixed_precision", "bf16", "--num_machines", "1", "--dynamo_backend", "no")
    assert complete_launch_args(args, None, device_count=4, physical_cores=32, environ={}) == {}
    assert (args.num_processes, args.mixed_precision, args.multi_gpu) == (1, "bf16", False)


@pytest.mark.parametrize(
    ("config", "environ", "threads"),
    [
        (_config(use_cpu=True), {}, 8),  # one CPU process: all physical cores
        (_config(use_cpu=True, num_processes=2), {}, 4),  # two: half each
        (_config(use_cpu=True), {"OMP_NUM_THREADS": "3"}, None),  # the user's choice stands
        (_config(use_cpu=True, num_processes=8), {}, None),  # one core each: accelerate's default of 1
        (_config(use_cpu=False), {}, None),  # a GPU run
        (_config(use_cpu=True, compute_environment="AMAZON_SAGEMAKER"), {}, None),
    ],
)
def test_cpu_threads_per_process_are_the_physical_cores_shared_out(config, environ, threads):
    args = _args("--config_file", "cpu.yaml")
    filled = complete_launch_args(args, config, device_count=0, physical_cores=8, environ=environ)
    assert filled == ({} if threads is None else {"num_cpu_threads_per_process": threads})
    assert args.num_processes is None  # the rest comes from the config file, as accelerate reads it


def test_accelerate_warns_about_nothing_after_completion(caplog, monkeypatch):
    """The completed arguments go through accelerate's own checks without its "values were not passed" warning,
    which it gives for the same arguments uncompleted (so the check would see the warning if it came)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    launched = []
    monkeypatch.setattr(accelerate_launch, "simple_launcher", launched.append)
    monkeypatch.setattr(accelerate_launch, "default_config_file", "/nonexistent/default_config.yaml")
    with caplog.at_level(logging.WARNING, logger="accelerate.commands.launch"):
        accelerate_launch.launch_command(_args("--cpu"))
        assert "were not passed to `accelerate launch`" in caplog.text
        caplog.clear()
        args = _args("--cpu")
        complete_launch_args(args, None, device_count=0, physical_cores=8, environ={})
        accelerate_launch.launch_command(args)
    assert caplog.text == ""
    assert launched[0].num_processes == launched[1].num_processes == 0
    assert launched[0].num_cpu_threads_per_process == launched[1].num_cpu_threads_per_process
