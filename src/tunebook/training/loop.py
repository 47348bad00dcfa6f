"""The training loop's bookkeeping, written once for every recipe: start, resume, epochs, the update, what follows
each step (log, evaluate, best model, stop signals, save), and the end of the run.

A recipe keeps in view what differs between tasks: its data, its model and the forward/backward of its loss::

    run = start_run(config, "sft")
    ...                                             # data, model, optimizer, loaders, accelerator.prepare
    plan_training(run, model, optimizer, train_loader)
    resume(run, data, figures, evaluate)
    for loader in epochs(run, train_loader):
        for window in accumulation_windows(loader, k, run.timer):
            ...                                     # the loss of each micro-batch, backward
            if apply_update(run, step_loss, window):
                figures.add(...)                    # the window's logged figures: only steps that updated
            if after_step(run):
                break
    return finish(run, evaluate, tokenizer, data)

These are plain functions over one `Run` record: no callbacks, no subclassing. The order they keep is the one with
a right answer: a non-finite step is judged on every process before anything is logged; a stop signal saves after
the step's evaluation; the best model is chosen only after the final step's weights were evaluated; the model is
freed before the process group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from ..data.resumable import resumable
from ..errors import TrainingError
from ..models.kernels import check_flex_attention
from .best import BestModel
from .counters import TrainCounters
from .guard import StopSignals, exit_code, is_nonfinite, nonfinite_stop
from .optim import build_scheduler
from .steps import eval_due, save_due, total_optimizer_steps

__all__ = ["Run", "RunState", "after_step", "apply_update", "epochs", "finish", "plan_training", "resume", "start_run"]


@dataclass
class RunState:
    """Where the loop is, saved whole in every checkpoint (`trainer_state.json`)."""

    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # this epoch's micro-batches already trained on (per process)
    skipped_updates: int = 0  # non-finite steps dropped under nan_policy: skip
    last_train_loss: float | None = None  # the mean over the last logging window (summary.json's final_train_loss)
    eval_history: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> evaluation results

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RunState:
        known = {k: v for k, v in state.items() if k in cls.__dataclass_fields__}
        known["eval_history"] = {int(step): m for step, m in (known.get("eval_history") or {}).items()}
        return cls(**known)


@dataclass
class Run:
    """One run's machinery and state, which the loop functions read and update. Fields are filled as the run goes:
    `start_run` (config to cache_dir), `plan_training` (steps), `resume` (the prepared objects and the state)."""

    config: Any
    recipe: str
    accelerator: Accelerator
    log: logging.Logger
    timer: Any  # tunebook.run.logging.RunTimer
    output_dir: Path
    cache_dir: Path
    total_steps: int = 0
    steps_per_epoch: int = 1
    state: RunState = field(default_factory=RunState)
    checkpoint: Path | None = None  # the checkpoint this run resumed from
    model: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    train_loader: Any = None
    evaluate: Callable[[], dict[str, Any]] | None = None
    tokenizer: Any = None
    figures: Any = None  # the window's logged training figures: add(...), pop(accelerator) -> {"loss": ...}
    counters: TrainCounters | None = None
    best: BestModel | None = None
    metrics: Any = None  # tunebook.run.logging.MetricsWriter
    progress: Any = None
    throughput: Any = None  # tunebook.training.Throughput
    compiled: Any = None  # tunebook.training.compilation.CompiledBlocks, with torch_compile
    signals: StopSignals = field(default_factory=StopSignals)
    grad_norm: Any = None  # of the last step
    learning_rate: float = 0.0  # the rate the last step trained at
    stop: BaseException | None = None  # what ends the run early, raised by `finish` once the model is freed
    output_lock: Any = None  # tunebook.run.output_lock.OutputDirLock, released when the run ends


def start_run(config, recipe: str) -> Run:
    """Timer, Accelerator, logging, seed, output and cache folders, `config.yaml`, the start-up log."""
    from accelerate.utils import set_seed

    from ..cli.launch import resume_collector
    from ..config import save_config
    from ..data.loaders import start_worker_server
    from ..run.logging import log_run_start, setup_logging
    from ..run.output_lock import lock_run_output_dir
    from ..run.record import RunTimer
    from .accelerator import recipe_accelerator
    from .resumption import prepare_output_dir

    resume_collector(freeze=True)  # paused by `tunebook train` while the recipe imported its libraries
    timer = RunTimer()
    accelerator = recipe_accelerator(config)  # engine, trackers, timeouts from the config and the launcher
    start_worker_server(config.dataloader_num_workers)  # several processes: workers come from a fork server
    log = setup_logging(accelerator.is_main_process, config.log_level, config.disable_tqdm)
    set_seed(config.seed)
    output_dir = Path(config.output_dir)
    cache_dir = Path(config.cache_dir).expanduser()  # resolved by the config when unset
    # One run per output_dir, for the run's lifetime: a second run there stops now, naming this one's PID and host.
    output_lock = lock_run_output_dir(accelerator, output_dir, recipe)
    prepare_output_dir(accelerator, config, log)  # another run's checkpoints there: resume, overwrite, or stop
    if accelerator.is_main_process:
        save_config(config, output_dir / "config.yaml", recipe)
    log_run_start(log, config, accelerator)
    return Run(config, recipe, accelerator, log, timer, output_dir, cache_dir, output_lock=output_lock)


def plan_training(
    run: Run, model, optimizer, train_loader, unit: str = "micro-batches", updates_per_window: int = 1
) -> None:
    """Total and per-epoch optimizer steps from the prepared loader (`updates_per_window` optimizer steps per
    accumulation window), and the learning-rate schedule over them; the run keeps the prepared model, optimizer,
    schedule and loader. With `torch_compile` (true, or auto where it pays back), the model's transformer
    blocks are compiled here, after the model is wrapped and any frozen reference copied from it."""
    config, accelerator = run.config, run.accelerator
    check_flex_attention(model, accelerator.device)  # packed or not, before a first forward fails inside inductor
    k = config.gradient_accumulation_steps
    run.total_steps, run.steps_per_epoch = total_optimizer_steps(
        config.max_steps, config.num_train_epochs, len(train_loader), k, updates_per_window
    )
    if config.torch_compile:  # true or auto
        from ..data.loaders import fixed_batch_shape
        from .compilation import compile_blocks, should_compile

        static = fixed_batch_shape(train_loader) is not None
        compiled, why = should_compile(config, accelerator, static, run.total_steps * k // updates_per_window)
        if config.torch_compile == "auto":
            run.log.info(why)
        if compiled:
            run.compiled = compile_blocks(model, static=static, fallback=config.torch_compile == "auto")
            run.log.info("torch_compile: %d %s blocks, compiled in the first step (%s shapes)", run.compiled.blocks,
                         run.compiled.block_class, run.compiled.shapes)  # fmt: skip
    lr_scheduler = accelerator.prepare(
        build_scheduler(config.lr_scheduler_type, optimizer, run.total_steps, config.warmup_ratio)
    )
    # Under DeepSpeed, Accelerate (1.15) hands back a scheduler prepared apart from its model unwrapped and
    # unregistered, so `save_state` leaves it out: checkpoints then hold its state as JSON (`schedule_state`), not
    # as a custom object, which Accelerate would unpickle with `weights_only=False` on resume.
    run.log.info("Training %d optimizer steps (%d per epoch) of %d x %d %s x %d process(es)", run.total_steps,
                 run.steps_per_epoch, k, config.per_device_train_batch_size, unit, accelerator.num_processes)  # fmt: skip
    run.model, run.optimizer, run.lr_scheduler, run.train_loader = model, optimizer, lr_scheduler, train_loader


def resume(run: Run, data, figures, evaluate: Callable[[], dict] | None) -> None:
    """Start the loop's state: from a checkpoint (model, optimizer, scheduler, RNG states, data position, counters,
    best model, logged `figures`) when asked to resume, else fresh; the trackers and `metrics.jsonl`; an evaluation
    before training (`eval_on_start`). `data` is the prepared data (its tokenizer goes into checkpoints, its training
    rows give the FLOPs per token); `evaluate()` runs the recipe's evaluation (None: there is no eval data)."""
    from ..run.logging import progress_bar
    from ..run.record import MetricsWriter
    from ..run.trackers import start_trackers
    from .resumption import resume_training
    from .throughput import Throughput

    config, accelerator = run.config, run.accelerator
    run.evaluate, run.tokenizer, run.figures = evaluate, data.tokenizer, figures
    run.counters = TrainCounters.zeros(accelerator.device)
    run.best = BestModel.from_config(config) if evaluate is not None else None  # best checkpoint, early stopping
    stream = run.train_loader if resumable(run.train_loader).streams else None
    run.checkpoint, state = resume_training(
        accelerator, config, run.counters, run.best, figures, run.log, run.optimizer, run.lr_scheduler, stream
    )
    run.state = RunState.from_state_dict(state)
    if run.checkpoint is not None:
        run.log.info("Resumed from %s: step %d, epoch %d, %d batches into it", run.checkpoint, run.state.global_step,
                     run.state.epoch, run.state.batches_in_epoch)  # fmt: skip
    start_trackers(accelerator, config, run.recipe)  # tensorboard etc.: the config now, every metrics record below
    resumed_step = run.state.global_step if run.checkpoint else None
    run.metrics = MetricsWriter(
        run.output_dir / "metrics.jsonl", accelerator.is_main_process, resumed_step, accelerator
    )
    if evaluate is not None and config.eval_on_start and run.checkpoint is None:
        _evaluate(run, 0, "Before training")
    run.progress = progress_bar(accelerator.is_main_process, config.disable_tqdm, total=run.total_steps,
                                initial=run.state.global_step, desc="Training")  # fmt: skip
    run.throughput = Throughput(accelerator, run.model, data.train, run.timer, run.counters, config.peak_flops)
    run.model.train()
    run.timer.start_training()


