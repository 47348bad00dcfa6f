"""The transformers `Trainer` baseline: SFT with prompt masking and padding to the longest in each batch.

Written the way the transformers docs and most user scripts do it: `datasets.map` tokenisation with the chat
template, labels masked on the prompt, `DataCollatorForSeq2Seq(padding="longest")`.

    python benchmarks/peers/trainer_sft.py DATA.json MODEL_DIR OUT_DIR RESULT.json [--bf16] [--batch 8] ...
"""

from __future__ import annotations

import datasets
from common import FirstStepClock, alpaca_messages, parse_args, shared_training_arguments, train_and_report
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainingArguments,
)


def main():
    args = parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = datasets.load_dataset("json", data_files=args.data, split="train", cache_dir=args.cache_dir)

    def tokenize(record):
        messages = alpaca_messages(record)
        prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, truncation=True, max_length=args.max_length)["input_ids"]
        n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * n_prompt + ids[n_prompt:]}

    train = raw.map(tokenize, remove_columns=raw.column_names)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
    clock = FirstStepClock()
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**shared_training_arguments(args)),
        train_dataset=train,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100),
        callbacks=[clock],
    )
    train_and_report(trainer, clock, args.result)


if __name__ == "__main__":
    main()
