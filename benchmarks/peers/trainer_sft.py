"""The transformers `Trainer` baseline: SFT with prompt masking and padding to the longest in each batch.

Written the way the transformers docs and most user scripts do it: `datasets.map` tokenisation with the chat
template, labels masked on the prompt, `DataCollatorForSeq2Seq(padding="longest")`. With `--collator flatten`,
transformers' padding-free `DataCollatorWithFlattening` instead: each batch becomes one row with position ids that
restart at every example, which SDPA and eager attention (transformers >= 5 builds the block-diagonal mask from the
position ids) and flash_attention_2 keep inside each example.

    python benchmarks/peers/trainer_sft.py DATA.json MODEL_DIR OUT_DIR RESULT.json [--bf16] [--batch 8] ...
"""

from __future__ import annotations

import datasets
from common import callbacks, load_model, parse_args, sft_features, shared_training_arguments, train_and_report
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainingArguments


def main():
    args = parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = datasets.load_dataset("json", data_files=args.data, split="train", cache_dir=args.cache_dir)
    train = raw.map(lambda r: sft_features(tokenizer, r, args.max_length), remove_columns=raw.column_names)
    if args.collator == "flatten":
        train = train.remove_columns("attention_mask")
        collator = DataCollatorWithFlattening()
    else:
        collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    model = load_model(args)
    clocks = callbacks(args)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**shared_training_arguments(args)),
        train_dataset=train,
        data_collator=collator,
        callbacks=clocks,
    )
    train_and_report(trainer, clocks, args)


if __name__ == "__main__":
    main()
