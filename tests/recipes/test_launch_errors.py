"""However a run is launched (`tunebook train`, as the README says, with 1 or 2 processes, or a notebook), a
config error, a failed run or a stop signal ends with Tunebook's own readable lines: no launcher traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from support import ROOT, TINY_TEST_MODEL

pytestmark = pytest.mark.slow
TINY = ["--model_config", json.dumps(TINY_TEST_MODEL), "--disable_tqdm", "--report_to", "none",
        "--synthetic_train_size", "200", "--synthetic_eval_size", "4", "--per_device_train_batch_size", "4",
        "--eval_on_start", "false", "--generation_eval", "false", "--logging_steps", "1"]  # fmt: skip
LAUNCHER_NOISE = (
    "Traceback",
    "ChildFailedError",
    "CalledProcessError",
    "torch/distributed/elastic",
    "KeyboardInterrupt",
)


def tunebook(*args: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "tunebook.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, **kwargs)


def _clean(output: str) -> None:
    for noise in LAUNCHER_NOISE:
        assert noise not in output, output[-3000:]


@pytest.mark.parametrize("accelerate_config", ["cpu.yaml", "multi_cpu.yaml"])
def test_a_config_typo_is_one_line_before_anything_heavy_is_imported(accelerate_config):
    code = (
        "import sys\nfrom tunebook.cli import main\ntry:\n    main(sys.argv[1:])\n"
        "except BaseException as error:\n    sys.excepthook(type(error), error, None)\n"
        "print('imported torch' if 'torch' in sys.modules else 'no torch')"
    )
    args = ["train", "--config_file", f"accelerate_configs/{accelerate_config}", "sft", "--learnig_rate", "1e-3"]
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT)
    assert result.stderr == (
        "tunebook: error: unknown config key 'learnig_rate' (in command line); did you mean 'learning_rate'?\n"
    )
    assert result.stdout.strip() == "no torch"


def test_a_failed_run_on_two_processes_is_one_line_and_writes_nothing(tmp_path):
    # A file that exists (a missing one stops at the config check, before the launch) and fails data preparation.
    data = "tests/assets/malformed.jsonl"
    out = tmp_path / "runs" / "sft"
    result = tunebook("train", "--config_file", "accelerate_configs/multi_cpu.yaml", "sft", *TINY,
                      "--train_data", data, "--log_level", "WARNING", "--output_dir", str(out))  # fmt: skip
    assert not (tmp_path / "runs").exists()  # the folders the run's lock made are gone again, with the lock file
    output = result.stdout + result.stderr
    assert result.returncode == 1
    _clean(output)
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"tunebook: error (rank 0): {data}, line 2: malformed JSON"), (
        output
    )


def test_sigterm_to_the_launcher_reaches_the_recipe_once(tmp_path):
    """accelerate's own single-process launcher would die and leave the recipe running unsignalled."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tunebook.cli", "train", "--config_file", "accelerate_configs/cpu.yaml", "sft",
           *TINY, "--max_steps", "400", "--output_dir", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    deadline = time.time() + 180
    while time.time() < deadline and not _steps_logged(out, 5):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # to the launcher only, as `kill PID` would
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 143, output[-3000:]
    assert "Resume with the same command plus --resume_from_checkpoint latest" in output
    assert len(list(out.glob("checkpoints/step-*"))) == 1
    _clean(output)


def test_ctrl_c_on_two_processes_saves_and_ends_cleanly(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tunebook.cli", "train", "--config_file", "accelerate_configs/multi_cpu.yaml",
           "sft", *TINY, "--max_steps", "400", "--output_dir", str(out)]  # fmt: skip
    # A terminal sends Ctrl-C to its foreground process group: here, the launcher's own.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    deadline = time.time() + 240
    while time.time() < deadline and not _steps_logged(out, 5):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 130, output[-3000:]
    assert "Resume with the same command plus --resume_from_checkpoint latest" in output
    assert len(list(out.glob("checkpoints/step-*"))) == 1
    _clean(output)


def _steps_logged(out, n: int) -> bool:
    path = out / "metrics.jsonl"
    return path.is_file() and sum('"loss"' in line for line in path.read_text().splitlines()) >= n


def test_a_config_error_in_a_notebook_is_one_line(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("from tunebook import load_recipe\nsft = load_recipe('sft')"),
        nbformat.v4.new_code_cell("sft.config(max_step=3)"),
    ]
    client = NotebookClient(notebook, timeout=120, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})  # fmt: skip
    client.execute()
    outputs = notebook.cells[1].outputs
    shown = [o.get("text", "") for o in outputs if o.output_type == "stream"]
    assert shown == [
        "tunebook: error: unknown config key 'max_step' (in config(...) arguments); did you mean 'max_steps'?\n"
    ]
    assert all(not o.get("traceback") for o in outputs if o.output_type == "error")


