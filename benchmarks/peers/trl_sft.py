"""The TRL baseline: `SFTTrainer` with packing, on conversational prompt/completion data (loss on completions).

python benchmarks/peers/trl_sft.py DATA.json MODEL_DIR OUT_DIR RESULT.json [--bf16] [--batch 8] ...
"""

from __future__ import annotations

import datasets
from common import FirstStepClock, alpaca_messages, parse_args, shared_training_arguments, train_and_report
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer


def main():
    args = parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = datasets.load_dataset("json", data_files=args.data, split="train", cache_dir=args.cache_dir)

    def to_prompt_completion(record):
        messages = alpaca_messages(record)
        return {"prompt": messages[:1], "completion": messages[1:]}

    train = raw.map(to_prompt_completion, remove_columns=raw.column_names)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
    clock = FirstStepClock()
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(max_length=args.max_length, packing=True, **shared_training_arguments(args)),
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    train_and_report(trainer, clock, args.result)


if __name__ == "__main__":
    main()