def epochs(run: Run, train_loader) -> Iterator[Any]:
    """The epochs left to train, each as its loader; a resumed run's epoch skips the micro-batches it had trained
    on, at the sampler (nothing is read twice). Ends at the last step, an early stop, or a stop request. While it
    runs, SIGTERM and Ctrl-C ask the loop to finish its step, save and stop (`after_step`); the previous handlers
    come back when it ends, however it ends."""
    state, accelerator = run.state, run.accelerator
    with run.signals:
        while state.global_step < run.total_steps and run.stop is None and not (run.best and run.best.should_stop()):
            train_loader.set_epoch(state.epoch)
            skip = 0 if resumable(train_loader).streams else state.batches_in_epoch
            loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
            loader.set_epoch(state.epoch)
            yield loader
            if state.batches_in_epoch >= len(train_loader):
                state.epoch, state.batches_in_epoch = state.epoch + 1, 0


def apply_update(run: Run, step_loss: torch.Tensor, window: list) -> bool:
    """One optimizer step after the window's backward passes: clip the gradients, check the step's loss and
    gradient norm on every process (`nan_policy`: stop, or skip the update), step optimizer and scheduler.
    Returns True when the weights were updated; the recipe then adds the step to its logged figures."""
    config, state, accelerator = run.config, run.state, run.accelerator
    state.batches_in_epoch += len(window)
    run.grad_norm = accelerator.clip_grad_norm_(run.model.parameters(), config.max_grad_norm or float("inf"))
    if accelerator.scaler is not None:
        updated = _scaled_update(run, step_loss)
        if run.stop is not None:
            return False
    else:
        updated = not is_nonfinite(step_loss, run.grad_norm, accelerator)
        if not updated:
            if config.nan_policy == "stop":
                run.stop = nonfinite_stop(state.global_step, run.output_dir)
                return False
            state.skipped_updates += 1
            run.log.warning("Step %d: non-finite loss or gradient norm, update skipped (%d so far)",
                            state.global_step + 1, state.skipped_updates)  # fmt: skip
        else:
            run.optimizer.step()
    # Logged as the step's rate: read after `lr_scheduler.step()`, as the Trainer does, it is the next step's (a
    # warm-up's first step, trained at 0, would show the full rate).
    run.learning_rate = run.lr_scheduler.get_last_lr()[0]
    run.lr_scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    state.global_step += 1
    run.timer.step_done()
    if run.compiled is not None:
        run.compiled.step_done()
    run.progress.update(1)
    return updated


