"""Packed attention backends side by side: tokens/s of a training step, peak memory and the loss (issue 17, point 3).

    python benchmarks/packed_attention.py                      # this machine's device, its default shapes
    python benchmarks/packed_attention.py --train_data .gpu/code_alpaca_2k.json --out DIR   # a GPU machine
    python benchmarks/packed_attention.py --smoke              # a tiny model, 2 steps: every code path, no RESULTS.md

What `use_packed_attention` picks for a device should be the fastest backend that keeps packed examples apart; this
measures them on the same packed batch. Example lengths are real: Code Alpaca (../shared) rendered with the chat
template of a BPE tokenizer trained on it (benchmarks/vs_peers.py's), packed best-fit-decreasing into rows of L
tokens; the model is built from its config with random weights. One step = forward, fused loss over the
loss-bearing tokens, backward (no optimizer: it costs the same for every backend). Backends:

- sdpa: transformers' SDPA with our block-diagonal causal mask (dense, rows x L x L booleans);
- eager: transformers' eager attention with the additive float mask (CPU only: at GPU row lengths its L x L
  weights per head are the memory of the whole step);
- tunebook_segment_sdpa: our varlen attention, one causal SDPA call per example on a CPU, PyTorch's flash varlen
  kernel (`torch.nn.attention.varlen`) on CUDA in bf16;
- flex_attention: FlexAttention (compiled by transformers) with the document block mask whose tiles
  `PackedCollator` computes in the loader's worker (CUDA only: FlexAttention has no backward pass on a CPU);
- flash_attention_2: the `flash_attn` package's varlen kernel, where it is installed (CUDA only).

On CUDA every step runs under bf16 autocast over float32 weights, as recipes/sft.py does with mixed_precision bf16;
on a CPU in float32. The loss column must agree between backends (to bf16 precision on CUDA): a backend that lets
examples see each other shows there. Also timed: building the block mask's tiles from the segment ids
(`document_kv_blocks`, what the worker does) against `create_block_mask` on the device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from results import command, machine, versions, write_section

ROOT = Path(__file__).resolve().parents[1]
CPU_BACKENDS = ("sdpa", "eager", "tunebook_segment_sdpa")
CUDA_BACKENDS = ("sdpa", "tunebook_segment_sdpa", "flex_attention", "flash_attention_2")


def shapes() -> dict[str, dict]:
    # The model shapes are gpu_vs_peers.py's, so the two GPU measurements describe the same models.
    if str(ROOT / "benchmarks" / "gpu") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from gpu_vs_peers import LLAMA_32_1B, SMOLLM2_135M, TINY

    from tunebook.config.tiny import TINY_LLAMA

    return {
        "tiny-llama (vs_peers)": {**TINY_LLAMA, "vocab_size": 2048},
        "SmolLM2-135M": SMOLLM2_135M,
        "Llama-3.2-1B": LLAMA_32_1B,
        "tiny": TINY,
    }


def example_lengths(work: Path, examples: int, train_data: str | None) -> list[int]:
    """Token counts of the Code Alpaca examples as the SFT recipe renders them (chat template, EOS included)."""
    import json as _json

    import vs_peers
    from transformers import AutoTokenizer
    from vs_peers import prepare_assets

    if train_data:  # a GPU machine has no ../shared: the file is carried into the checkout
        vs_peers.DATA["code_alpaca"] = (Path(train_data), vs_peers.DATA["code_alpaca"][1])

    from tunebook.data.formats import to_conversations

    work.mkdir(parents=True, exist_ok=True)
    data, model_dir = prepare_assets(work, examples, "code_alpaca")
    records = _json.loads(data.read_text())
    batch = {k: [r.get(k, "") for r in records] for k in ("instruction", "input", "output")}
    rows = to_conversations(batch, data_format="alpaca", where="")["conversation"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = [tokenizer.apply_chat_template(_json.loads(r)["messages"], tokenize=False) for r in rows]
    return [len(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]]


def packed_batch(lengths: list[int], seq_len: int, rows: int, attn: str, vocab: int):
    """`rows` rows of `lengths` packed into rows of `seq_len`, collated for `attn`; random token ids,
    every token but each example's first carries a label (as with plain-text examples)."""
    import numpy as np
    import torch

    from tunebook.data import PackedCollator
    from tunebook.data.packing import best_fit_decreasing

    capped = np.minimum(np.asarray(lengths), seq_len)
    order, offsets = best_fit_decreasing(capped, seq_len, seed=0)
    # A seeded sample of the rows, as training meets them (the first rows of best-fit-decreasing hold the longest
    # examples, the last the shortest).
    bins = np.random.default_rng(0).choice(len(offsets) - 1, size=min(rows, len(offsets) - 1), replace=False)
    g = torch.Generator().manual_seed(0)
    features = []
    for b in sorted(bins.tolist()):
        sizes = capped[order[offsets[b] : offsets[b + 1]]].tolist()
        ids = torch.randint(10, vocab, (sum(sizes),), generator=g).tolist()
        labels, start = list(ids), 0
        for n in sizes:
            labels[start] = -100
            start += n
        features.append({"input_ids": ids, "labels": labels, "seq_lengths": sizes})
    return PackedCollator(0, 8, attn)(features)


