"""The training loop's bookkeeping, written once for every recipe: start, load a checkpoint or start fresh, epochs,
what follows each step (log, evaluate, best model, stop signals, save), and the end of the run.

A recipe keeps in view what differs between tasks (its data, its model and the forward/backward of its loss) and
the step itself (`tunebook.training.step`)::

    run = start_run(config, "sft")
    ...                                             # data, model, optimizer, loaders, accelerator.prepare
    plan = plan_steps(run, model, train_loader)
    lr_scheduler = accelerator.prepare(build_scheduler(...))
    compiled = compile_model(config, accelerator, model, train_loader, plan.micro_batches, log)
    saved = load_checkpoint_or_start(run, optimizer, lr_scheduler, train_loader, figures, evaluating)
    loop = start_training(run, plan, saved, model, optimizer, lr_scheduler, train_loader, data, evaluate, compiled)
    model.train()
    for loader in epochs(run, loop):
        for window in accumulation_windows(loader, k, run.timer):
            ...                                     # the loss of each micro-batch, backward
            ...                                     # clip, finite check, optimizer.step, lr_scheduler.step, zero_grad
            if after_step(run, loop, window, grad_norm, learning_rate):
                break
    return finish(run, loop)

These are plain functions over explicit objects, each given whole where it is made: `Run` (what the run holds from
start to end), `Plan` (how long it trains), `Checkpointed` (what a checkpoint saves: the `RunState` and the loop's
counters, figures and best model) and `Training` (what the loop holds while it trains). No callbacks, no
subclassing. The order they keep is the one with a right answer: a non-finite step is judged on every process before
anything is logged; a stop signal saves after the step's evaluation; the best model is chosen only after the final
step's weights were evaluated; the model is freed before the process group.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..data.resumable import resumable
from ..errors import TrainingError
from ..models.kernels import check_flex_attention
from .best import BestModel
from .counters import TrainCounters
from .guard import exit_code
from .state import Checkpointed, Plan, Run, RunState, Training
from .steps import eval_due, save_due, total_optimizer_steps

__all__ = [
    "Checkpointed",
    "Plan",
    "Run",
    "RunState",
    "Training",
    "after_step",
    "epochs",
    "finish",
    "load_checkpoint_or_start",
    "plan_steps",
    "start_run",
    "start_training",
]


def start_run(config, recipe: str) -> Run:
    """Timer, Accelerator, logging, seed, the output folder locked for this run, the start-up log. Nothing is
    written into the output folder until `start_training`: a start that fails (a malformed data row, a model that
    does not build) leaves it as it was (a folder the lock created is removed again)."""
    from accelerate.utils import set_seed

    from ..config import check_output_dir
    from ..config.checks import check_harness_tasks
    from ..data.loaders import start_worker_server
    from ..distributed import decided_by_main
    from ..planning.at_start import plan_at_start
    from ..process import resume_collector
    from ..run.logging import log_run_start, setup_logging
    from ..run.output_lock import lock_run_output_dir
    from ..run.record import RunTimer
    from .accelerator import recipe_accelerator

    resume_collector(freeze=True)  # paused by `tunebook train` while the recipe imported its libraries
    timer = RunTimer()
    accelerator = recipe_accelerator(config)  # engine, trackers, timeouts from the config and the launcher
    start_worker_server(config.dataloader_num_workers)  # several processes: workers come from a fork server
    log = setup_logging(accelerator.is_main_process, config.log_level, config.disable_tqdm)
    set_seed(config.seed)
    output_dir = Path(config.output_dir)
    cache_dir = Path(config.cache_dir).expanduser()  # resolved by the config when unset
    # Nothing is written before the checks pass: another run's checkpoints there stop this one (resume, overwrite or
    # another output_dir) before the lock creates the folder (`tunebook train` checked it before the launch too).
    decided_by_main(accelerator, lambda: check_output_dir(config))
    if _harness_tasks(config):  # a config built in Python had no file checks: a task that is not one stops it now,
        decided_by_main(accelerator, lambda: check_harness_tasks(config))  # not after training
    # One run per output_dir, for the run's lifetime: a second run there stops now, naming this one's PID and host.
    output_lock = lock_run_output_dir(accelerator, output_dir, recipe)
    log_run_start(log, config, accelerator)
    # per_device_train_batch_size auto resolved here, before anything reads it; the plan logged in one line.
    memory_plan = plan_at_start(config, recipe, accelerator, log)
    return Run(config, recipe, accelerator, log, timer, output_dir, cache_dir, output_lock=output_lock,
               memory_plan=memory_plan)  # fmt: skip


def plan_steps(run: Run, model, train_loader, unit: str = "micro-batches", updates_per_window: int = 1) -> Plan:
    """Total and per-epoch optimizer steps from the prepared loader (`updates_per_window` optimizer steps per
    accumulation window, as GRPO's `num_iterations`). Checks first that the model's attention can train here."""
    config, accelerator = run.config, run.accelerator
    check_flex_attention(model, accelerator.device)  # packed or not, before a first forward fails inside inductor
    k = config.gradient_accumulation_steps
    total_steps, steps_per_epoch = total_optimizer_steps(
        config.max_steps, config.num_train_epochs, len(train_loader), k, updates_per_window
    )
    run.log.info("Training %d optimizer steps (%d per epoch) of %d x %d %s x %d process(es)", total_steps,
                 steps_per_epoch, k, config.per_device_train_batch_size, unit, accelerator.num_processes)  # fmt: skip
    return Plan(total_steps, steps_per_epoch, total_steps * k // updates_per_window)


def load_checkpoint_or_start(
    run: Run, optimizer, lr_scheduler, train_loader, figures, evaluating: bool, **registered: Any
) -> Checkpointed:
    """Load `resume_from_checkpoint` into the prepared objects (model, optimizer, schedule, RNG states, data
    position) and return what else it holds (the loop's state, counters, logged `figures`, best model, the
    `registered` objects); without one, the same things fresh. `evaluating`: the run has eval data (a best model
    to track)."""
    from .resumption import resume_training

    config, accelerator = run.config, run.accelerator
    counters = TrainCounters.zeros(accelerator.device)
    best = BestModel.from_config(config) if evaluating else None  # best checkpoint, early stopping
    stream = train_loader if resumable(train_loader).streams else None
    checkpoint, state = resume_training(
        accelerator, config, counters, best, figures, run.log, optimizer, lr_scheduler, stream, registered
    )
    saved = Checkpointed(RunState.from_state_dict(state), counters, figures, best, registered, checkpoint)
    if checkpoint is not None:
        run.log.info("Resumed from %s: step %d, epoch %d, %d batches into it", checkpoint, saved.state.global_step,
                     saved.state.epoch, saved.state.batches_in_epoch)  # fmt: skip
    return saved


def start_training(
    run: Run, plan: Plan, saved: Checkpointed, model, optimizer, lr_scheduler, train_loader, data, evaluation,
    compiled=None, samples=None,
) -> Training:  # fmt: skip
    """What logs the run: the trackers (tensorboard etc.: the config now, every metrics record later) and
    `metrics.jsonl`; then the evaluation before training (`eval_on_start`, on a fresh run), the progress bar, the
    throughput and the timed progress lines (`log_every_seconds`). `data` is the prepared data (its training rows
    give the FLOPs per token). `samples`: what answers `sample_prompts` at every evaluation
    (`tunebook.evaluation.prompt_sampler`), or None."""
    from ..config import save_config
    from ..progress import progress_bar
    from ..run.record import MetricsWriter
    from ..run.trackers import start_trackers
    from .resumption import prepare_output_dir
    from .throughput import Heartbeat, Throughput

    config, accelerator, state = run.config, run.accelerator, saved.state
    # The run's first writes into output_dir: everything before (data, model, checkpoint) has loaded.
    prepare_output_dir(accelerator, config, run.log)  # overwrite_output_dir: the earlier run's files deleted
    if run.output_lock is not None:
        run.output_lock.started()  # from here a failure keeps the folder: its logs and last checkpoint are the run's
    if accelerator.is_main_process:
        save_config(config, run.output_dir / "config.yaml", run.recipe)
    start_trackers(accelerator, config, run.recipe)
    resumed_step = state.global_step if saved.resumed_from else None
    metrics = MetricsWriter(run.output_dir / "metrics.jsonl", accelerator.is_main_process, resumed_step, accelerator)
    if evaluation is not None and config.eval_on_start and saved.resumed_from is None:
        _evaluate(run, evaluation, saved, metrics, 0, "Before training", samples)
    if _harness_tasks(config) and config.eval_harness_at_eval and config.eval_on_start and saved.resumed_from is None:
        _run_harness(run, model, data, metrics, 0, "Before training")
    progress = progress_bar(accelerator.is_main_process, config.disable_tqdm, total=plan.total_steps,
                            initial=state.global_step, desc="Training")  # fmt: skip
    throughput = Throughput(accelerator, model, data.train, run.timer, saved.counters, config.peak_flops)
    heartbeat = None
    if accelerator.is_main_process:  # it reads this process's counters only: no collective for the others to join
        heartbeat = Heartbeat(config.log_every_seconds, run.timer, saved.counters, accelerator.num_processes,
                              state.global_step)  # fmt: skip
    return Training(plan, saved, model, optimizer, lr_scheduler, train_loader, data, evaluation, compiled, metrics,
                    progress, throughput, heartbeat, samples)  # fmt: skip


def epochs(run: Run, loop: Training) -> Iterator[Any]:
    """The epochs left to train, each as its loader; a resumed run's epoch skips the micro-batches it had trained
    on, at the sampler (nothing is read twice). Ends at the last step, an early stop, or a stop request. The training
    clock starts here. While it runs, SIGTERM and Ctrl-C ask the loop to finish its step, save and stop
    (`after_step`); the previous handlers come back when it ends, however it ends."""
    state, accelerator, train_loader, best = loop.state, run.accelerator, loop.train_loader, loop.saved.best
    run.timer.start_training()
    with run.signals:
        while state.global_step < loop.plan.total_steps and run.stop is None and not (best and best.should_stop()):
            train_loader.set_epoch(state.epoch)
            skip = 0 if resumable(train_loader).streams else state.batches_in_epoch
            loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
            loader.set_epoch(state.epoch)
            yield loader
            if state.batches_in_epoch >= len(train_loader):
                state.epoch, state.batches_in_epoch = state.epoch + 1, 0


def after_step(
    run: Run, loop: Training, window: list, grad_norm, learning_rate: float, data_advanced: bool = True
) -> bool:
    """After an optimizer step (`grad_norm` and `learning_rate` are the step's): count it, then log, evaluate, note
    the best model, honour a stop signal, save, stop early, as each falls due; between logging steps, a timed progress
    line (the first step's, then every `log_every_seconds`). `data_advanced` False: the step trained
    on `window` again (GRPO's updates before the last of a generation batch), so the data position stays. Returns
    True when the epoch's loop should end (the run stops or is done)."""
    from ..run.logging import show_heartbeat, show_progress

    config, state, plan, saved = run.config, loop.state, loop.plan, loop.saved
    if run.stop is not None:  # a non-finite step under nan_policy: stop (nothing logged or saved after it)
        return True
    if data_advanced:
        state.batches_in_epoch += len(window)
    state.global_step += 1
    run.timer.step_done()
    if loop.compiled is not None:
        loop.compiled.step_done()
    loop.progress.update(1)
    step = state.global_step
    logging_step = step % config.logging_steps == 0 or step == plan.total_steps
    if loop.heartbeat is not None and loop.heartbeat.due(logged=logging_step):  # a slow run is never silent long
        figures = loop.heartbeat.figures(step, plan.total_steps, saved.figures.local_loss())
        show_heartbeat(loop.progress, step, plan.total_steps, figures, run.log)
    if logging_step:
        figures = saved.figures.pop(run.accelerator)  # means over the window's updated steps, all processes
        if figures["loss"] is not None:  # None: every step of the window was skipped as non-finite
            state.last_train_loss = figures["loss"]
        record = {
            "step": step,
            "epoch": round(step / plan.steps_per_epoch, 3),
            **figures,
            "learning_rate": learning_rate,
            "grad_norm": float(grad_norm),
            **loop.throughput.window(),  # tokens/s, samples/s, data wait, MFU, peak memory: all processes
            **_mixture_shares(run, loop),
        }
        loop.metrics.write(record)
        show_progress(loop.progress, record, plan.total_steps, run.log)
    epoch_done = state.batches_in_epoch >= len(loop.train_loader)
    new_best = False
    if loop.evaluation is not None and eval_due(config, step, plan.total_steps, epoch_done):
        new_best = _evaluate(run, loop.evaluation, saved, loop.metrics, step, f"Step {step}", loop.samples)
    if _harness_tasks(config) and config.eval_harness_at_eval and eval_due(config, step, plan.total_steps, epoch_done):
        _run_harness(run, loop.model, loop.data, loop.metrics, step, f"Step {step}")
    signum = run.signals.requested(run.accelerator)
    if signum:  # preemption or Ctrl-C: this step is done and evaluated; save it and leave
        if _save(run, loop, f"stopped by signal {signum}"):
            run.log.warning("Stopped at step %d by signal %d. Resume with the same command plus "
                            "--resume_from_checkpoint latest", step, signum)  # fmt: skip
            run.stop = SystemExit(exit_code(signum))
        return True
    if (reason := save_due(config, step, epoch_done, new_best)) and not _save(run, loop, reason):
        return True
    if saved.best is not None and saved.best.should_stop():
        best = saved.best
        run.log.info("Early stopping at step %d: %s has not improved on %.6g (step %d) for %d evaluations",
                     step, best.metric, best.best_value, best.best_step, best.patience)  # fmt: skip
        return True
    return step >= plan.total_steps


def _mixture_shares(run: Run, loop: Training) -> dict[str, float]:
    """A streamed mixture's share of the tokens trained on so far, per source (what was delivered, not asked)."""
    if len(resumable(loop.train_loader).source_names) < 2:  # a map-style loader names none
        return {}
    return {f"mixture/{n}": d["share"] for n, d in resumable(loop.train_loader).delivered(run.accelerator).items()}


def _evaluate(run: Run, evaluation, saved: Checkpointed, metrics, step: int, label: str, samples=None) -> bool:
    """Evaluate now (not counted as training time), log and record it; True if it is the best so far. The replies
    to `sample_prompts` go to the log and the record, not into the evaluation's results (nor checkpoints)."""
    from .compilation import eager

    with run.timer.paused(), eager():  # evaluation's shapes would compile graphs of their own
        results = evaluation()
        replies = samples() if samples is not None else []
    saved.state.eval_history[step] = results
    run.log.info("%s: %s", label, results)
    for reply in replies:
        run.log.info("  sample %r -> %r", reply["prompt"], reply["completion"])
    metrics.write({"step": step, **results, **({"samples": replies} if replies else {})})
    return step > 0 and saved.best is not None and saved.best.update(step, results)


def _harness_tasks(config) -> list[str]:
    """The config's lm-evaluation-harness tasks: a key of the causal-LM recipes' configs only (`CausalLMConfig`);
    a classifier's config has none to run."""
    return getattr(config, "eval_harness_tasks", None) or []


def _run_harness(run: Run, model, data, metrics, step: int, label: str) -> dict[str, Any]:
    """lm-evaluation-harness on the model in memory, every process together (`tunebook.evaluation.harness`), not
    counted as training time; its figures logged and written to metrics.jsonl (`harness/<task>/<metric>`). Returns
    summary.json's `eval_harness`, the same on every process."""
    from ..evaluation.harness import harness_figures, harness_summary, run_harness
    from .compilation import eager

    config = run.config
    tokenizer = data.processor.tokenizer if data.processor is not None else data.tokenizer
    with run.timer.paused(), eager():
        results = run_harness(model, tokenizer, config.eval_harness_tasks, run.accelerator,
                              limit=config.eval_harness_limit, num_fewshot=config.eval_harness_num_fewshot,
                              batch_size=config.eval_harness_batch_size or config.per_device_eval_batch_size,
                              chat_template=config.eval_harness_chat_template,
                              disable_tqdm=config.disable_tqdm)  # fmt: skip
    figures = harness_figures(results)  # the same on every process; the main one writes them
    run.log.info("%s (lm-evaluation-harness): %s", label, figures)
    metrics.write({"step": step, **figures})
    return harness_summary(results, step)


def _save(run: Run, loop: Training, reason: str) -> bool:
    """Save a checkpoint; False when the save failed (no space left on the device...): the run then stops with that
    error, raised by `finish` once the model is freed, on every process alike."""
    from .resumption import save_training_state

    saved, train_loader = loop.saved, loop.train_loader
    data = resumable(train_loader).state_dict()  # None for a map-style loader: the run state is its position
    try:
        with run.timer.paused():
            path = save_training_state(run.accelerator, run.output_dir, saved.state.global_step, run.config,
                                       saved.state.state_dict(), _saved_tokenizer(loop), saved.counters, saved.best,
                                       saved.figures, run.recipe, data, loop.lr_scheduler, saved.registered)  # fmt: skip
    except TrainingError as error:
        run.stop = error
        return False
    run.log.info("Saved checkpoint %s (%s)", path, reason)
    return True


def finish(run: Run, loop: Training, headline: tuple[str, str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """The end of a run: a stopped run frees the model and raises its stop (exit code, or the non-finite error);
    otherwise the final weights are evaluated, the best checkpoint's weights replace them when
    `load_best_model_at_end` finds a better one, the model is saved, and the summary, report and model card are
    written, and the run ends with its headline (`tunebook.run.record.headline`): `headline` = (metric, name, format)
    is the recipe's main metric there, "Eval <name>: <before> before training -> <after> after".
    Returns the summary (`extra` adds recipe-specific keys to it)."""
    from ..planning.at_start import measured_peak
    from ..run.record import finish_run, run_summary
    from .checkpoint import save_final_model

    config, state, accelerator, log = run.config, loop.state, run.accelerator, run.log
    saved, total_steps = loop.saved, loop.plan.total_steps
    loop.progress.close()
    if run.stop is not None:
        _free(run, loop)
        raise run.stop
    final_eval = {}
    if loop.evaluation is not None:
        step = state.global_step
        if step not in state.eval_history:  # the last step's own weights, before the best is chosen
            _evaluate(run, loop.evaluation, saved, loop.metrics, step, "Final evaluation", loop.samples)
        final_eval = state.eval_history[step]
        best = saved.best
        if config.load_best_model_at_end and best is not None and best.best_step not in (None, step):
            final_eval = _load_best(run, state, best, final_eval)
    if _harness_tasks(config):  # the weights the run keeps (the best checkpoint's with load_best_model_at_end)
        extra = {**extra, "eval_harness": _run_harness(run, loop.model, loop.data, loop.metrics, state.global_step,
                                                       "Final harness")}  # fmt: skip
    if total_steps > 0:
        try:
            save_final_model(accelerator, loop.model, _saved_tokenizer(loop), run.output_dir, config.merge_adapter)
        except TrainingError:  # no room for it: one line, raised once the model is freed
            _free(run, loop)
            raise
    if resumable(loop.train_loader).streams:  # the tokens each source actually gave
        extra = {**extra, "mixture_delivered": resumable(loop.train_loader).delivered(accelerator)}
        read = loop.train_loader.examples_read(accelerator)
        if read["examples_read"]:  # sft: what the cached path reports before training, known only now
            extra["streamed_examples"] = read
            if read["truncated"] or read["dropped_overlong"] or read["dropped_no_loss_tokens"]:
                log.warning("streamed train data: of %d examples read, %d truncated and %d dropped at "
                            "max_seq_length=%d, %d dropped with no loss-bearing token left", read["examples_read"],
                            read["truncated"], read["dropped_overlong"], config.max_seq_length,
                            read["dropped_no_loss_tokens"])  # fmt: skip
    summary = run_summary(
        run.recipe, config, accelerator, loop.throughput, loop.data, run.timer, saved.counters, saved.best,
        global_step=state.global_step,
        final_train_loss=state.last_train_loss,
        final_eval=final_eval,
        eval_before=state.eval_history.get(0, {}),
        skipped_updates=state.skipped_updates,
        resumed_from=saved.resumed_from,
        stopped_early=state.global_step < total_steps,  # only early stopping ends a finished run before its end
        **(loop.compiled.summary() if loop.compiled is not None else {}),
        **({"memory": {**run.memory_plan, **measured_peak(accelerator.device)}} if run.memory_plan else {}),
        **extra,
    )  # fmt: skip
    if accelerator.is_main_process:  # summary.json, report.png, the model card, then the run's headline
        finish_run(run.output_dir, summary, log, headline, run.timer.wall_seconds())
    _free(run, loop)
    return summary


def _saved_tokenizer(loop: Training):
    """What is saved beside the weights: the tokenizer, or a vision-language model's whole processor (its tokenizer,
    image processor and chat template), so that `AutoProcessor.from_pretrained` loads the output."""
    return loop.data.processor if loop.data.processor is not None else loop.data.tokenizer


def _load_best(run: Run, state: RunState, best: BestModel, final_eval: dict[str, Any]) -> dict[str, Any]:
    """Load the best checkpoint's weights, once it is verified (on the main process, for all); a damaged one is
    not loaded: the final step's weights are kept, and said so. Returns the evaluation of the weights kept."""
    from ..distributed import decided_by_main
    from .manifest import verify_checkpoint

    checkpoint = Path(best.best_checkpoint)
    problem = decided_by_main(run.accelerator, lambda: verify_checkpoint(checkpoint, run.log))
    if problem:
        run.log.warning("load_best_model_at_end: the best checkpoint %s (step %d) is damaged (%s); the final "
                        "step's weights are kept instead", checkpoint, best.best_step, problem)  # fmt: skip
        return final_eval
    run.accelerator.load_state(str(checkpoint))
    run.log.info("Loaded the best checkpoint %s (%s %.6g at step %d)", checkpoint, best.metric, best.best_value,
                 best.best_step)  # fmt: skip
    return state.eval_history[best.best_step]


def _free(run: Run, loop: Training) -> None:
    # Free the DDP model while the process group still exists: if the model outlives it, gloo's destructor runs
    # inside the model's and can deadlock on the GIL at exit (pytorch#56297).
    loop.model, loop.optimizer, loop.lr_scheduler = run.accelerator.free_memory(
        loop.model, loop.optimizer, loop.lr_scheduler
    )
    run.accelerator.end_training()
    if run.output_lock is not None:
        run.output_lock.release()
