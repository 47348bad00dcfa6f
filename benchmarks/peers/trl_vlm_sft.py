"""The TRL baseline for image-text SFT: `SFTTrainer` on TRL's messages + images rows, loss on the assistant turns.

TRL decodes the images and tokenises in its collator (`DataCollatorForVisionLanguageModeling`, which calls the
processor's chat template on each batch), in the DataLoader's workers with `--num_workers`; its rows are padded to
the longest in the batch (TRL does not pack image-text rows).

python benchmarks/peers/trl_vlm_sft.py DATA.jsonl MODEL_DIR OUT_DIR RESULT.json [--bf16] [--batch 8] ...
"""

from __future__ import annotations

from pathlib import Path

import datasets
from common import FirstStepClock, SteadyClock, parse_args, peak_memory, shared_training_arguments, write_result
from transformers import AutoModelForImageTextToText, TrainerCallback
from trl import SFTConfig, SFTTrainer

from tunebook.models.vision import load_processor


class Seen(TrainerCallback):
    """Non-padding tokens and images the model is given (attention-mask ones; one image per `image_grid_thw` row or
    per `pixel_values` image), counted where the model is called."""

    def __init__(self):
        self.tokens = self.images = self.positions = 0

    def _count(self, module, args, kwargs):
        self.tokens += int(kwargs["attention_mask"].sum())
        self.positions += kwargs["input_ids"].numel()
        grid = kwargs.get("image_grid_thw")
        self.images += len(grid) if grid is not None else len(kwargs.get("pixel_values", ()))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.register_forward_pre_hook(self._count, with_kwargs=True)


def main():
    args = parse_args()
    # Tunebook's loader for the processor: on a machine without torchvision (the CPU here) AutoProcessor cannot
    # build a Qwen-VL processor (it insists on a video processor); the parts it loads are the saved ones.
    processor = load_processor(args.model)
    raw = datasets.load_dataset("json", data_files=args.data, split="train", cache_dir=args.cache_dir)
    folder = Path(args.data).resolve().parent
    # TRL reads an image path as given: relative paths become absolute ones (as Tunebook resolves them)
    train = raw.map(lambda row: {"images": [f"{folder}/{p}" for p in row["images"]]})
    dtype = {"dtype": args.dtype} if args.dtype else {}
    model = AutoModelForImageTextToText.from_pretrained(args.model, attn_implementation=args.attn_implementation,
                                                        **dtype)  # fmt: skip
    seen, first_step = Seen(), FirstStepClock()
    clocks = [seen, first_step] + ([SteadyClock(args.timing_warmup)] if args.max_steps > 0 else [])
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(max_length=args.max_length, assistant_only_loss=True, **shared_training_arguments(args)),
        train_dataset=train,
        processing_class=processor,
        callbacks=clocks,
    )
    metrics = trainer.train().metrics
    if not args.no_save:
        trainer.save_model()
    steady = next((c.result for c in clocks if isinstance(c, SteadyClock) and c.result), {})
    write_result(
        args.result,
        tokens=seen.tokens,
        images=seen.images,
        computed_positions=seen.positions,
        train_seconds=metrics["train_runtime"],
        time_to_first_step=first_step.seconds,
        # the last logging window's mean, as Tunebook's final_train_loss (train_loss is the whole run's mean)
        final_train_loss=next(e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e),
        mean_train_loss=metrics["train_loss"],
        steps=trainer.state.global_step,
        **peak_memory(args.device),
        **steady,
    )


if __name__ == "__main__":
    main()
