"""recipes/pretrain.py end to end: the default learns; plain .txt input; evaluation exact on 2 processes."""

from __future__ import annotations

import json

import pytest
from support import TINY_TEST_MODEL, launch

pytestmark = pytest.mark.slow
SMALL = [
    "--model_config", json.dumps(TINY_TEST_MODEL),
    *"""--disable_tqdm true --synthetic_train_size 120 --synthetic_eval_size 23 --max_seq_length 64
    --per_device_eval_batch_size 4 --dataloader_num_workers 0""".split(),
]  # fmt: skip


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def test_default_perplexity_falls(tmp_path):
    out = tmp_path / "default"
    result = launch("recipes/pretrain.py", ["--output_dir", str(out), "--disable_tqdm", "true"], launcher="accelerate")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = _summary(out)
    before, after = summary["eval_before_training"]["eval_perplexity"], summary["eval"]["eval_perplexity"]
    assert before > 200 and after < 0.1 * before, (before, after)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def test_plain_text_file_with_paragraphs(tmp_path):
    corpus = tmp_path / "corpus.txt"
    paragraphs = [f"Paragraph {i} says the number {i} twice: {i} {i}." for i in range(40)]
    corpus.write_text("\n\n".join(paragraphs) + "\n")
    out = tmp_path / "txt"
    args = [*SMALL, "--train_data", str(corpus), "--eval_split_ratio", "0.1", "--max_steps", "2",
            "--per_device_train_batch_size", "2", "--output_dir", str(out)]  # fmt: skip
    result = launch("recipes/pretrain.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "train data: 36 documents" in output and "eval data: 4 documents" in output
    shown = output.split("One training row, loss-bearing text in [[...]]:\n", 1)[1]
    assert shown.startswith("Paragraph") and "[[" in shown  # every token but each document's first is marked


def test_two_process_evaluation_equals_one_process(tmp_path):
    evals = {}
    for name, cfg in (("one", "cpu.yaml"), ("two", "multi_cpu.yaml")):
        out = tmp_path / name
        result = launch("recipes/pretrain.py", [*SMALL, "--max_steps", "0", "--output_dir", str(out)], cfg)
        assert result.returncode == 0, result.stderr[-3000:]
        evals[name] = _summary(out)["eval"]
    assert evals["one"]["eval_tokens"] == evals["two"]["eval_tokens"]
    assert evals["two"]["eval_loss"] == pytest.approx(evals["one"]["eval_loss"], rel=1e-6)


def test_a_model_packing_cannot_keep_apart_stops_with_what_to_do_instead(tmp_path):
    # Pretraining always packs documents, so `packing: false` (sft's advice) is no option here: the line says so.
    lfm2 = {"model_type": "lfm2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["full_attention", "conv"],
            "full_attn_idxs": [0], "max_position_embeddings": 256}  # fmt: skip
    args = [*SMALL, "--model_config", json.dumps(lfm2), "--max_steps", "1", "--output_dir", str(tmp_path / "out")]
    result = launch("recipes/pretrain.py", args, in_process=False)  # a failure's exit code and one line
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("tunebook: error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "recurrent layers (conv" in errors[0], errors[0]
    assert errors[0].endswith(
        "; train it with recipes/sft.py and packing: false (pretrain always packs documents into rows)"
    )
