"""recipes/reward.py end to end: the embedded default ranks held-out pairs (also through `load_reward_model`, as a
GRPO reward); the data shapes (explicit and implicit prompts, a margin column); evaluation exact on two processes."""

from __future__ import annotations

import json

import pytest
from support import TINY_TEST_MODEL, assert_png, launch

from tunebook import load_recipe

pytestmark = pytest.mark.slow
QUICK = {"disable_tqdm": True, "report_to": "none", "dataloader_num_workers": 0, "eval_on_start": True,
         "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8, "log_level": "WARNING",
         "model_config": TINY_TEST_MODEL, "max_steps": 2}  # fmt: skip


def _run(out, args, accelerate_config="cpu.yaml", timeout=300, launcher="tunebook"):
    result = launch("recipes/reward.py", [*args, "--output_dir", str(out)], accelerate_config=accelerate_config,
                    timeout=timeout, launcher=launcher)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), result


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The embedded default, run once for the module: (output_dir, cache_dir, summary, stdout)."""
    root = tmp_path_factory.mktemp("reward")
    # Estimated 1-2 minutes on 2 idle CPU cores; it took ~10 on a loaded one, hence the long timeouts.
    summary, result = _run(root / "out", ["--disable_tqdm", "true", "--cache_dir", str(root / "cache")], timeout=900,
                           launcher="accelerate")  # fmt: skip
    return root / "out", root / "cache", summary, result.stdout


@pytest.mark.timeout(1200)  # the module's default run happens in the first of these two tests
def test_default_ranks_held_out_pairs(default_run):
    from transformers import AutoModelForSequenceClassification

    out, _, summary, stdout = default_run
    before, after = summary["eval_before_training"], summary["eval"]
    assert after["eval_accuracy"] >= 0.8, after  # measured 0.84 on an AMD EPYC
    assert after["eval_margin"] > 0 and after["eval_loss"] < before["eval_loss"] and after["eval_pairs"] == 200
    assert "Eval pairwise accuracy: " in stdout and "One training pair:\nchosen:   <|im_start|>user\n" in stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "accuracy" in r and "eval_loss" not in r]
    assert [r["step"] for r in train] == list(range(25, 301, 25))
    assert {"loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected", "tokens_per_second"} <= set(train[-1])
    assert_png(out / "report.png")
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    assert type(model).__name__ == "LlamaForSequenceClassification"


@pytest.mark.timeout(1200)
def test_the_trained_model_is_a_reward_function(default_run):
    """`load_reward_model(output_dir)` (what a GRPO run's `reward_model: path` uses) ranks the held-out pairs."""
    from tunebook.preference import load_reward_model

    out, cache, summary, _ = default_run
    (held_out,) = cache.rglob("preferences-*/eval.jsonl")
    pairs = [json.loads(line) for line in held_out.read_text().splitlines()]
    score = load_reward_model(out, batch_size=48)
    prompts = [p["prompt"] for p in pairs]
    chosen, rejected = score(prompts, [p["chosen"] for p in pairs]), score(prompts, [p["rejected"] for p in pairs])
    accuracy = sum(c > r for c, r in zip(chosen, rejected)) / len(pairs)
    assert accuracy >= 0.8 and accuracy == pytest.approx(summary["eval"]["eval_accuracy"], abs=0.011)
    assert sum(chosen) / len(chosen) == pytest.approx(summary["eval"]["eval_rewards/chosen"], abs=1e-4)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_explicit_prompts_with_a_margin_column(tmp_path):
    rows = [{"prompt": f"Reverse the digits.\n{i}", "chosen": str(i)[::-1], "rejected": str(i), "margin": 50.0}
            for i in range(1000, 1024)]  # fmt: skip
    reward = load_recipe("reward")
    config = reward.config(**QUICK, train_data=_write(tmp_path / "prefs.jsonl", rows), eval_split_ratio=0.25,
                           output_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"))  # fmt: skip
    summary = reward.main(config)
    assert summary["data"]["pairs_read"] == 24 and summary["eval"]["eval_pairs"] == 6
    # The margin enters the loss: -log sigmoid(d - 50) is about 50 - d for the near-zero reward differences of a
    # fresh model (without it the loss would be about log 2).
    assert summary["eval_before_training"]["eval_loss"] == pytest.approx(50.0, abs=1.0)


def test_implicit_prompts_shared_by_chosen_and_rejected_conversations(tmp_path):
    rows = []
    for i in range(1000, 1024):  # the shape of UltraFeedback-binarized's train_prefs: whole conversations
        ask = [{"role": "system", "content": "Answer with digits."}, {"role": "user", "content": f"Sort {i}"}]
        rows.append({"chosen": [*ask, {"role": "assistant", "content": "".join(sorted(str(i)))}],
                     "rejected": [*ask, {"role": "assistant", "content": str(i)}], "score_chosen": 9.0})  # fmt: skip
    reward = load_recipe("reward")
    config = reward.config(**QUICK, train_data=_write(tmp_path / "prefs.jsonl", rows), eval_split_ratio=0.25,
                           output_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"))  # fmt: skip
    summary = reward.main(config)
    assert summary["data"]["pairs_read"] == 24 and 0.0 <= summary["eval"]["eval_accuracy"] <= 1.0
    # Without a margin column a fresh model's loss is about log 2 (rewards near 0, so near-equal).
    assert summary["eval_before_training"]["eval_loss"] == pytest.approx(0.693, abs=0.2)


@pytest.mark.multiprocess
def test_evaluation_on_two_processes_equals_one(tmp_path):
    """23 held-out pairs split over 2 processes (one duplicated to even out the last batch): the same figures."""
    args = ["--model_config", json.dumps(TINY_TEST_MODEL),
            *"""--disable_tqdm true --synthetic_train_size 64 --synthetic_eval_size 23 --max_steps 0
            --per_device_eval_batch_size 4 --dataloader_num_workers 2""".split(),  # the fork server's workers
            "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    one, _ = _run(tmp_path / "one", args)
    two, _ = _run(tmp_path / "two", args, accelerate_config="multi_cpu.yaml")
    assert two["num_processes"] == 2 and one["eval"]["eval_pairs"] == two["eval"]["eval_pairs"] == 23
    assert two["eval"]["eval_accuracy"] == one["eval"]["eval_accuracy"]
    assert two["eval"] == pytest.approx(one["eval"], abs=1e-6)
