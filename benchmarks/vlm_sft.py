"""Image-text SFT speed: Tunebook's recipes/sft.py against TRL's SFTTrainer on the same model, processor and data.

    python benchmarks/vlm_sft.py [--shape tiny|qwen2.5-vl-3b] [--device cpu|cuda] [--systems tunebook,trl] ...

Data: the generated shapes task (`tunebook.data.synthetic.write_synthetic_image_task`: one coloured shape a picture,
"What colour is the square?"), written once into the work folder; `--image_scale K` stores every picture K times
larger each way (K^2 times the image tokens), for a shape whose rows should be mostly image. Model: one folder that
both systems load: a fresh model of `--shape` (tiny: the VLM default's Qwen2-VL; qwen2.5-vl-3b: Qwen2.5-VL-3B-
Instruct's sizes from its published config, random weights) with a tokenizer trained on the data and the
family's PIL image processor (`tunebook.models.vision.tiny_processor`).

Both systems train the same steps at the same batch, learning rate and schedule, loss on the assistant turns only,
images decoded in `--num_workers` DataLoader workers, no evaluation, no saving. Reported: non-padding tokens and
images trained per second of training (with `--max_steps`, also the steady rate after `--timing_warmup` steps),
the time from process start to the first optimizer step, the whole process's wall time, peak memory and the loss
of the last logging window. The CPU row runs here; the GPU row (`--shape qwen2.5-vl-3b --device cuda --bf16`) runs
from benchmarks/gpu/run.sh on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results import header, write_section

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_vs_peers import tunebook_figures  # noqa: E402  (the steady rate from Tunebook's logging windows)

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("tunebook", "trl")
# Qwen2.5-VL-3B-Instruct's config.json (the sizes only; Hub model Qwen/Qwen2.5-VL-3B-Instruct): 3.75 B parameters.
QWEN2_5_VL_3B = {
    "model_type": "qwen2_5_vl",
    "text_config": {
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
    },
}  # fmt: skip


def model_config(shape: str) -> dict:
    if shape == "tiny":
        import yaml

        return yaml.safe_load((ROOT / "recipes/configs/sft/vlm_default.yaml").read_text())["model_config"]
    return QWEN2_5_VL_3B


def prepare_assets(work: Path, args) -> tuple[Path, Path]:
    """The shapes data (pictures scaled by --image_scale) and the one model folder both systems load."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    from PIL import Image

    from tunebook.data.synthetic import write_synthetic_image_task
    from tunebook.models import ModelOptions, build_vision_lm, train_chat_tokenizer
    from tunebook.models.saving import save_processor
    from tunebook.models.vision import tiny_processor

    train, _ = write_synthetic_image_task(work / "shapes", args.examples, 8, seed=42)
    data = train
    if args.image_scale > 1:
        folder = work / f"shapes-x{args.image_scale}"
        rows = [json.loads(line) for line in train.read_text().splitlines()]
        for row in rows:
            for name in row["images"]:
                target = folder / name
                if not target.is_file():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with Image.open(train.parent / name) as image:
                        size = (image.width * args.image_scale, image.height * args.image_scale)
                        image.resize(size, Image.Resampling.NEAREST).save(target)
        data = folder / "train.jsonl"
        data.write_text(train.read_text())
    model_dir = work / f"init_model_{args.shape}_x{args.image_scale}"
    if not (model_dir / "config.json").is_file():
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        texts = [part["text"] for row in rows for m in row["messages"] for part in m["content"] if "text" in part]
        config = model_config(args.shape)
        vocab = config["text_config"].get("vocab_size", 300)
        processor = tiny_processor(config, train_chat_tokenizer(texts, vocab_size=min(vocab, 300)),
                                   max_image_pixels=args.max_pixels)  # fmt: skip
        torch.manual_seed(0)
        # a tokenizer of 300 entries: the 3B shape keeps its 151,936-row embedding and head (their cost is the shape's)
        model = build_vision_lm(processor, ModelOptions(model_config=config))
        if vocab > len(processor.tokenizer):
            model.resize_token_embeddings(vocab)
        model.save_pretrained(model_dir)
        save_processor(processor, model_dir)
    return data, model_dir