def _scaled_update(run: Run, step_loss: torch.Tensor) -> bool:
    """The update under fp16 loss scaling. Gradients that overflow at the current scale are routine (the first
    steps at 2**16, and again each time the scale has grown): the scaler skips that update and lowers the scale,
    which it does only inside the optimizer's step, so the step is always taken; skipping it as a non-finite step
    would leave the scale too high for good (and the next unscale would fail). Only a non-finite loss, which no
    scale fixes, is a bad step for `nan_policy`. Returns True when the weights were updated."""
    config, state = run.config, run.state
    if config.nan_policy == "stop" and is_nonfinite(step_loss, 0.0, run.accelerator):
        run.stop = nonfinite_stop(state.global_step, run.output_dir)
        return False
    scaler = run.accelerator.scaler
    scale = scaler.get_scale()
    run.optimizer.step()  # the scaler's: no update if any gradient is inf/NaN, and then a lower scale
    # Not `optimizer.step_was_skipped`: a fused optimizer (AdamW's default here) skips inside its own step, which
    # Accelerate then counts as taken. The scale goes down exactly when the scaler found inf/NaN gradients.
    if scaler.get_scale() >= scale:
        return True
    state.skipped_updates += 1
    run.log.warning("Step %d: gradients overflowed in fp16, update skipped, loss scale lowered to %g (%d so far)",
                    state.global_step + 1, scaler.get_scale(), state.skipped_updates)  # fmt: skip
    return False


