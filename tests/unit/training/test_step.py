"""The step's guard (`tunebook.training.step`) on a tiny in-process model: the finite check across processes, and the
update or skip under `nan_policy` and fp16 loss scaling. No launch, no recipe."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tunebook.errors import TrainingError
from tunebook.training import finite_on_every_process, optimizer_step_or_skip

NAN, INF = float("nan"), float("inf")


def _accelerator(scaler=None):
    return SimpleNamespace(scaler=scaler, num_processes=1, device=torch.device("cpu"))


def _setup(tmp_path, nan_policy="stop", scaler=None, global_step=4):
    """A one-layer model with gradients from one backward, its optimizer (stepping through `scaler`, as Accelerate's
    prepared optimizer does under fp16), the run and the loop's state."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.ones(2, 3)).sum()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    optimizer = inner
    if scaler is not None:

        class ScaledOptimizer:  # what AcceleratedOptimizer.step does with a scaler
            param_groups = inner.param_groups

            def step(self):
                scaler.step(inner)
                scaler.update()

        optimizer = ScaledOptimizer()
    run = SimpleNamespace(config=SimpleNamespace(nan_policy=nan_policy), accelerator=_accelerator(scaler),
                          output_dir=tmp_path, log=logging.getLogger("tunebook"), stop=None)  # fmt: skip
    state = SimpleNamespace(global_step=global_step, skipped_updates=0)
    return model, optimizer, run, state


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("loss", "norm", "finite"), [(1.0, 2.0, True), (NAN, 2.0, False), (INF, 2.0, False), (1.0, NAN, False),
                                 (1.0, INF, False)]
)  # fmt: skip
def test_the_finite_check_judges_the_loss_and_the_gradient_norm(loss, norm, finite):
    assert (
        finite_on_every_process(torch.tensor(loss, dtype=torch.float64), torch.tensor(norm), _accelerator()) is finite
    )


def test_under_fp16_scaling_only_the_loss_is_judged():
    """An overflowing gradient norm is routine at a high loss scale: the scaler's to skip, not a bad step."""
    scaler = torch.amp.GradScaler("cpu")
    assert finite_on_every_process(torch.tensor(1.0), torch.tensor(INF), _accelerator(scaler))
    assert not finite_on_every_process(torch.tensor(NAN), torch.tensor(1.0), _accelerator(scaler))


def test_a_finite_step_updates_the_weights(tmp_path):
    model, optimizer, run, state = _setup(tmp_path)
    before = _weights(model)
    assert optimizer_step_or_skip(run, state, optimizer, finite=True)
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert state.skipped_updates == 0 and run.stop is None


def test_nan_policy_skip_keeps_the_weights_and_counts_the_step(tmp_path, caplog):
    model, optimizer, run, state = _setup(tmp_path, nan_policy="skip")
    before = _weights(model)
    with caplog.at_level(logging.WARNING, logger="tunebook"):
        assert not optimizer_step_or_skip(run, state, optimizer, finite=False)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert state.skipped_updates == 1 and run.stop is None
    assert "Step 5: non-finite loss or gradient norm, update skipped (1 so far)" in caplog.text


def test_nan_policy_stop_keeps_the_weights_and_stops_the_run_naming_the_step(tmp_path):
    model, optimizer, run, state = _setup(tmp_path, nan_policy="stop")
    before = _weights(model)
    assert not optimizer_step_or_skip(run, state, optimizer, finite=False)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert isinstance(run.stop, TrainingError) and "non-finite loss or gradient norm at step 5" in str(run.stop)
    assert "Last good checkpoint: none" in str(run.stop) and state.skipped_updates == 0


def test_fp16_overflow_is_the_scalers_skip_counted_and_the_scale_lowered(tmp_path, caplog):
    """At 2**40 the scaled gradients overflow: the scaler's step skips the update and lowers the scale; the step is
    counted as skipped and the run goes on, even under nan_policy: stop."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-12)
    model, optimizer, run, state = _setup(tmp_path, nan_policy="stop", scaler=scaler)
    model.weight.grad[0, 0] = INF  # as an overflow at this scale
    before = _weights(model)
    with caplog.at_level(logging.WARNING, logger="tunebook"):
        assert not optimizer_step_or_skip(run, state, optimizer, finite=True)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert scaler.get_scale() == 2.0**28 and state.skipped_updates == 1 and run.stop is None
    assert "gradients overflowed in fp16, update skipped, loss scale lowered to 2.68435e+08" in caplog.text


def test_fp16_without_overflow_updates(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    model, optimizer, run, state = _setup(tmp_path, scaler=scaler)
    before = _weights(model)
    assert optimizer_step_or_skip(run, state, optimizer, finite=True)
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert scaler.get_scale() == 2.0**4 and state.skipped_updates == 0


@pytest.mark.parametrize(("nan_policy", "stopped"), [("stop", True), ("skip", False)])
def test_fp16_non_finite_loss_stops_under_stop_and_is_the_scalers_under_skip(tmp_path, nan_policy, stopped):
    """No scale fixes a non-finite loss: `stop` ends the run without stepping; under `skip` the scaler's step finds
    the NaN gradients and skips (counted)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    model, optimizer, run, state = _setup(tmp_path, nan_policy=nan_policy, scaler=scaler)
    model.weight.grad[0, 0] = NAN
    assert not optimizer_step_or_skip(run, state, optimizer, finite=False)
    assert (run.stop is not None) is stopped
    assert state.skipped_updates == (0 if stopped else 1)
    assert scaler.get_scale() == (2.0**4 if stopped else 2.0**3)  # stopped: the scaler never stepped