def run_one(system: str, data: Path, model_dir: Path, work: Path, args) -> dict:
    cache, out, result = work / f"cache-{system}", work / f"out-{system}", work / f"result-{system}.json"
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    result.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(cache / "hf"), "TUNEBOOK_CACHE": str(cache / "tunebook")}  # fmt: skip
    steps = ["--max_steps", str(args.max_steps)] if args.max_steps > 0 else []
    if system == "tunebook":
        launcher = "single_gpu.yaml" if args.device == "cuda" else "cpu.yaml"
        cmd = [str(Path(sys.executable).parent / "tunebook"), "train", "--quiet",
               "--config_file", str(ROOT / "accelerate_configs" / launcher),
               "--mixed_precision", "bf16" if args.bf16 else "no", "sft",
               "--config", str(ROOT / "recipes/configs/sft/vlm_default.yaml"), "--model_config", "null",
               "--model_name_or_path", str(model_dir), "--train_data", str(data), "--eval_data", "null",
               "--max_pixels", str(args.max_pixels), "--max_seq_length", str(args.max_length),
               "--per_device_train_batch_size", str(args.batch), "--learning_rate", str(args.lr),
               "--lr_scheduler_type", "linear", "--warmup_ratio", "0", "--num_train_epochs", "1", *steps,
               "--eval_on_start", "false", "--generation_eval", "false", "--save_strategy", "no",
               "--dataloader_num_workers", str(args.num_workers), "--disable_tqdm", "true",
               # a logging window ends at the warm-up's last step: the steady rate is read from the windows after it
               "--logging_steps", str(args.timing_warmup if args.max_steps > 0 else 10),
               "--gradient_checkpointing", args.gradient_checkpointing, "--output_dir", str(out)]  # fmt: skip
    else:
        cmd = [sys.executable, str(ROOT / "benchmarks/peers/trl_vlm_sft.py"), str(data), str(model_dir), str(out),
               str(result), "--batch", str(args.batch), "--lr", str(args.lr), "--max_length", str(args.max_length),
               "--cache_dir", str(cache / "hf"), "--device", args.device, "--num_workers", str(args.num_workers),
               "--no_save", "--gradient_checkpointing", args.gradient_checkpointing, *steps,
               "--logging_steps", str(args.timing_warmup if args.max_steps > 0 else 10),
               "--timing_warmup", str(args.timing_warmup), *(["--bf16"] if args.bf16 else [])]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{system} failed:\n{output[-4000:]}")
    if system == "tunebook":
        summary = json.loads((out / "summary.json").read_text())
        steady = tunebook_figures(out, args.timing_warmup)["tokens_per_second"] if args.max_steps > 0 else None
        stats = {"tokens": summary["train_tokens"], "images": summary["train_samples"],  # one picture a row
                 "train_seconds": summary["train_runtime_seconds"], "steps": summary["train_steps"],
                 "time_to_first_step": summary["time_to_first_step_seconds"],
                 "final_train_loss": summary["final_train_loss"],
                 "steady_tokens_per_second": steady,
                 "peak_memory_mb": summary.get("peak_device_memory_mb") or usage.ru_maxrss / 1024}  # fmt: skip
    else:
        stats = json.loads(result.read_text())
        stats["peak_memory_mb"] = stats["peak_memory_mb"] if args.device == "cuda" else usage.ru_maxrss / 1024
    return {
        "system": system,
        "wall_seconds": wall,
        "tokens_per_second": stats["tokens"] / stats["train_seconds"],
        "images_per_second": stats["images"] / stats["train_seconds"],
        "steady_tokens_per_second": stats.get("steady_tokens_per_second"),
        "tokens": stats["tokens"],
        "images": stats["images"],
        "steps": stats["steps"],
        "time_to_first_step": stats["time_to_first_step"],
        "peak_memory_mb": stats["peak_memory_mb"],
        "final_train_loss": stats["final_train_loss"],
    }


