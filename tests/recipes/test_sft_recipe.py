"""End-to-end runs of recipes/sft.py through `tunebook train` and `accelerate launch`, shrunk by overrides."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from support import ASSETS, ROOT, TINY_TEST_MODEL, assert_png, launch

pytestmark = pytest.mark.slow
TINY = ["--model_config", json.dumps(TINY_TEST_MODEL), "--disable_tqdm", "true"]
SMALL = [
    *TINY,
    *"""--synthetic_train_size 300 --synthetic_eval_size 20 --max_steps 6 --logging_steps 2
    --per_device_train_batch_size 8 --generation_max_new_tokens 8""".split(),
]  # fmt: skip


def _ok(result):
    assert result.returncode == 0, (
        f"exit {result.returncode}\nSTDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-4000:]}"
    )
    return result


def test_sft_writes_a_loadable_model_and_standard_outputs(tmp_path, monkeypatch):
    out = tmp_path / "run"
    # Its own cache: in the suite an earlier test has tokenised this data already, and this run must do it itself.
    monkeypatch.setenv("TUNEBOOK_CACHE", str(tmp_path / "cache"))
    args = [*SMALL, "--output_dir", str(out), "--save_steps", "3", "--report_to", "tensorboard", "--peak_flops", "1e12"]  # fmt: skip
    first = _ok(launch("recipes/sft.py", args, in_process=False))  # a fresh process: what it prints at import
    assert "tokenised and cached" in first.stdout
    # No progress bar (disable_tqdm): each logging step is a log line.
    assert "INFO tunebook: Step 4/6: loss " in first.stdout and "tok/s" in first.stdout
    # The untrained model's answers say so; the run ends with a few headline lines, not the summary's 40-row table.
    assert "INFO tunebook:   before training: generated " in first.stdout
    assert "INFO tunebook:   step 6: generated " in first.stdout
    ending = [line.split("INFO tunebook: ", 1)[1] for line in first.stdout.splitlines()[-4:]]
    took = r"(?:[0-9.]+ s|\d+ min \d\d s)"
    assert re.fullmatch(rf"Trained 6 steps in {took} \({took} in all\), [0-9,]+ tokens/s, final train loss [0-9.]+",
                        ending[0]), ending  # fmt: skip
    assert re.fullmatch(r"Eval exact match: 0\.\d{3} before training -> 0\.\d{3} after \(eval loss [0-9.]+ -> [0-9.]+\)",
                        ending[1]), ending  # fmt: skip
    assert ending[2].startswith(f"Outputs in {out}: the model and tokenizer, summary.json (every figure), report.png")
    assert ending[3] == (f"Load it: from transformers import AutoModelForCausalLM; "
                         f'model = AutoModelForCausalLM.from_pretrained("{out}")')  # fmt: skip
    assert "Run summary:" not in first.stdout and "attention_span" not in first.stdout  # the table: log_level DEBUG
    # Installed for the tests, DeepSpeed is imported by Accelerate's unwrapping; on a CPU it used to warn of no GPU.
    assert "unable to detect" not in first.stdout + first.stderr

    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (out / "model.safetensors").is_file() and model.config.num_hidden_layers == 2
    assert tokenizer.chat_template and tokenizer.pad_token == "<|pad|>"
    generator = pipeline("text-generation", model=str(out))
    reply = generator([{"role": "user", "content": "Reverse the digits.\n123"}], max_new_tokens=4)
    assert reply[0]["generated_text"][-1]["role"] == "assistant"

    summary = json.loads((out / "summary.json").read_text())
    for key in [
        "recipe",
        "train_steps",
        "train_tokens",
        "train_runtime_seconds",
        "train_tokens_per_second",
        "time_to_first_step_seconds",
        "final_train_loss",
        "eval",
        "padding_fraction",
        "peak_rss_mb",
        "num_processes",
        "mixed_precision",
        "versions",
    ]:
        assert key in summary, key
    assert summary["train_steps"] == 6 and summary["num_processes"] == 1 and summary["train_tokens"] > 0
    assert 0 <= summary["padding_fraction"] < 1
    assert {"eval_loss", "eval_perplexity", "eval_exact_match"} <= set(summary["eval"])
    assert set(summary["versions"]) >= {"torch", "transformers", "accelerate", "datasets"}

    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["max_steps"] == 6 and resolved["model_config"] == TINY_TEST_MODEL
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [2, 4, 6]
    per_log = {"learning_rate", "tokens_per_second", "samples_per_second", "grad_norm", "data_wait_fraction"}
    assert all(per_log | {"mfu", "peak_rss_mb", "train_tokens"} <= set(r) for r in train_records)
    previous = 0
    for r in train_records:
        window_tokens, previous = r["train_tokens"] - previous, r["train_tokens"]
        # 2 steps x 8 examples per logging window, over the same training time as its tokens
        assert r["tokens_per_second"] / r["samples_per_second"] == pytest.approx(window_tokens / 16)
        assert r["mfu"] == pytest.approx(summary["model_flops_per_token"] * r["tokens_per_second"] / 1e12, rel=1e-9)
    assert summary["train_samples"] == 6 * 8 and summary["mfu"] > 0
    assert_png(out / "report.png")
    assert 0 <= summary["data_wait_fraction"] <= 1 and summary["data_prep_seconds"] > 0
    assert summary["packing_efficiency"] is None  # not packed
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3", "step-6"]
    _assert_tensorboard_has_the_metrics(out, train_records, [r for r in records if "eval_loss" in r])

    # Same inputs again: no tokenisation. Then continue from the saved model directory.
    second = _ok(launch("recipes/sft.py", [*SMALL, "--output_dir", str(tmp_path / "again")]))
    assert second.stdout.count("loaded from cache, no tokenisation") == 2
    resumed = _ok(
        launch(
            "recipes/sft.py",
            [
                *SMALL[2:],
                "--model_name_or_path",
                str(out),
                "--output_dir",
                str(tmp_path / "continued"),
                "--disable_tqdm",
                "true",
            ],
        )
    )
    assert "Reusing" not in resumed.stdout  # the tokenizer came with the model
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "continued").config.num_hidden_layers == 2


def _assert_tensorboard_has_the_metrics(out, train_records, eval_records):
    """TensorBoard's own reader finds every metrics.jsonl value under train/ and eval/, at its step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((out / "runs").glob("sft/events.out.tfevents.*"))
    assert runs, f"no event file under {out / 'runs'}"
    events = EventAccumulator(str(runs[0].parent)).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_second"} <= tags
    assert {"eval/loss", "eval/perplexity", "eval/exact_match"} <= tags
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in train_records]
    assert [e.step for e in events.Scalars("eval/loss")] == [r["step"] for r in eval_records] == [0, 6]


