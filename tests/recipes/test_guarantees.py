"""Every guarantee of the shared loop, proved on every recipe (in-process, tiny, a few steps each):

- a stop signal mid-run saves a checkpoint, and the resumed run logs the uninterrupted run's losses step for step and
  ends with its weights, byte for byte; `metrics.jsonl` continues without a gap or a repeat;
- a run that dies inside a checkpoint save keeps the previous checkpoint as `latest`, and resumes from it;
- `nan_policy: stop` ends the run naming the last good checkpoint; `skip` drops the step from the update and from the
  logged figures; under fp16 loss scaling, overflowing steps are the scaler's to skip, counted, and the run goes on;
- early stopping and `load_best_model_at_end` export the best checkpoint's weights;
- `save_strategy` epoch and no;
- a start that fails before training (a malformed row) writes nothing into its output_dir.
The recipes differ only where their task differs: a test reads their `main` functions and checks the loop's calls.
"""

from __future__ import annotations

import ast
import json

import pytest
from recipe_runs import COMMON, EVAL_METRIC, _rates, _records, _run, _signal_at, _weights, _without_rates
from support import ASSETS, ROOT, TINY_TEST_MODEL, hold_lock

from tunebook import load_recipe
from tunebook.errors import TrainingError
from tunebook.recipe import RECIPES
from tunebook.training.checkpoint import list_checkpoints, resolve_checkpoint

pytestmark = pytest.mark.slow


def _rates_used(monkeypatch, name: str) -> dict[int, float]:
    """Step -> the learning rate the optimizer held when it took that step, filled as recipe `name` trains."""
    module, used = load_recipe(name).module, {}
    real = module.optimizer_step_or_skip

    def note_rate_then_step(run, state, optimizer, finite):
        used[state.global_step + 1] = optimizer.param_groups[0]["lr"]
        return real(run, state, optimizer, finite)

    monkeypatch.setattr(module, "optimizer_step_or_skip", note_rate_then_step)
    return used