def after_step(run: Run) -> bool:
    """Log, evaluate, note the best model, honour a stop signal, save, stop early, as each falls due after an
    optimizer step. Returns True when the epoch's loop should end (the run stops or is done)."""
    from ..run.logging import show_progress

    config, state = run.config, run.state
    if run.stop is not None:  # a non-finite step under nan_policy: stop (nothing logged or saved after it)
        return True
    step = state.global_step
    if step % config.logging_steps == 0 or step == run.total_steps:
        figures = run.figures.pop(run.accelerator)  # means over the window's updated steps, all processes
        if figures["loss"] is not None:  # None: every step of the window was skipped as non-finite
            state.last_train_loss = figures["loss"]
        record = {
            "step": step,
            "epoch": round(step / run.steps_per_epoch, 3),
            **figures,
            "learning_rate": run.learning_rate,
            "grad_norm": float(run.grad_norm),
            **run.throughput.window(),  # tokens/s, samples/s, data wait, MFU, peak memory: all processes
            **_mixture_shares(run),
        }
        run.metrics.write(record)
        show_progress(run.progress, record, run.total_steps, run.log)
    epoch_done = state.batches_in_epoch >= len(run.train_loader)
    new_best = False
    if run.evaluate is not None and eval_due(config, step, run.total_steps, epoch_done):
        new_best = _evaluate(run, step, f"Step {step}")
    signum = run.signals.requested(run.accelerator)
    if signum:  # preemption or Ctrl-C: this step is done and evaluated; save it and leave
        if _save(run, f"stopped by signal {signum}"):
            run.log.warning("Stopped at step %d by signal %d. Resume with the same command plus "
                            "--resume_from_checkpoint latest", step, signum)  # fmt: skip
            run.stop = SystemExit(exit_code(signum))
        return True
    if (reason := save_due(config, step, epoch_done, new_best)) and not _save(run, reason):
        return True
    if run.best is not None and run.best.should_stop():
        best = run.best
        run.log.info("Early stopping at step %d: %s has not improved on %.6g (step %d) for %d evaluations",
                     step, best.metric, best.best_value, best.best_step, best.patience)  # fmt: skip
        return True
    return step >= run.total_steps


def _mixture_shares(run: Run) -> dict[str, float]:
    """A streamed mixture's share of the tokens trained on so far, per source (what was delivered, not asked)."""
    if len(resumable(run.train_loader).source_names) < 2:  # a map-style loader names none
        return {}
    return {f"mixture/{n}": d["share"] for n, d in resumable(run.train_loader).delivered(run.accelerator).items()}


def _evaluate(run: Run, step: int, label: str) -> bool:
    """Evaluate now (not counted as training time), log and record it; True if it is the best so far."""
    from .compilation import eager

    with run.timer.paused(), eager():  # evaluation's shapes would compile graphs of their own
        results = run.evaluate()
    run.state.eval_history[step] = results
    run.log.info("%s: %s", label, results)
    run.metrics.write({"step": step, **results})
    return step > 0 and run.best is not None and run.best.update(step, results)