def measure(
    config_values: dict, attn: str, batch: dict, steps: int, warmup: int, device: str, profile_top: int = 0
) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunebook.data import attention_inputs, use_packed_attention
    from tunebook.training import causal_lm_token_losses

    values = {k: v for k, v in config_values.items() if k != "model_type"}
    config = AutoConfig.for_model("llama", **values)
    build = "sdpa" if attn == "tunebook_segment_sdpa" else attn
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=build).to(device).train()
    if attn == "tunebook_segment_sdpa":
        if device == "cuda":  # use_packed_attention keeps the mask on CUDA; register and switch by hand
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            from tunebook.models.attention import SEGMENT_SDPA, segment_sdpa_attention

            AttentionInterface.register(SEGMENT_SDPA, segment_sdpa_attention)
            AttentionMaskInterface.register(SEGMENT_SDPA, sdpa_mask)
            model.set_attn_implementation(SEGMENT_SDPA)
        else:
            use_packed_attention(model, device)
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens = int(batch["attention_mask"].sum())

    def one_step() -> torch.Tensor:
        with autocast:
            inputs = attention_inputs(batch, model.config._attn_implementation, torch.float32)
            loss = causal_lm_token_losses(model, inputs, batch)[0].mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync()
        return loss

    times, losses = [], []
    for step in range(warmup + steps):
        sync()
        start = time.perf_counter()
        loss = one_step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    step_s = statistics.median(times)
    figures = {
        "step_ms": step_s * 1000,
        "step_ms_range": (min(times) * 1000, max(times) * 1000),
        "tokens_per_second": tokens / step_s,
        "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        "loss": losses[0],
    }
    if profile_top:
        figures["profile"] = step_profile(one_step, device, profile_top, config.vocab_size)
    return figures


def step_profile(step, device: str, top: int, vocab: int) -> dict:
    """Where one step's time goes: the operators that take most of it, by the device time of the kernels each
    launches itself (CUDA) or by their own CPU time, with the step's total, and the share of the operators with a
    vocabulary-sized input (the embedding, the LM head and its loss)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()

    def own_us(e) -> float:
        if device != "cuda":
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    def operators(events):  # operators, not kernels: a kernel's time counts in the operator that launched it
        return [e for e in events if e.device_type.name == "CPU"]

    ops = sorted(operators(prof.key_averages()), key=own_us, reverse=True)
    by_shape = operators(prof.key_averages(group_by_input_shape=True))
    head = sum(own_us(e) for e in by_shape if any(vocab in shape for shape in (e.input_shapes or [])))
    return {"total_ms": sum(own_us(e) for e in ops) / 1000, "lm_head_ms": head / 1000,
            "ops": [[e.key, own_us(e) / 1000, e.count] for e in ops[:top]]}  # fmt: skip


def mask_timings(batch: dict, device: str, repeats: int = 5) -> dict:
    """Milliseconds to build the block mask: our tiles from the boundaries on the CPU (what the worker does) and
    torch's `create_block_mask` evaluating every pair on the device."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask

    from tunebook.models.attention import document_kv_blocks

    seq = batch["seq_ids"]
    length = seq.shape[1]
    on_device = seq.to(device)
    padded = F.pad(on_device, (0, -length % 128), value=-1)

    def document_causal(b, h, q, kv):
        return (padded[b, q] == padded[b, kv]) & (q >= kv)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def best(fn) -> float:
        fn()
        sync()
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            runs.append(time.perf_counter() - start)
        return min(runs) * 1000

    return {
        "tiles_from_boundaries_cpu_ms": best(lambda: document_kv_blocks(seq)),
        f"create_block_mask_{device}_ms": best(
            lambda: create_block_mask(document_causal, seq.shape[0], None, length, length, device=device)
        ),
    }