@pytest.mark.parametrize("name", RECIPES)
def test_a_stop_signal_then_resume_equals_the_uninterrupted_run(name, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        used = _rates_used(patch, name)
        full = _run(name, tmp_path / "full", tmp_path / "cache", eval_steps=2)
    # Each step logs the learning rate its update used (a warm-up's first step trains at 0), not the next step's.
    assert {r["step"]: r["learning_rate"] for r in _records(tmp_path / "full") if "loss" in r} == used
    assert used[1] == 0 and len(set(used.values())) > 2
    with monkeypatch.context() as patch:
        _signal_at(patch, name, 3)
        with pytest.raises(SystemExit) as stopped:
            _run(name, tmp_path / "cut", tmp_path / "cache", eval_steps=2)
    assert stopped.value.code == 143
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step-3"]
    resumed = _run(name, tmp_path / "cut", tmp_path / "cache", eval_steps=2, resume_from_checkpoint="latest")
    assert _records(tmp_path / "cut") == [_without_rates(r) | _rates(c) for r, c in _paired(tmp_path)]
    assert _weights(tmp_path / "cut") == _weights(tmp_path / "full")
    assert resumed["eval"] == full["eval"] and resumed["train_steps"] == full["train_steps"] == 6
    assert resumed["resumed_from"].endswith("step-3") and resumed["final_train_loss"] == full["final_train_loss"]


def _paired(tmp_path):
    """The uninterrupted run's records (timings aside) beside the resumed run's, which must match them."""
    full, cut = _records(tmp_path / "full"), _records(tmp_path / "cut")
    assert [r["step"] for r in full] == [r["step"] for r in cut]
    return zip(full, cut)


@pytest.mark.parametrize("name", RECIPES)
def test_dying_inside_a_save_keeps_the_previous_checkpoint(name, tmp_path, monkeypatch):
    from accelerate import Accelerator

    real, calls = Accelerator.save_state, []

    def save_then_die(self, *args, **kwargs):
        calls.append(1)
        result = real(self, *args, **kwargs)
        if len(calls) == 2:  # the second checkpoint's files are written; the process dies before the rename
            raise KeyboardInterrupt("killed")
        return result

    with monkeypatch.context() as patch:
        patch.setattr(Accelerator, "save_state", save_then_die)
        with pytest.raises(KeyboardInterrupt):
            _run(name, tmp_path / "run", tmp_path / "cache", save_steps=2)
    assert (tmp_path / "run" / "checkpoints" / "step-4.tmp").is_dir()
    assert resolve_checkpoint(tmp_path / "run", "latest").name == "step-2"
    summary = _run(name, tmp_path / "run", tmp_path / "cache", save_steps=2, resume_from_checkpoint="latest")
    assert summary["resumed_from"].endswith("step-2") and summary["train_steps"] == 6


def _fp16_with_scaler(monkeypatch) -> None:
    """Recipes in this process train as under fp16 on a GPU: Accelerate's own fp16 path (loss scaling, unscaling
    before clipping, float16 autocast), with torch's CPU GradScaler. Its first scale, 2**40, overflows for sure, and
    a backoff of 2**-12 brings it down in two skipped steps."""
    import torch
    from accelerate import Accelerator

    import tunebook.training.accelerator as built

    class FP16WithScaler(Accelerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # The process-wide state is shared by every Accelerator of this process: undone after the test.
            monkeypatch.setattr(self.state, "_mixed_precision", "fp16")
            self.native_amp = True
            self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-12)

    monkeypatch.setattr(built, "Accelerator", FP16WithScaler)


@pytest.mark.parametrize("name", RECIPES)
def test_fp16_loss_scaling_skips_overflowing_steps_and_trains(name, tmp_path, monkeypatch):
    """Under fp16 the steps whose gradients overflow at the loss scale are skipped and counted while the scale comes
    down, and the run goes on under the default `nan_policy: stop`, updates the weights and has no NaN in them; a
    run stopped by a signal and resumed (the scale restored from the checkpoint) ends as the uninterrupted one."""
    import torch
    from safetensors.torch import load_file

    _fp16_with_scaler(monkeypatch)
    full = _run(name, tmp_path / "full", tmp_path / "cache")
    assert full["mixed_precision"] == "fp16" and full["train_steps"] == 6
    assert full["skipped_updates"] == 2
    losses = [r["loss"] for r in _records(tmp_path / "full") if "loss" in r]
    assert losses[:2] == [None, None] and None not in losses[2:]
    weights = load_file(tmp_path / "full" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())

    with monkeypatch.context() as patch:
        _signal_at(patch, name, 3)
        with pytest.raises(SystemExit):
            _run(name, tmp_path / "cut", tmp_path / "cache")
    resumed = _run(name, tmp_path / "cut", tmp_path / "cache", resume_from_checkpoint="latest")
    assert resumed["skipped_updates"] == 2  # a scale not restored would overflow again at step 4
    assert _weights(tmp_path / "cut") == _weights(tmp_path / "full")


@pytest.mark.parametrize("name", RECIPES)
def test_nan_policy_stop_and_skip(name, tmp_path, monkeypatch):
    module = load_recipe(name).module
    real = module.optimizer_step_or_skip

    def third_step_is_nan(run, state, optimizer, finite):  # as if step 3's loss were NaN on some process
        return real(run, state, optimizer, finite and state.global_step != 2)

    monkeypatch.setattr(module, "optimizer_step_or_skip", third_step_is_nan)

    with pytest.raises(
        TrainingError, match=r"non-finite loss or gradient norm at step 3; .*Last good checkpoint: .*step-2"
    ):
        _run(name, tmp_path / "stop", tmp_path / "cache", save_steps=2)
    assert [r["step"] for r in _records(tmp_path / "stop") if "loss" in r] == [1, 2]
    assert not (tmp_path / "stop" / "model.safetensors").exists()

    summary = _run(name, tmp_path / "skip", tmp_path / "cache", nan_policy="skip")
    logged = {r["step"]: r for r in _records(tmp_path / "skip") if "loss" in r}
    assert summary["skipped_updates"] == 1 and sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert logged[3]["loss"] is None and all(logged[s]["loss"] is not None for s in (1, 2, 4, 5, 6))
    if name in ("dpo", "reward"):  # their rewards are logged figures too: none of the skipped step's
        assert logged[3]["rewards/chosen"] is None


@pytest.mark.parametrize("name", RECIPES)
def test_early_stopping_exports_the_best_checkpoint(name, tmp_path):
    from safetensors.torch import load_file

    # With greater_is_better on the loss, "better" means higher: whichever way the tiny runs' losses move, the
    # rule is replayed on the logged evaluations and the run must have stopped, and chosen, as it says.
    metric = EVAL_METRIC.get(name, "loss")
    summary = _run(name, tmp_path / "run", tmp_path / "cache", max_steps=12, eval_steps=2, save_steps=1,
                   metric_for_best_model=metric, greater_is_better=True, early_stopping_patience=2,
                   load_best_model_at_end=True, save_total_limit=1, learning_rate=3e-3)  # fmt: skip
    evals = {r["step"]: r[f"eval_{metric}"] for r in _records(tmp_path / "run") if f"eval_{metric}" in r}
    best_step, waited, stop = None, 0, None
    for step, loss in sorted(evals.items()):
        if best_step is None or loss > evals[best_step]:
            best_step, waited = step, 0
        else:
            waited += 1
        if waited == 2 and step < 12:
            stop = step
            break
    assert summary["stopped_early"] == (stop is not None) and summary["train_steps"] == (stop or 12)
    assert sorted(evals) == list(range(2, (stop or 12) + 1, 2))  # each step evaluated once, the last one included
    assert summary["best"]["best_step"] == best_step and summary["eval"][f"eval_{metric}"] == evals[best_step]
    best = load_file(tmp_path / "run" / "checkpoints" / f"step-{best_step}" / "model.safetensors")
    exported = load_file(tmp_path / "run" / "model.safetensors")
    assert all((exported[k] == v).all() for k, v in best.items() if k in exported)


@pytest.mark.parametrize("name", RECIPES)
def test_save_strategy_epoch_and_no(name, tmp_path):
    summary = _run(name, tmp_path / "epoch", tmp_path / "cache", max_steps=-1, num_train_epochs=2,
                   save_strategy="epoch", save_total_limit=0)  # fmt: skip
    per_epoch = summary["train_steps"] // 2
    assert [p.name for p in list_checkpoints(tmp_path / "epoch")] == [f"step-{per_epoch}", f"step-{2 * per_epoch}"]
    _run(name, tmp_path / "no", tmp_path / "cache", save_strategy="no", save_steps=1)
    assert list_checkpoints(tmp_path / "no") == []


@pytest.mark.parametrize("name", RECIPES)
def test_one_output_dir_holds_one_run(name, tmp_path, caplog):
    from tunebook.errors import ConfigError

    out, cache = tmp_path / "run", tmp_path / "cache"
    with pytest.raises(ConfigError, match="resume_from_checkpoint latest: no checkpoint in"):
        _run(name, out, cache, max_steps=3, resume_from_checkpoint="latest")  # a mistyped output_dir, say
    assert _run(name, out, cache, max_steps=3, save_steps=3, resume_from_checkpoint="auto")["resumed_from"] is None
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run .*--overwrite_output_dir true"):
        _run(name, out, cache, max_steps=3)
    summary = _run(name, out, cache, max_steps=2, overwrite_output_dir=True)
    assert summary["resumed_from"] is None and list_checkpoints(out) == []
    assert [r["step"] for r in _records(out) if "loss" in r] == [1, 2]  # nothing of the earlier run


@pytest.mark.parametrize("name", RECIPES)
def test_a_live_run_keeps_its_output_dir_to_itself(name, tmp_path):
    """A second run into a busy output_dir stops at start-up, before its data, naming the other run; once that run
    is dead (kill -9: nothing cleaned up) it trains, and a finished run leaves the folder free for the next."""
    from tunebook.errors import ConfigError

    out, cache = tmp_path / "run", tmp_path / "cache"
    holder = hold_lock(out)
    try:
        with pytest.raises(
            ConfigError, match=f"^output_dir {out} is in use by another run \\(sft run, PID {holder.pid} "
        ):
            _run(name, out, cache, max_steps=2)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in out.iterdir()) == [".tunebook.lock"] and not cache.exists()
    assert _run(name, out, cache, max_steps=2)["train_steps"] == 2
    hold_lock(out).kill()  # released at the run's end: another process takes it at once


