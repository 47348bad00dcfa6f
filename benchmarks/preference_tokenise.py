"""Tokenising preference pairs (DPO, reward): one tokenizer call per `map` batch against one call per text.

    python benchmarks/preference_tokenise.py [--pairs 2000] [--repeats 5] [--no_write]

Pairs are Code Alpaca (../shared) turned into preference pairs: the instruction (and input) as the prompt, its answer
as chosen, another example's answer as rejected. The tokenizer is vs_peers.py's BPE with a ChatML template (built in
--work_dir if missing). `tokenize_pairs` (what the DPO and reward recipes map over their data, in batches of 1000) is
timed against the same rows tokenised one text at a time (`prompt_and_response_ids`, one call per prompt and per
response), and both outputs must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work_dir", default="/tmp/tunebook-vs-peers", help="shared with vs_peers.py's assets")
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT / "src"))
    from transformers import AutoTokenizer
    from vs_peers import prepare_assets

    from tunebook.data.tokenize import IGNORE_INDEX
    from tunebook.preference.data import preference_pair, prompt_and_response_ids, tokenize_pairs

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data, model_dir = prepare_assets(work, args.pairs, "code_alpaca")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = json.loads(data.read_text())[: args.pairs]
    rejected = [r["output"] for r in records]
    random.Random(0).shuffle(rejected)
    columns = {
        "prompt": [r["instruction"] + ("\n" + r["input"] if r.get("input") else "") for r in records],
        "chosen": [r["output"] for r in records],
        "rejected": rejected,
    }
    settings = {"tokenizer": tokenizer, "max_seq_length": 512, "overlong": "truncate", "where": "pairs"}

    def batched() -> dict:
        out: dict[str, list] = {}
        for start in range(0, len(records), 1000):  # datasets.map's default batch size
            part = {k: v[start : start + 1000] for k, v in columns.items()}
            rows = list(range(start, start + len(part["prompt"])))
            for key, value in tokenize_pairs(part, rows, **settings).items():
                out.setdefault(key, []).extend(value)
        return out

    def per_text() -> dict:
        out: dict[str, list] = {"chosen_input_ids": [], "chosen_labels": []}
        for i in range(len(records)):
            prompt, chosen, rejected_, tools = preference_pair({k: v[i] for k, v in columns.items()}, "pairs")
            prompt_ids, (chosen_ids, _) = prompt_and_response_ids(tokenizer, prompt, (chosen, rejected_), tools, "")
            chosen_ids = chosen_ids[: max(512 - len(prompt_ids), 0)]
            out["chosen_input_ids"].append(prompt_ids + chosen_ids)
            out["chosen_labels"].append([IGNORE_INDEX] * len(prompt_ids) + chosen_ids)
        return out

    times: dict[str, list[float]] = {"one call per map batch (tokenize_pairs)": [], "one call per text": []}
    results = {}
    for _ in range(args.repeats):  # alternating, so drift of the machine reaches both alike
        for name, fn in zip(times, (batched, per_text)):
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    fast, slow = results.values()
    assert fast["chosen_input_ids"] == slow["chosen_input_ids"] and fast["chosen_labels"] == slow["chosen_labels"]
    lines = [
        *header("Tokenising preference pairs: one call per map batch vs one per text (benchmarks/preference_tokenise.py)"),
        f"- Setup: {len(records)} Code Alpaca pairs (prompt, answer, another example's answer), vs_peers' BPE "
        f"tokenizer with a ChatML template, max_seq_length 512; {args.repeats} runs of each, alternating. The chosen "
        "sides' ids and labels are equal between the two.",
        "",
        "| how | median (s) | runs (s) |",
        "| --- | ---: | --- |",
    ]  # fmt: skip
    for name, runs in times.items():
        lines.append(f"| {name} | {statistics.median(runs):.3f} | {', '.join(f'{t:.3f}' for t in runs)} |")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("preference_tokenise", text)


if __name__ == "__main__":
    main()