def table(runs: list[dict], systems: list[str]) -> list[str]:
    def med(system, key):
        values = [r[key] for r in runs if r["system"] == system and r[key] is not None]
        return statistics.median(values) if values else float("nan")

    names = {"tunebook": "Tunebook sft", "trl": "TRL SFTTrainer"}
    lines = ["| system | whole process (s) | tokens/s | steady tokens/s | images/s | first step (s) | peak memory (MB) | "
             "steps | tokens | images | last window's loss |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for s in systems:
        lines.append(f"| {names[s]} | {med(s, 'wall_seconds'):.1f} | {med(s, 'tokens_per_second'):.0f} | "
                     f"{med(s, 'steady_tokens_per_second'):.0f} | "
                     f"{med(s, 'images_per_second'):.1f} | {med(s, 'time_to_first_step'):.1f} | "
                     f"{med(s, 'peak_memory_mb'):.0f} | {med(s, 'steps'):.0f} | {med(s, 'tokens'):.0f} | "
                     f"{med(s, 'images'):.0f} | {med(s, 'final_train_loss'):.3f} |")  # fmt: skip
    if "trl" in systems:
        ratio = med("tunebook", "images_per_second") / med("trl", "images_per_second")
        lines += ["", f"Tunebook's images/s: {ratio:.2f}x TRL's."]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "qwen2.5-vl-3b"), default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--examples", type=int, default=2000, help="training rows (one picture each)")
    parser.add_argument("--image_scale", type=int, default=1, help="store every picture K times larger each way")
    parser.add_argument("--max_pixels", type=int, default=12544, help="the processor's resize bound (both systems)")
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max_steps", type=int, default=-1, help="optimizer steps (-1: one epoch)")
    parser.add_argument("--timing_warmup", type=int, default=5)
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--gradient_checkpointing", choices=("on", "off"), default="off")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--work_dir", default="/tmp/tunebook-vlm-sft")
    parser.add_argument("--records", default=None, help="append every run's record to this JSONL file")
    parser.add_argument("--no_write", action="store_true", help="print the table only")
    parser.add_argument("--from_records", default=None,
                        help="write RESULTS.md's section from a --records file (a GPU machine's), running nothing")  # fmt: skip
    args = parser.parse_args()
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    if args.from_records:
        runs = [json.loads(line) for line in Path(args.from_records).read_text().splitlines()]
        return report([r for r in runs if r["shape"] == args.shape and r["device"] == args.device], systems, args)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data, model_dir = prepare_assets(work, args)
    runs = []
    for repeat in range(args.repeats):
        for system in systems if repeat % 2 == 0 else systems[::-1]:  # neither always runs right after the other
            record = {**run_one(system, data, model_dir, work, args), "shape": args.shape, "device": args.device}
            print(json.dumps(record), flush=True)
            runs.append(record)
            if args.records:  # each run's record as it ends (a GPU lease may be cut off)
                with open(args.records, "a") as f:
                    f.write(json.dumps(record) + "\n")
    report(runs, systems, args)


def report(runs: list[dict], systems: list[str], args) -> None:
    lines = table(runs, systems)
    print("\n".join(lines))
    if not args.no_write:
        title = f"Image-text SFT vs TRL: {args.shape} on {args.device} (benchmarks/vlm_sft.py)"
        notes = [
            f"- Data: the shapes task, {args.examples} rows (pictures x{args.image_scale}); batch {args.batch}, "
            f"max_pixels {args.max_pixels}, {args.num_workers} loader workers, gradient checkpointing "
            f"{args.gradient_checkpointing}, {'bf16' if args.bf16 else 'fp32'}; median of {args.repeats}.",
            "",
        ]
        write_section(f"vlm_sft-{args.shape}-{args.device}", "\n".join([*header(title, "trl"), *notes, *lines]))


if __name__ == "__main__":
    main()
