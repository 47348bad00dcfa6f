"""The TRL baseline: `SFTTrainer` with packing, on conversational prompt/completion data (loss on completions).

TRL's default packing ('bfd', best-fit decreasing) is padding-free: each batch of packed rows becomes one row with
position ids that restart at every example.

python benchmarks/peers/trl_sft.py DATA.json MODEL_DIR OUT_DIR RESULT.json [--bf16] [--batch 8] ...
"""

from __future__ import annotations

import datasets
from common import callbacks, load_model, parse_args, record_messages, shared_training_arguments, train_and_report
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer


def main():
    args = parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = datasets.load_dataset("json", data_files=args.data, split="train", cache_dir=args.cache_dir)

    def to_prompt_completion(record):
        messages = record_messages(record)
        return {"prompt": messages[:1], "completion": messages[1:]}

    train = raw.map(to_prompt_completion, remove_columns=raw.column_names)
    model = load_model(args)
    clocks = callbacks(args)
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(max_length=args.max_length, packing=True, **shared_training_arguments(args)),
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=clocks,
    )
    train_and_report(trainer, clocks, args)


if __name__ == "__main__":
    main()