def test_sft_on_user_files_with_a_weighted_mixture(tmp_path):
    data = [{"path": str(ASSETS / "alpaca.json"), "weight": 3}, str(ASSETS / "chat.jsonl")]
    out = tmp_path / "files"
    _ok(
        launch(
            "recipes/sft.py",
            [
                *TINY,
                "--train_data",
                json.dumps(data),
                "--eval_data",
                str(ASSETS / "chat.jsonl"),
                "--max_steps",
                "2",
                "--output_dir",
                str(out),
                "--generation_eval",
                "false",
            ],
        )
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["examples_kept"] == 3 * 3 + 2
    assert "eval_exact_match" not in summary["eval"] and summary["eval"]["eval_tokens"] > 0


def test_eval_only_loss_is_the_same_packed_and_padded(tmp_path):
    """Evaluation only, on the same data and model, padded and packed: the packed examples must not see each other."""
    summaries = {}
    for packing in ("false", "true"):
        out = tmp_path / f"eval-only-packing-{packing}"
        args = [*SMALL, "--max_steps", "0", "--packing", packing, "--max_seq_length", "96", "--output_dir", str(out)]
        result = _ok(launch("recipes/sft.py", [*args, "--generation_eval", "false"]))
        summaries[packing] = json.loads((out / "summary.json").read_text())
        assert summaries[packing]["train_steps"] == 0 and not (out / "model.safetensors").exists()
    assert "causal attention per example over cumulative lengths" in result.stdout
    padded, packed = summaries["false"]["eval"], summaries["true"]["eval"]
    assert packed["eval_tokens"] == padded["eval_tokens"] > 0
    assert packed["eval_loss"] == pytest.approx(padded["eval_loss"], rel=1e-5)
    assert summaries["true"]["data"]["packed_rows"] < summaries["true"]["data"]["examples_kept"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--lerning_rate", "1e-4"],
            "unknown config key 'lerning_rate' (in command line); did you mean 'learning_rate'?",
        ),
        (["--train_data", str(ASSETS / "malformed.jsonl")], "malformed.jsonl, line 2: malformed JSON"),
        (["--train_data", str(ASSETS / "missing_columns.jsonl")], "cannot tell the data format from columns"),
        (["--model_name_or_path", "./no/such/model"], "model path not found: ./no/such/model"),
        (["--model_config", "./no/such/config.json"], "model_config file not found: ./no/such/config.json"),
    ],
)
def test_user_errors_are_one_readable_line(args, message, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes/sft.py"), *args, "--output_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("tunebook: error: ")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_user_error_under_accelerate_launch_has_no_traceback(tmp_path):
    result = launch("recipes/sft.py", ["--max_stepz", "3", "--output_dir", str(tmp_path)], in_process=False)
    assert result.returncode != 0
    assert "tunebook: error: unknown config key 'max_stepz'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
def test_two_process_gloo_launch(tmp_path):
    out = tmp_path / "ddp"
    args = [*SMALL, "--output_dir", str(out), "--max_seq_length", "26"]  # some examples truncated: a warning
    result = _ok(launch("recipes/sft.py", args, accelerate_config="multi_cpu.yaml", launcher="accelerate"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2
    assert "2 process(es)" in result.stdout
    # Both processes hit the same warning; it is printed once, by the main process.
    assert result.stdout.count("truncated and 0 dropped at max_seq_length=26") == 2  # train and eval data
    assert "[rank 1]" not in result.stdout
    assert result.stdout.count("INFO tunebook: Trained 6 steps") == 1 and summary["train_samples"] == 6 * 8 * 2
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def test_default_recipe_learns_the_synthetic_task(tmp_path):
    """The embedded default as `make train` runs it: exact match >= 0.8 after training, about 0 before."""
    out = tmp_path / "default"
    _ok(
        launch(
            "recipes/sft.py", ["--output_dir", str(out), "--disable_tqdm", "true"], timeout=400, launcher="accelerate"
        )
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_before_training"]["eval_exact_match"] <= 0.05
    assert summary["eval"]["eval_exact_match"] >= 0.8


def test_overlong_examples_are_dropped_with_a_warning_and_counted(tmp_path, tiny_tokenizer):
    from tunebook.data import load_conversations, parse_sources, tokenize_conversations

    tokenizer_dir = tmp_path / "tokenizer"
    tiny_tokenizer.save_pretrained(tokenizer_dir)
    sources = parse_sources(str(ASSETS / "chat.jsonl"), "train_data")
    conversations = load_conversations(sources, "auto", tmp_path / "cache", seed=0)
    lengths = sorted(
        len(ids)
        for ids in tokenize_conversations(
            {"conversation": conversations["conversation"]},
            tokenizer=tiny_tokenizer,
            max_seq_length=10_000,
            overlong="truncate",
            assistant_only_loss=True,
        )["input_ids"]
    )
    out = tmp_path / "drop"
    result = _ok(
        launch(
            "recipes/sft.py",
            [
                *TINY,
                "--train_data",
                str(ASSETS / "chat.jsonl"),
                "--max_steps",
                "1",
                "--tokenizer_name_or_path",
                str(tokenizer_dir),
                "--overlong_examples",
                "drop",
                "--max_seq_length",
                str(lengths[0]),
                "--output_dir",
                str(out),
            ],
        )
    )
    assert f"0 truncated and 1 dropped at max_seq_length={lengths[0]}" in result.stdout
    assert "WARNING" in result.stdout
    stats = json.loads((out / "summary.json").read_text())["data"]
    assert stats["dropped_overlong"] == 1 and stats["examples_kept"] == 1