@pytest.mark.parametrize("name", RECIPES)
def test_a_start_that_fails_writes_nothing(name, tmp_path):
    """A malformed row is found while the data is read, after the output_dir's lock: the failed start leaves only the
    lock's folder (no config.yaml), which the process's next run removes; that run trains and keeps its own."""
    from tunebook.errors import DataError

    failed, cache = tmp_path / "new" / "run", tmp_path / "cache"
    with pytest.raises(DataError, match="malformed.jsonl, line 2: malformed JSON"):
        _run(name, failed, cache, train_data=str(ASSETS / "malformed.jsonl"))
    assert sorted(p.name for p in failed.iterdir()) == [".tunebook.lock"]
    assert _run(name, tmp_path / "next", cache, max_steps=1)["train_steps"] == 1
    assert not (tmp_path / "new").exists() and (tmp_path / "next" / "config.yaml").is_file()


@pytest.mark.parametrize("name", RECIPES)
def test_resuming_with_a_changed_config(name, tmp_path):
    from tunebook.errors import ConfigError

    out, cache = tmp_path / "run", tmp_path / "cache"
    constant = {"lr_scheduler_type": "constant", "save_steps": 3}
    _run(name, out, cache, max_steps=3, **constant)
    with pytest.raises(ConfigError, match="other values of per_device_train_batch_size, seed; resuming would not"):
        _run(name, out, cache, max_steps=6, resume_from_checkpoint="latest", per_device_train_batch_size=2, seed=1,
             **constant)  # fmt: skip
    # Longer, with another learning rate and logging cadence: applied from the resumed step on.
    _run(name, out, cache, max_steps=6, resume_from_checkpoint="latest", learning_rate=5e-4, logging_steps=3,
         **constant)  # fmt: skip
    rates = {r["step"]: r["learning_rate"] for r in _records(out) if "loss" in r}
    assert rates == {1: 1e-3, 2: 1e-3, 3: 1e-3, 6: 5e-4}


