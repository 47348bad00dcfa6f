"""`tunebook train`: `accelerate launch` of a recipe that ends with the recipe's own lines, whatever happens.

    tunebook train [ACCELERATE LAUNCH OPTIONS] RECIPE [--config FILE.yaml] [--key value ...]

RECIPE is a name of `tunebook.recipe.RECIPES` or the path of a recipe file; the options before it are exactly
`accelerate launch`'s (`--config_file accelerate_configs/multi_cpu.yaml`, `--num_processes`, ...). Differences
from calling `accelerate launch recipes/sft.py` directly, and why:

- the recipe's config is checked before torch is imported, so a typo is reported in about a second;
- a failed run ends with the recipe's one-line error: no launcher traceback (`CalledProcessError`, torchrun's
  `ChildFailedError` report and its log lines), and the exit code is the recipe's own (143 after SIGTERM);
- a single process runs in the launcher's own interpreter, with the environment `accelerate launch` would give it:
  no second interpreter to start and no second import of torch (about 2 s of a short run's start-up), and SIGTERM or
  Ctrl-C reach the recipe once, which saves a checkpoint and stops. Where the launch needs a fresh process (`--module`,
  `--no_python`, mpirun, `--gpu_ids` or other device selection, which must precede the device runtime's start), the
  recipe runs as a child in a session of its own and the launcher forwards those signals to it (accelerate's own
  single-process launcher does not, and a terminal's Ctrl-C would reach the recipe twice if it shared the launcher's
  process group);
- what `accelerate launch` would pick by default and warn about (no config file: `--num_processes`, `--num_machines`,
  `--mixed_precision`, `--dynamo_backend`; on a CPU, `--num_cpu_threads_per_process`) is passed to it, with the
  value it would have picked (`complete_launch_args`), so a run does not open with its "run `accelerate config`"
  warning;
- in that case, Python's cyclic garbage collector is paused while one of our recipes imports its libraries, and the
  objects made by then are frozen out of its collections (`pause_collector`: about 1 s of every run). A script of
  one's own runs with the collector as Python sets it: nothing guarantees that it ends the pause.
"""

from __future__ import annotations

import functools
import logging
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..process import LAUNCH_TIME_VARIABLE, launch_time, pause_collector, resume_collector

__all__ = ["train"]

# When the user's command began (epoch seconds), set by `tunebook train` for the recipe's processes.

USAGE = "usage: tunebook train [ACCELERATE LAUNCH OPTIONS] RECIPE [--config FILE.yaml] [--key value ...]"


def train(argv: list[str], whole_process: bool = False) -> None:
    """Check the recipe's config, then `accelerate launch` it; exits with the recipe's exit code.

    `whole_process`: this interpreter exists for this command (the `tunebook` console script), so a run in it may
    end the process without the interpreter's teardown."""
    from ..recipe import RECIPES, recipe_config_class, recipe_file

    position = next((i for i, a in enumerate(argv) if a in RECIPES or a.endswith(".py")), None)
    if position is None:
        raise ConfigError(f"tunebook train needs a recipe ({', '.join(RECIPES)} or a recipe .py file). {USAGE}")
    launcher_args, recipe, recipe_args = argv[:position], argv[position], argv[position + 1 :]
    if recipe in RECIPES:
        from ..config import check_output_dir, load_config

        config = load_config(recipe_config_class(recipe), recipe_args)  # --help prints and exits; a typo stops here
        check_output_dir(config)  # after the inputs' checks: a missing file is named before an earlier run's output
        script = str(recipe_file(recipe))
    else:
        if not Path(recipe).is_file():
            raise ConfigError(f"recipe file not found: {recipe}")
        script = recipe

    import accelerate.commands.launch as accelerate_launch

    # The run's time to first step counts from this command's start, also in child processes.
    os.environ.setdefault(LAUNCH_TIME_VARIABLE, repr(launch_time()))
    args = accelerate_launch.launch_command_parser().parse_args([*launcher_args, script, *recipe_args])
    _complete_from_this_machine(args)
    # One process: our launcher instead of accelerate's (see the module docstring); the rest is accelerate's.
    # Only our recipes pause the collector: each calls `start_run`, which resumes it, before anything else.
    pause = whole_process and recipe in RECIPES
    accelerate_launch.simple_launcher = functools.partial(_simple_launcher, whole_process=whole_process, pause=pause)
    _quiet_torchrun()
    try:
        accelerate_launch.launch_command(args)
    except subprocess.CalledProcessError as error:  # the DeepSpeed launcher
        raise SystemExit(error.returncode) from None
    except Exception as error:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if isinstance(error, ChildFailedError):
            raise SystemExit(_exit_status(error.get_first_failure()[1].exitcode)) from None
        if isinstance(error, SignalException):  # torchrun has passed the signal on and waited for the workers
            raise SystemExit(128 + int(error.sigval)) from None
        raise


def _complete_from_this_machine(args) -> None:
    """`complete_launch_args` with the accelerate config file `accelerate launch` reads (the one given, else the
    default one unless `--cpu`), this machine's devices and cores, and this environment."""
    import psutil
    from accelerate.commands.config import default_config_file, load_config_from_file

    reads_config = args.config_file is not None or (os.path.isfile(default_config_file) and not args.cpu)
    defaults = load_config_from_file(args.config_file) if reads_config else None
    needs_devices = defaults is None and args.num_processes is None
    complete_launch_args(args, defaults, _device_count() if needs_devices else 0, psutil.cpu_count(logical=False),
                         os.environ)  # fmt: skip


