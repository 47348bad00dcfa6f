"""The run record: the run's clock (training time without pauses, data wait), the advice it gives, and the headline a
run ends with."""

from __future__ import annotations

import time

from tunebook.run.record import RunTimer, data_wait_advice, headline
from tunebook.training import accumulation_windows


def _slow_batches(n, delay):
    for i in range(n):
        time.sleep(delay)
        yield i


def test_data_wait_is_measured_and_paused_time_is_not_training_time():
    timer = RunTimer()
    timer.start_training()
    windows = list(accumulation_windows(_slow_batches(6, 0.02), 2, timer))
    assert windows == [[0, 1], [2, 3], [4, 5]]
    # Six 20 ms waits (more on a loaded machine): the first is the loader's start-up, reported on its own.
    assert 0.1 <= timer.data_wait_seconds < 2.0 and timer.first_batch_seconds >= 0.02
    with timer.paused():
        time.sleep(0.2)  # an evaluation: neither training time nor data wait
    assert timer.paused_seconds >= 0.2
    assert timer.train_runtime() < timer.data_wait_seconds + 0.1  # the paused 0.2 s is not training time
    assert timer.data_wait_fraction() > 0.6  # the loop did nothing but wait
    seconds, waited = timer.window()
    assert waited / seconds > 0.6
    assert seconds < timer.data_wait_seconds + 0.1  # the paused time excluded
    time.sleep(0.05)
    seconds, waited = timer.window()  # the next window starts where the last ended
    assert 0.05 <= seconds < 0.5 and waited == 0


def test_an_evaluation_before_training_is_not_subtracted_from_the_training_time():
    timer = RunTimer()
    with timer.paused():
        time.sleep(0.2)  # eval_on_start: before the training clock starts
    timer.start_training()
    time.sleep(0.05)
    assert 0.05 <= timer.train_runtime() < 0.2  # was 0.05 - 0.2 < 0: negative tokens/s, no MFU in summary.json


def test_data_wait_advice_names_the_setting_to_change():
    assert data_wait_advice(0.04, 2, 2) is None
    assert "set dataloader_num_workers (now 0) to 2" in data_wait_advice(0.3, 0, 2)
    assert "raise dataloader_num_workers (now 2) or dataloader_prefetch_factor (now 2)" in data_wait_advice(0.06, 2, 2)
    streamed = data_wait_advice(0.2, 2, 2, streamed=True)  # the workers tokenise: more of them, or files to share
    assert "raise dataloader_num_workers (now 2): each worker tokenises" in streamed
    assert "a multiple of processes x workers files" in streamed and "tunebook prepare" in streamed


SUMMARY = {
    "recipe": "sft",
    "train_steps": 500,
    "train_runtime_seconds": 83.4,
    "train_tokens_per_second": 12345.6,
    "final_train_loss": 0.41234,
    "eval": {"eval_loss": 0.5, "eval_perplexity": 1.65, "eval_exact_match": 0.953},
    "eval_before_training": {"eval_loss": 5.6, "eval_perplexity": 270.4, "eval_exact_match": 0.0},
    "resumed_from": None,
    "stopped_early": False,
    "skipped_updates": 0,
    "output_dir": "outputs/sft-default",
    "attention_span": 27.8,
    "mfu": None,
}
LOAD = 'from transformers import AutoModelForCausalLM; model = AutoModelForCausalLM.from_pretrained("outputs/sft-default")'


def test_the_headline_says_what_training_did_and_where_the_model_is():
    lines = headline(SUMMARY, ("eval_exact_match", "exact match", ".3f"), wall_seconds=112.6,
                     outputs=["summary.json (every figure)"], load=LOAD)  # fmt: skip
    assert lines == [
        "Trained 500 steps in 1 min 23 s (1 min 53 s in all), 12,346 tokens/s, final train loss 0.4123",
        "Eval exact match: 0.000 before training -> 0.953 after (eval loss 5.6000 -> 0.5000)",
        "Outputs in outputs/sft-default: the model and tokenizer, summary.json (every figure)",
        f"Load it: {LOAD}",
    ]
    # Perplexity is the loss in other words: not said twice. No metric named: the eval loss.
    assert headline(SUMMARY, ("eval_perplexity", "perplexity", ".2f"))[1] == (
        "Eval perplexity: 270.40 before training -> 1.65 after"
    )
    assert headline(SUMMARY)[1] == "Eval loss: 5.6000 before training -> 0.5000 after"


def test_the_headline_of_a_resumed_stopped_or_unevaluated_run():
    resumed = {**SUMMARY, "resumed_from": "outputs/sft-default/checkpoints/step-200", "skipped_updates": 2,
               "eval_before_training": {}, "train_runtime_seconds": 7300.0}  # fmt: skip
    lines = headline(resumed, ("eval_exact_match", "exact match", ".3f"), load=LOAD)
    assert lines[0] == (
        "Trained steps 201-500 in 2 h 01 min, 12,346 tokens/s, final train loss 0.4123 (resumed from "
        "outputs/sft-default/checkpoints/step-200; 2 non-finite step(s) skipped)"
    )  # the time and speed are this run's, of the steps after the checkpoint
    assert lines[1] == "Eval exact match: n/a before training -> 0.953 after"
    stopped = headline({**SUMMARY, "stopped_early": True, "eval": {}, "final_train_loss": None})
    assert (
        stopped[0]
        == "Trained 500 steps in 1 min 23 s, 12,346 tokens/s (stopped early: the eval metric stopped improving)"
    )
    assert stopped[1:] == ["Outputs in outputs/sft-default: no model saved"]  # no eval line, no load line
    assert "nan" in headline({**SUMMARY, "final_train_loss": "nan"})[0]  # summary.json writes a NaN as a string
