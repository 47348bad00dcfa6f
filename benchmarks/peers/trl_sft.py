"""The TRL baseline: `SFTTrainer` with packing, on conversational prompt/completion data (loss on completions).

python benchmarks/peers/trl_sft.py DATA.json MODEL_DIR OUT_DIR RESULT.json [--bf16] [--batch 8] ...
"""

from __future__ import annotations

import datasets
from common import FirstStepClock, alpaca_messages, parse_args, write_result
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
        args=SFTConfig(
            output_dir=args.output_dir,
            max_length=args.max_length,
            packing=True,
            per_device_train_batch_size=args.batch,
            learning_rate=args.lr,
            num_train_epochs=1,
            lr_scheduler_type="linear",
            logging_steps=10,
            save_strategy="no",
            report_to="none",
            bf16=args.bf16,
            use_cpu=True,
            seed=42,
            disable_tqdm=True,
        ),
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    metrics = trainer.train().metrics
    trainer.save_model()
    write_result(
        args.result,
        tokens=int(sum(len(ids) for ids in trainer.train_dataset["input_ids"])),
        train_seconds=metrics["train_runtime"],
        time_to_first_step=clock.seconds,
        final_train_loss=metrics["train_loss"],
    )


if __name__ == "__main__":
    main()