@pytest.mark.parametrize("name", RECIPES)
def test_torch_compile_trains_as_eager_does(name, tmp_path):
    """5 steps with the transformer blocks compiled log the eager run's losses (within 1e-4), compile no graph after
    the first step, and evaluate eagerly."""
    import torch._inductor.config

    eager = _run(name, tmp_path / "eager", tmp_path / "cache", max_steps=5, eval_steps=0)
    with torch._inductor.config.patch(fallback_random=True):  # dropout draws eager's random numbers
        compiled = _run(name, tmp_path / "compiled", tmp_path / "cache", max_steps=5, eval_steps=0, torch_compile=True)
    losses = {r["step"]: r["loss"] for r in _records(tmp_path / "eager") if "loss" in r}
    assert len(losses) == 5
    assert {r["step"]: r["loss"] for r in _records(tmp_path / "compiled") if "loss" in r} == pytest.approx(
        losses, abs=1e-4
    )
    # Graphs compiled by an earlier test of this process serve the same block class again: no count of them here.
    assert compiled["torch_compile_blocks"] == 2 and compiled["torch_compile_recompiles"] == 0
    # Packed rows (pretrain's) are padded to max_seq_length, so their graphs stay static; padded batches' are dynamic.
    assert compiled["torch_compile_shapes"] == ("static" if name == "pretrain" else "dynamic")
    assert "torch_compile_blocks" not in eager
    metric = f"eval_{EVAL_METRIC.get(name, 'loss')}"
    assert compiled["eval"][metric] == pytest.approx(eager["eval"][metric], abs=1e-4)


@pytest.mark.parametrize("name", RECIPES)
def test_flex_attention_without_packing_on_a_cpu_stops_with_one_line(name, tmp_path):
    """Every recipe, packed or not: the check is the loop's, not only packing's (FlexAttention has no backward pass
    on a CPU)."""
    from tunebook.errors import ConfigError

    with pytest.raises(ConfigError, match="FlexAttention has no backward pass on a CPU; use sdpa"):
        _run(name, tmp_path / "out", tmp_path / "cache", attn_implementation="flex_attention", max_steps=1)
    assert not (tmp_path / "out" / "step-1").exists()


# The loop's calls, in this order, in every recipe's main (the first call of each name counts).
LOOP_CALLS = ["start_run", "prepare_then_join", "build_optimizer", "accelerator.prepare", "plan_steps", "compile_model",
              "build_scheduler", "load_checkpoint_or_start", "start_training", "model.train", "epochs",
              "accumulation_windows", "micro_batch", "accelerator.backward", "after_step", "finish"]  # fmt: skip
# The optimizer step, in view in every recipe, once, in this order, between the last backward and `after_step`.
STEP_CALLS = ["accelerator.clip_grad_norm_", "finite_on_every_process", "optimizer_step_or_skip", "lr_scheduler.step",
              "optimizer.zero_grad"]  # fmt: skip


