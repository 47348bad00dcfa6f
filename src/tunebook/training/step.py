"""The optimizer step's guard, written once: the finite check across processes, and the update under `nan_policy`
and fp16 loss scaling.

A recipe shows its step as a handful of lines; the policy of a bad step lives here, in one helper::

    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf"))
    finite = finite_on_every_process(step_loss, grad_norm, accelerator)
    updated = optimizer_step_or_skip(run, state, optimizer, finite)
    learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step trained at
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)

The schedule steps and the gradients are zeroed whether or not the weights were updated, as the Trainer does: a
skipped step still counts as a step.
"""

from __future__ import annotations

import torch

from .guard import is_nonfinite, nonfinite_stop

__all__ = ["finite_on_every_process", "optimizer_step_or_skip"]


def finite_on_every_process(step_loss: torch.Tensor, grad_norm, accelerator) -> bool:
    """Whether the step's loss and gradient norm are finite on every process (one answer for all, one host sync).

    Under fp16 loss scaling only the loss is judged: gradients that overflow at the current scale are routine, and
    the scaler's to handle (`optimizer_step_or_skip`)."""
    if accelerator.scaler is not None:
        return not is_nonfinite(step_loss, 0.0, accelerator)
    return not is_nonfinite(step_loss, grad_norm, accelerator)


def optimizer_step_or_skip(run, state, optimizer, finite: bool) -> bool:
    """`optimizer.step()` for a step judged `finite` on every process; otherwise `nan_policy` decides: `stop` sets
    `run.stop` (the loop then ends without logging or saving this step), `skip` leaves the weights as they were and
    counts the step in `state.skipped_updates`. Under fp16 loss scaling the scaler's step may skip too (an overflow).
    Returns True when the weights were updated."""
    if not finite and run.config.nan_policy == "stop":
        run.stop = nonfinite_stop(state.global_step, run.output_dir)
        return False
    if run.accelerator.scaler is not None:
        return _scaled_step(run, state, optimizer)
    if not finite:
        state.skipped_updates += 1
        run.log.warning("Step %d: non-finite loss or gradient norm, update skipped (%d so far)",
                        state.global_step + 1, state.skipped_updates)  # fmt: skip
        return False
    optimizer.step()
    return True


def _scaled_step(run, state, optimizer) -> bool:
    """The update under fp16 loss scaling. Gradients that overflow at the current scale are routine (the first
    steps at 2**16, and again each time the scale has grown): the scaler skips that update and lowers the scale,
    which it does only inside the optimizer's step, so the step is always taken; skipping it as a non-finite step
    would leave the scale too high for good (and the next unscale would fail). A non-finite loss, which no scale
    fixes, is a bad step for `nan_policy: stop` (judged before); under `skip` the scaler skips it as an overflow."""
    scaler = run.accelerator.scaler
    scale = scaler.get_scale()
    optimizer.step()  # the scaler's: no update if any gradient is inf/NaN, and then a lower scale
    # Not `optimizer.step_was_skipped`: a fused optimizer (AdamW's default here) skips inside its own step, which
    # Accelerate then counts as taken. The scale goes down exactly when the scaler found inf/NaN gradients.
    if scaler.get_scale() >= scale:
        return True
    state.skipped_updates += 1
    run.log.warning("Step %d: gradients overflowed in fp16, update skipped, loss scale lowered to %g (%d so far)",
                    state.global_step + 1, scaler.get_scale(), state.skipped_updates)  # fmt: skip
    return False