def test_a_truncated_gguf_file_is_one_line(tmp_path):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = (tmp_path / "model.gguf").read_bytes()
    for cut in (100, len(data) // 3):  # inside the header, inside the tensors
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        result = tunebook("convert-gguf", str(tmp_path / "cut.gguf"), str(tmp_path / "out"))
        assert result.returncode == 1
        assert result.stderr == (
            f"tunebook: error: {tmp_path / 'cut.gguf'}: truncated or corrupt GGUF file (it ends inside its header "
            "or tensors)\n"
        )


@pytest.mark.parametrize("threads", [1, 2])
def test_one_process_runs_in_the_launchers_interpreter_with_the_threads_asked_for(tmp_path, threads):
    """No second interpreter for one process (it costs a short run ~2 s): accelerate's OMP_NUM_THREADS, set on every
    CPU launch, is honoured in place; the time to first step counts from the launcher's start."""
    report = tmp_path / "report.json"
    script = tmp_path / "where.py"
    script.write_text(
        "import json, os, sys, torch\n"
        "json.dump({'pid': os.getpid(), 'threads': torch.get_num_threads(),"
        " 'launch_time': os.environ.get('TUNEBOOK_LAUNCH_TIME')}, open(sys.argv[1], 'w'))\n"
    )
    proc = subprocess.Popen([sys.executable, "-m", "tunebook.cli", "train", "--config_file",
                             "accelerate_configs/cpu.yaml", "--num_cpu_threads_per_process", str(threads),
                             str(script), str(report)], cwd=ROOT)  # fmt: skip
    assert proc.wait(timeout=120) == 0
    seen = json.loads(report.read_text())
    assert seen["pid"] == proc.pid
    assert seen["threads"] == threads
    assert seen["launch_time"] is not None and float(seen["launch_time"]) <= time.time()


def test_a_run_in_the_launchers_interpreter_ends_as_python_would(tmp_path):
    """The in-place run skips the interpreter's teardown, not what the program asked for at exit."""
    script = tmp_path / "ends.py"
    script.write_text(
        "import atexit, pathlib, sys, threading, time\n"
        "out = pathlib.Path(sys.argv[1])\n"
        "atexit.register(lambda: (out / 'atexit').write_text('ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), (out / 'thread').write_text('joined'))).start()\n"
        # An idle pool's worker (as torch.compile leaves behind) ends only when exit stops the pool first.
        "from concurrent.futures import ThreadPoolExecutor\n"
        "pool = ThreadPoolExecutor(2); pool.submit(lambda: (out / 'pool').write_text('ran')).result()\n"
        "print('buffered, not flushed', end='')\n"
    )
    result = subprocess.run([sys.executable, "-m", "tunebook.cli", "train", "--config_file", "accelerate_configs/cpu.yaml",
                             str(script), str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == "buffered, not flushed"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "pool").read_text() == "ran"


def test_a_recipe_in_the_launchers_interpreter_pauses_the_collector_until_its_start(tmp_path):
    """Collection is paused while one of our recipes imports its libraries; its `start_run` freezes what was made
    and resumes collection. A script of one's own keeps the collector as Python sets it."""
    hook = tmp_path / "hook"  # seen by every interpreter started with it on PYTHONPATH, before `tunebook` runs
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import atexit, gc, json, os\n"
        "atexit.register(lambda: json.dump({'frozen': gc.get_freeze_count(), 'enabled': gc.isenabled()},"
        " open(os.environ['GC_REPORT'], 'w')))\n"
    )
    script = tmp_path / "own.py"
    script.write_text("import gc\nassert gc.isenabled(), 'paused for a script of its own'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    seen = {}
    sft = ["sft", *TINY, "--max_steps", "2", "--output_dir", str(tmp_path / "out")]
    for name, recipe in (("sft", sft), ("own", [str(script)])):
        env["GC_REPORT"] = str(tmp_path / f"{name}.json")
        result = subprocess.run([sys.executable, "-m", "tunebook.cli", "train", "--config_file",
                                 "accelerate_configs/cpu.yaml", *recipe], capture_output=True, text=True, cwd=ROOT,
                                env=env, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        seen[name] = json.loads((tmp_path / f"{name}.json").read_text())
    # Frozen only where the pause was: by the recipe's `start_run`, the objects of torch, transformers and accelerate.
    assert seen["sft"]["enabled"] and seen["sft"]["frozen"] > 100_000
    assert seen["own"] == {"frozen": 0, "enabled": True}