def _main_calls(source: str) -> tuple[ast.FunctionDef, list[str]]:
    """A recipe's `main` and the names of the calls in it, in source order (`obj.attr` where called on a name)."""
    main = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    nodes = sorted((n for n in ast.walk(main) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    return main, [_called(node) for node in nodes]


def _step_problems(source: str) -> list[str]:
    """What keeps a recipe's main from showing the loop's calls in order and the step's lines in view."""
    main, calls = _main_calls(source)
    problems = [f"no {c}" for c in LOOP_CALLS + STEP_CALLS if c not in calls]
    problems += [f"{c} {calls.count(c)} times" for c in STEP_CALLS if calls.count(c) > 1]
    if problems:
        return problems
    positions = [calls.index(c) for c in LOOP_CALLS]
    if positions != sorted(positions):
        problems.append(f"the loop's calls out of order: {[c for c in calls if c in LOOP_CALLS]}")
    last_backward = len(calls) - 1 - calls[::-1].index("accelerator.backward")
    step = [calls.index(c) for c in STEP_CALLS]
    if step != sorted(step) or step[0] < last_backward or step[-1] > calls.index("after_step"):
        problems.append(f"the step out of order: {[c for c in calls if c in STEP_CALLS + ['after_step']]}")
    text = ast.unparse(main)
    for own in ("apply_update", "save_checkpoint", "load_state", "StopSignals", "MetricsWriter", "start_trackers",
                "free_memory", "set_epoch", "is_nonfinite", "scaler"):  # fmt: skip
        if own in text:
            problems.append(f"writes the loop's {own} again")
    return problems


def test_the_recipes_differ_only_where_their_task_differs():
    """The loop's calls, in one order, in every recipe's main, with the optimizer step in view (clip, the finite
    check across processes, optimizer step, schedule step, zero_grad); nothing else of the loop's written again."""
    for name in RECIPES:
        source = (ROOT / "recipes" / f"{name}.py").read_text()
        assert _step_problems(source) == [], name
        main, _ = _main_calls(source)
        # About 260 lines (the house style), plus the ~15 lines that show the step and the start of training.
        assert len(source.splitlines()) <= 290 and main.end_lineno - main.lineno < 120, name
        assert "fmt: skip" not in source, name


@pytest.mark.parametrize(
    "line", ["finite = finite_on_every_process(", "lr_scheduler.step()", "optimizer.zero_grad(set_to_none=True)"]
)
def test_a_recipe_without_a_line_of_the_step_fails_the_check(line):
    """The check above fails where a line of the step is missing (here, commented out of recipes/sft.py)."""
    source = (ROOT / "recipes" / "sft.py").read_text()
    assert line in source
    assert _step_problems(source.replace(line, "# " + line)) != []


def _called(call: ast.Call) -> str:
    function = call.func
    if isinstance(function, ast.Attribute):
        owner = function.value
        return f"{owner.id}.{function.attr}" if isinstance(owner, ast.Name) else function.attr
    return getattr(function, "id", "")


@pytest.mark.multiprocess
def test_a_stop_signal_on_two_processes_then_resume_equals_the_uninterrupted_run(tmp_path):
    """SIGTERM reaches one of two processes: both save at the same step, and the resumed 2-process run is the same."""
    import os
    import subprocess
    import sys

    args = ["--model_config", json.dumps(TINY_TEST_MODEL), "--synthetic_train_size", "64", "--synthetic_eval_size",
            "8", "--generation_eval", "false", "--eval_steps", "2", "--cache_dir", str(tmp_path / "cache"),
            *[f"--{k}={v}" for k, v in COMMON.items() if k != "max_steps"], "--max_steps", "8"]  # fmt: skip

    def launch(script, out, *extra, env=None):
        cmd = [sys.executable, "-m", "tunebook.cli", "train", "--config_file", "accelerate_configs/multi_cpu.yaml",
               "--main_process_port", str(_free_port()), script, *args, "--output_dir", str(out), *extra]  # fmt: skip
        return subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, **(env or {})}
        )

    assert launch("sft", tmp_path / "full").returncode == 0
    stopped = launch("tests/recipes/signal_at_step.py", tmp_path / "cut", env={"SIGNAL_AT_STEP": "3"})
    assert stopped.returncode == 143, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step-3"]
    resumed = launch("sft", tmp_path / "cut", "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [_without_rates(r) for r in _records(tmp_path / "cut")] == [
        _without_rates(r) for r in _records(tmp_path / "full")
    ]
    assert _weights(tmp_path / "cut") == _weights(tmp_path / "full")


def _free_port() -> int:
    from support import free_port

    return free_port()