def _save(run: Run, reason: str) -> bool:
    """Save a checkpoint; False when the save failed (no space left on the device...): the run then stops with that
    error, raised by `finish` once the model is freed, on every process alike."""
    from .resumption import save_training_state

    data = resumable(run.train_loader).state_dict()  # None for a map-style loader: the run state is its position
    try:
        with run.timer.paused():
            path = save_training_state(run.accelerator, run.output_dir, run.state.global_step, run.config,
                                       run.state.state_dict(), run.tokenizer, run.counters, run.best, run.figures,
                                       run.recipe, data, run.lr_scheduler)  # fmt: skip
    except TrainingError as error:
        run.stop = error
        return False
    run.log.info("Saved checkpoint %s (%s)", path, reason)
    return True


def finish(run: Run, data, headline: tuple[str, str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """The end of a run: a stopped run frees the model and raises its stop (exit code, or the non-finite error);
    otherwise the final weights are evaluated, the best checkpoint's weights replace them when
    `load_best_model_at_end` finds a better one, the model is saved, and the summary, report and model card are
    written. `headline` = (metric, name, format) logs "Eval <name>: <before> before training -> <after> after".
    Returns the summary (`extra` adds recipe-specific keys to it)."""
    from ..run.record import finish_run, run_summary
    from .checkpoint import save_final_model

    config, state, accelerator, log = run.config, run.state, run.accelerator, run.log
    run.progress.close()
    if run.stop is not None:
        _free(run)
        raise run.stop
    final_eval = {}
    if run.evaluate is not None:
        step = state.global_step
        if step not in state.eval_history:  # the last step's own weights, before the best is chosen
            _evaluate(run, step, "Final evaluation")
        final_eval = state.eval_history[step]
        best = run.best
        if config.load_best_model_at_end and best is not None and best.best_step not in (None, step):
            final_eval = _load_best(run, best, final_eval)
    if run.total_steps > 0:
        try:
            save_final_model(accelerator, run.model, run.tokenizer, run.output_dir, config.merge_adapter)
        except TrainingError:  # no room for it: one line, raised once the model is freed
            _free(run)
            raise
    if resumable(run.train_loader).streams:  # the tokens each source actually gave
        extra = {**extra, "mixture_delivered": run.train_loader.delivered(accelerator)}
        read = run.train_loader.examples_read(accelerator)
        if read["examples_read"]:  # sft: what the cached path reports before training, known only now
            extra["streamed_examples"] = read
            if read["truncated"] or read["dropped_overlong"] or read["dropped_no_loss_tokens"]:
                log.warning("streamed train data: of %d examples read, %d truncated and %d dropped at "
                            "max_seq_length=%d, %d dropped with no loss-bearing token left", read["examples_read"],
                            read["truncated"], read["dropped_overlong"], config.max_seq_length,
                            read["dropped_no_loss_tokens"])  # fmt: skip
    summary = run_summary(
        run.recipe, config, accelerator, run.throughput, data, run.timer, run.counters, run.best,
        global_step=state.global_step,
        final_train_loss=state.last_train_loss,
        final_eval=final_eval,
        eval_before=state.eval_history.get(0, {}),
        skipped_updates=state.skipped_updates,
        resumed_from=run.checkpoint,
        stopped_early=state.global_step < run.total_steps,  # only early stopping ends a finished run before its end
        **(run.compiled.summary() if run.compiled is not None else {}),
        **extra,
    )  # fmt: skip
    if accelerator.is_main_process:
        finish_run(run.output_dir, summary, log)  # summary.json, report.png, the model card, the table
        log.info("Model and tokenizer: %s", run.output_dir if run.total_steps > 0 else "(not saved: max_steps=0)")
        log.info("Summary: %s", run.output_dir / "summary.json")
        if headline and headline[0] in final_eval:
            metric, name, fmt = headline
            before = summary["eval_before_training"].get(metric)
            log.info("Eval %s: %s before training -> %s after", name, "n/a" if before is None else format(before, fmt),
                     format(final_eval[metric], fmt))  # fmt: skip
    _free(run)
    return summary


def _load_best(run: Run, best: BestModel, final_eval: dict[str, Any]) -> dict[str, Any]:
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
    return run.state.eval_history[best.best_step]


def _free(run: Run) -> None:
    # Free the DDP model while the process group still exists: if the model outlives it, gloo's destructor runs
    # inside the model's and can deadlock on the GIL at exit (pytorch#56297).
    run.model, run.optimizer, run.lr_scheduler = run.accelerator.free_memory(
        run.model, run.optimizer, run.lr_scheduler
    )
    run.accelerator.end_training()
    if run.output_lock is not None:
        run.output_lock.release()