def complete_launch_args(
    args, defaults, device_count: int, physical_cores: int | None, environ: Mapping[str, str]
) -> dict[str, Any]:
    """Sets on `args` (parsed by `accelerate launch`'s parser) the values `accelerate launch` would choose itself and
    warn about, each as it would choose it (accelerate 1.15's `_validate_launch_command`), and returns them.

    `defaults`: the accelerate config file's values, None where it reads none. Without one it picks the device count
    for `num_processes` (0 on a CPU-only machine: one process), multi-GPU when that is more than one, one machine,
    no mixed precision and no dynamo; with one, those come from the file. Either way, on the CPU with
    OMP_NUM_THREADS unset it gives each process of this machine its share of the physical cores."""
    filled: dict[str, Any] = {}
    if defaults is None:
        if args.num_processes is None:
            filled["num_processes"] = device_count
        processes = filled.get("num_processes", args.num_processes)
        if not args.multi_gpu and processes > 1 and device_count > 1:
            filled["multi_gpu"] = True
        for key in ("num_machines", "mixed_precision", "dynamo_backend"):
            if getattr(args, key) is None:
                filled[key] = 1 if key == "num_machines" else "no"
        use_cpu, machines = args.cpu, filled.get("num_machines", args.num_machines)
    elif defaults.compute_environment == "AMAZON_SAGEMAKER":  # SageMaker sets its own threads
        return filled
    else:
        use_cpu = defaults.use_cpu
        processes = defaults.num_processes if args.num_processes is None else args.num_processes
        machines = defaults.num_machines if args.num_machines is None else args.num_machines
    if (
        args.num_cpu_threads_per_process is None
        and use_cpu
        and processes >= 1
        and _env_int(environ, "OMP_NUM_THREADS") <= 0
    ):
        local = _env_int(environ, "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
        threads = int((physical_cores or 0) / (local if local >= 0 else max(int(processes / machines), 1)))
        if threads > 1:
            filled["num_cpu_threads_per_process"] = threads
    for key, value in filled.items():
        setattr(args, key, value)
    return filled


def _env_int(environ: Mapping[str, str], *keys: str) -> int:
    """The first of `keys` set to a non-negative integer, else -1 (accelerate's `get_int_from_env`)."""
    for key in keys:
        value = int(environ.get(key, -1))
        if value >= 0:
            return value
    return -1


def _device_count() -> int:
    """The accelerators `accelerate launch` counts when it is not told how many processes to start."""
    import torch
    from accelerate import utils

    for backend in ("xpu", "mlu", "sdaa", "musa", "npu", "hpu", "neuron"):
        if getattr(utils, f"is_{backend}_available")():
            return getattr(torch, backend).device_count()
    return torch.cuda.device_count()


def _quiet_torchrun() -> None:
    """torchrun's agent logs each worker's failure and each signal it passes on; the recipe reports those itself.
    Its loggers set their own levels when their modules load, so they are quietened one by one once loaded."""
    import torch.distributed.run  # noqa: F401  (loads the elastic agent's modules and their loggers)

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _simple_launcher(args, whole_process: bool, pause: bool = False) -> None:
    from accelerate.utils import prepare_simple_launcher_cmd_env

    cmd, env = prepare_simple_launcher_cmd_env(args)
    if _runs_here(args, cmd, env):
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:  # read once when torch loaded; the launcher has loaded it already
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        sys.argv = cmd[1:]
        sys.path.insert(0, str(Path(cmd[1]).resolve().parent))  # as `python recipes/sft.py` would
        if pause:  # the process ends with the run, so what is frozen at its start is no caller's to free
            pause_collector()
        try:
            runpy.run_path(cmd[1], run_name="__main__")
        finally:
            resume_collector()  # a recipe that ended before its `start_run`
        if whole_process:
            _exit_without_teardown()
        raise SystemExit(0)
    # A session of its own: a terminal's Ctrl-C or a job's SIGTERM reaches the recipe once, forwarded from here;
    # a second one, forwarded too, makes the recipe stop without waiting for its step.
    process = subprocess.Popen(cmd, env=env, start_new_session=True)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: process.send_signal(signum))
    raise SystemExit(_exit_status(process.wait()))


# Variables that select devices: read when the device runtime starts, so only a fresh process honours them.
# (OMP_NUM_THREADS, which accelerate sets on every CPU launch, is honoured here through torch.set_num_threads.)
_FRESH_PROCESS_ONLY = ("VISIBLE_DEVICES", "AFFINITY_MASK", "VISIBLE_MODULES", "VISIBLE_CORES")


def _runs_here(args, cmd: list[str], env: dict[str, str]) -> bool:
    """Whether the recipe can run in this interpreter: a Python script, and no variable that only a new process
    would honour differs from this one's (KMP_* tune Intel's OpenMP, which PyTorch's wheels do not use)."""
    if args.no_python or args.module or args.mpirun_hostfile is not None or cmd[0] != sys.executable:
        return False
    changed = {k for k, v in env.items() if os.environ.get(k) != v}
    return not any(k.endswith(_FRESH_PROCESS_ONLY) for k in changed)


def _exit_without_teardown() -> None:
    """Ends a run that finished: what Python's own exit does for the program (its threads joined, its exit handlers,
    which close loggers and trackers, and flushed streams), without freeing every loaded module's objects one by one,
    which took torch's, transformers' and datasets' modules ~1.1 s at the end of every run."""
    from .. import compat

    # The interpreter's own thread shutdown: it first runs the hooks that stop thread pools (concurrent.futures'
    # workers, which torch.compile's inductor leaves idle, wait for those hooks and would never end), then joins
    # every non-daemon thread. Joining the threads without the hooks hung every compiled run at its end.
    compat.shut_down_threads()
    compat.run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_status(returncode: int) -> int:
    """A process ended by signal N reports -N; the shell's convention is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    train(sys.argv[1:])
