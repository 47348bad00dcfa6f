"""The recipes on data and models shaped like users' own: a Hub snapshot folder by split, implicit-prompt preference
pairs, and a base tokenizer without a chat template, whose fine-tuned model must learn to stop."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from support import TINY_TEST_MODEL, base_tokenizer

from tunebook import load_recipe

pytestmark = pytest.mark.slow
QUICK = {"disable_tqdm": True, "report_to": "none", "dataloader_num_workers": 0, "eval_on_start": False,
         "per_device_train_batch_size": 4, "per_device_eval_batch_size": 16, "log_level": "WARNING"}  # fmt: skip


def test_sft_on_a_hub_snapshot_trains_on_the_named_split_only(tmp_path):
    folder = tmp_path / "ultrachat"
    (folder / "data").mkdir(parents=True)
    for split, n in (("train_sft", 300), ("test_sft", 100)):
        rows = [
            [{"role": "user", "content": f"{split} {i}"}, {"role": "assistant", "content": str(i)}] for i in range(n)
        ]
        pd.DataFrame({"prompt_id": range(n), "messages": rows}).to_parquet(
            folder / "data" / f"{split}-00000-of-00001.parquet"
        )
    sft = load_recipe("sft")
    config = sft.config(**QUICK, model_config=TINY_TEST_MODEL, max_steps=1, output_dir=str(tmp_path / "out"),
                        cache_dir=str(tmp_path / "cache"), train_data={"path": str(folder), "split": "train_sft"},
                        eval_data={"path": str(folder), "split": "test_sft"})  # fmt: skip
    summary = sft.main(config)
    assert summary["data"]["examples_read"] == 300
    assert summary["eval"]["eval_tokens"] > 0
    card = (tmp_path / "out" / "README.md").read_text()  # the model card names the data by split
    assert "train_sft" in card and "test_sft" in card


def test_dpo_on_implicit_prompt_pairs(tmp_path):
    pairs = []
    for i in range(1000, 1024):
        ask = [{"role": "user", "content": f"Reverse the digits.\n{i:04d}"}]
        pairs.append({"chosen": [*ask, {"role": "assistant", "content": f"{i:04d}"[::-1]}],
                      "rejected": [*ask, {"role": "assistant", "content": f"x{i:04d}"}]})  # fmt: skip
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    dpo = load_recipe("dpo")
    config = dpo.config(**QUICK, model_config=TINY_TEST_MODEL, max_steps=2, sft_warmup_steps=0, train_data=str(path),
                        eval_split_ratio=0.25, output_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"))  # fmt: skip
    summary = dpo.main(config)
    assert summary["data"]["pairs_read"] == 24 and 0.0 <= summary["eval"]["eval_rewards/accuracy"] <= 1.0


def test_a_base_tokenizer_gets_chatml_and_the_fine_tuned_model_stops(tmp_path):
    """No chat template: ChatML markers become tokens and <|im_end|> the EOS, so generation ends by itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_tokenizer().save_pretrained(tmp_path / "base_tokenizer")
    sft = load_recipe("sft")
    config = sft.config(**{**QUICK, "per_device_train_batch_size": 16}, model_config=TINY_TEST_MODEL, max_steps=100,
                        synthetic_train_size=2000, synthetic_eval_size=16, learning_rate=3e-3,
                        tokenizer_name_or_path=str(tmp_path / "base_tokenizer"), output_dir=str(tmp_path / "out"),
                        cache_dir=str(tmp_path / "cache"))  # fmt: skip
    sft.main(config)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and end in [model.generation_config.eos_token_id]
    tokenizer.padding_side = "left"
    prompts = [f"Reverse the digits.\n{n}" for n in ("4821", "90357", "118", "6402")]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]  # fmt: skip
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=24, do_sample=False)  # the saved generation_config decides
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        assert end in row, f"no end of turn in {tokenizer.decode(row)!r}"
        assert row.index(end) < 12, tokenizer.decode(row)


def test_qwen3_multi_turn_sft_stops_with_the_choice_then_trains_each_turn_with_split_turns(tmp_path):
    """Qwen3's template drops the (empty) think block of earlier turns once a user turn follows, so a whole
    conversation cannot hold every turn as generated: the run says what to choose, and split_turns trains each
    assistant turn as the last one of its own example."""
    from support import ASSETS

    tokenizer = base_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    rows = [{"messages": [{"role": "user", "content": f"Reverse {i}"}, {"role": "assistant", "content": str(i)[::-1]},
                          {"role": "user", "content": f"Double {i}"}, {"role": "assistant", "content": str(2 * i)}]}
            for i in range(100, 140)]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = load_recipe("sft")
    common = dict(QUICK, model_config=TINY_TEST_MODEL, max_steps=2, train_data=str(tmp_path / "chat.jsonl"),
                  eval_split_ratio=0.25, tokenizer_name_or_path=str(tmp_path / "tokenizer"),
                  chat_template=str(ASSETS / "chat_templates" / "qwen3.jinja"), generation_eval=False,
                  cache_dir=str(tmp_path / "cache"))  # fmt: skip
    from tunebook.errors import DataError

    with pytest.raises(DataError, match=r"chat.jsonl, row 1: .*message 2 \(assistant\).*split_turns: true"):
        sft.main(sft.config(**common, output_dir=str(tmp_path / "whole")))
    summary = sft.main(sft.config(**common, split_turns=True, output_dir=str(tmp_path / "split")))
    assert summary["data"]["conversations_read"] == 40 and summary["data"]["examples_read"] == 80, summary["data"]
    assert (
        summary["data"]["train_rows"] == 60 and summary["eval"]["eval_tokens"] > 0
    )  # 10 whole conversations held out