def labelled(record: dict) -> dict:
    """A step's record whose backend names its LM-head chunks where they are not the library's, and its LM-head
    backward where it was forced."""
    chunk, labels = record.get("chunk_elements"), []
    if chunk is not None and chunk != record.get("default_chunk_elements"):
        size = f"2^{chunk.bit_length() - 1}" if chunk & (chunk - 1) == 0 else f"{chunk:,}"
        labels.append(f"LM-head chunks of {size} logits")
    if record.get("ce_backward", "auto") != "auto":
        labels.append(f"LM-head backward over {record['ce_backward']}")
    return {**record, "attn": ", ".join([record["attn"], *labels])} if labels else record


def table(records: list[dict]) -> str:
    """The section: a row per backend measured, the block mask's build times, and where each step's time went."""
    first = records[0]
    lines = [
        "## Packed attention backends: one training step on the same packed batch (benchmarks/packed_attention.py)",
        "",
        f"- Machine: {first['machine']}",
        f"- Versions: {first['versions']}",
        *[f"- Command: `{c}`" for c in dict.fromkeys(r["command"] for r in records)],
        f"- Setup: {first['setup']}",
        "",
        "| shape | row length | rows | examples per row | backend | ms per step (min-max) | tokens/s | peak memory (MB) | loss |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    steps = [labelled(r) for r in records if "mask" not in r]
    for r in steps:
        memory = f"{r['peak_memory_mb']:.0f}" if r["peak_memory_mb"] is not None else "–"
        low, high = r["step_ms_range"]
        lines.append(
            f"| {r['shape']} | {r['seq_len']} | {r['rows']} | {r['examples_per_row']:.1f} | {r['attn']} | "
            f"{r['step_ms']:.1f} ({low:.1f}-{high:.1f}) | {r['tokens_per_second']:,.0f} | {memory} | {r['loss']:.5f} |"
        )
    lines += ["", "Building the block mask for one batch (best of 5, ms):", ""]
    for m in (r for r in records if "mask" in r):
        lines.append(f"- {m['shape']}, {m['rows']} x {m['seq_len']}: " + ", ".join(
            f"{k.removesuffix('_ms').replace('_', ' ')} {v:.2f}" for k, v in m["mask"].items()))  # fmt: skip
    profiled = [r for r in steps if r.get("profile")]
    if profiled:
        lines += ["", "Where one profiled step's time went (operators by the time of their own kernels on CUDA, "
                  "their own time on a CPU; ms, share of the step's total; 'with the vocabulary': operators with a "
                  "vocabulary-sized input: the embedding, the LM head and its loss):", ""]  # fmt: skip
        for r in profiled:
            total = r["profile"]["total_ms"]
            ops = "; ".join(f"{name} {ms:.1f} ({100 * ms / total:.0f}%)" for name, ms, _ in r["profile"]["ops"])
            head = r["profile"].get("lm_head_ms")
            head = (
                f", of which {head:.0f} ms ({100 * head / total:.0f}%) with the vocabulary" if head is not None else ""
            )
            lines.append(f"- {r['shape']}, {r['rows']} x {r['seq_len']}, {r['attn']} ({total:.0f} ms{head}): {ops}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="comma-separated; default: tiny-llama on a CPU, SmolLM2-135M "
                        "and Llama-3.2-1B on CUDA")  # fmt: skip
    parser.add_argument("--seq_lens", default=None, help="row lengths; default 512 on a CPU, 2048,4096 on CUDA")
    parser.add_argument("--row_tokens", type=int, default=None, help="tokens per batch (rows = this / L); default "
                        "4096 on a CPU (8 x 512, as vs_peers), 16384 on CUDA")  # fmt: skip
    parser.add_argument("--backends", default=None, help="comma-separated subset of the device's backends")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--train_data", default=None, help="the Code Alpaca JSON (default: ../shared/data/...)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunk_elements", type=int, default=None, help="logits per chunk of the fused LM-head "
                        "loss (default: tunebook.models.linear_ce.CHUNK_ELEMENTS)")  # fmt: skip
    parser.add_argument("--ce_backward", choices=("auto", "rows", "vocab"), default="auto", help="what the fused "
                        "loss's backward chunks over (auto: the vocabulary on CUDA when it outnumbers the rows)")  # fmt: skip
    parser.add_argument("--profile_top", type=int, default=8, help="operators listed from a profiled step (0: none)")
    parser.add_argument("--work_dir", default="/tmp/tunebook-vs-peers", help="shared with vs_peers.py's assets")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, no RESULTS.md")
    parser.add_argument("--out", default=None, help="add to DIR/packed_attention.jsonl as each backend finishes, and "
                        "write DIR/packed_attention.md from all its records, not RESULTS.md")  # fmt: skip
    parser.add_argument("--no_write", action="store_true")
    parser.add_argument("--record", nargs="+", default=None, help="write the section from these .jsonl files")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT / "src"))
    if args.record:
        records = [json.loads(line) for f in args.record for line in Path(f).read_text().splitlines() if line]
        text = table(records)
        print(text)
        write_section(f"packed_attention_{records[0]['device']}", text)
        return
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    known = shapes()
    default_shapes = "tiny" if args.smoke else ("SmolLM2-135M,Llama-3.2-1B" if cuda else "tiny-llama (vs_peers)")
    chosen = (args.shapes or default_shapes).split(",")
    for name in chosen:
        if name not in known:
            parser.error(f"--shapes: unknown shape {name!r}; choose from {', '.join(known)}")
    seq_lens = [int(x) for x in (args.seq_lens or ("2048,4096" if cuda else "512")).split(",")]
    row_tokens = args.row_tokens or (16384 if cuda else 4096)
    available = list(CUDA_BACKENDS if cuda else CPU_BACKENDS)
    if "flash_attention_2" in available:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            available.remove("flash_attention_2")
    backends = args.backends.split(",") if args.backends else available
    for b in backends:
        if b not in available:
            parser.error(f"--backends: {b!r} is not available on this {device}; choose from {', '.join(available)}")
    steps, warmup = (2, 1) if args.smoke else (args.steps, args.warmup)
    if args.smoke:
        args.examples = min(args.examples, 200)

    from tunebook.models import linear_ce

    default_chunk = linear_ce.CHUNK_ELEMENTS
    if args.chunk_elements:  # the fused loss's logits per chunk, for every step measured here
        linear_ce.CHUNK_ELEMENTS = args.chunk_elements
    linear_ce.VOCAB_BACKWARD = {"auto": None, "rows": False, "vocab": True}[args.ce_backward]
    lengths = example_lengths(Path(args.work_dir), args.examples, args.train_data)
    # Every record carries what its section needs, so one cut off at a time limit still makes a table (--record).
    context = {
        "device": device, "machine": machine(), "versions": versions(), "command": command(),
        "default_chunk_elements": default_chunk,
        "setup": f"{device}{', bf16 autocast over float32 weights' if cuda else ', float32'}; real example lengths "
                 f"(Code Alpaca, first {args.examples}, chat template of vs_peers' tokenizer) packed best-fit-decreasing;"
                 f" one step = forward + fused loss + backward, no optimizer; median of {steps} steps after {warmup} "
                 "of warm-up. Loss: the first step's, which must agree between backends.",
    }  # fmt: skip
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    results = []

    def keep(record: dict) -> None:
        record = {**context, **record}
        print(json.dumps(record), flush=True)
        results.append(record)
        if out:
            with open(out / "packed_attention.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    for shape in chosen:
        values = known[shape]
        for seq_len in seq_lens:
            rows = max(1, row_tokens // seq_len)
            for attn in backends:
                batch = packed_batch(lengths, seq_len, rows, attn, values["vocab_size"])
                figures = measure(values, attn, batch, steps, warmup, device, args.profile_top)
                keep({**figures, "shape": shape, "seq_len": seq_len, "rows": rows, "attn": attn,
                      "chunk_elements": linear_ce.CHUNK_ELEMENTS, "ce_backward": args.ce_backward,
                      "examples_per_row": float(((batch["seq_ids"] * batch["attention_mask"]).amax(1) + 1).float().mean()),
                      "fill": float(batch["attention_mask"].float().mean())})  # fmt: skip
                if cuda:
                    torch.cuda.empty_cache()
            timings = mask_timings(packed_batch(lengths, seq_len, rows, "sdpa", 2048), device)
            keep({"shape": shape, "seq_len": seq_len, "rows": rows, "mask": timings})

    text = table(results)
    print(text)
    if out:  # the table of every record there: several calls with one --out make one table
        records = [json.loads(line) for line in (out / "packed_attention.jsonl").read_text().splitlines() if line]
        (out / "packed_attention.md").write_text(table(records) + "\n")
    elif not (args.smoke or args.no_write):
        write_section(f"packed_attention_{device}", text)


if __name__ == "__main__":
    main()
