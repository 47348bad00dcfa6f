#!/usr/bin/env bash
# Issue 17's GPU points on a lent GPU machine (the workplace's `device` tool), a part per command.
#
# That machine has no network and its own Python 3.12 with CUDA PyTorch, accelerate, peft and an older transformers,
# but not datasets, evaluate, trl, deepspeed, bitsandbytes or liger-kernel; `../shared` does not travel there.
# So the packages travel as wheels and the data as a file, both in git-ignored folders named in the call's `carry`.
#
#   here, once:   bash benchmarks/gpu/run.sh prepare     # .whl/ (24 MiB), .whl-qlora/ (7 MiB), .gpu/ (data)
#   there, each command within the 10-minute limit, carry [".whl", ".whl-qlora", ".gpu"]:
#     bash benchmarks/gpu/run.sh peers SmolLM2-135M      # point 7; then Llama-3.2-1B
#     bash benchmarks/gpu/run.sh packed                  # point 3: dense mask vs flex vs varlen
#     bash benchmarks/gpu/run.sh tests                   # point 8 and the CUDA equivalence tests
#     bash benchmarks/gpu/run.sh lease                   # the next lease's questions, in under 10 minutes
#     bash benchmarks/gpu/run.sh vlm                     # issue 45 point 7: Qwen2.5-VL-3B shape vs TRL (~6 min?)
#     bash benchmarks/gpu/run.sh grpo-gen                # issue 46 point 6: GRPO generation, generate vs vLLM
#     bash benchmarks/gpu/run.sh plan                    # issue 47 point 3: the memory plan vs max_memory_allocated
#   (on an H100, 2026-11-26: a Llama-3.2-1B run ~60 s, a first one ~25 s more to build the model; `peers
#   Llama-3.2-1B --seq_lens 2048` ~4.5 min; `packed` at 2048 ~2 min a shape with flex compiling; `tests -n 6` ~2.6 min.
#   A lease is 15 minutes of device time, the machine's start included, and a machine idle for 30 s goes back bare;
#   the wheels install once per machine, ~20 s, so several parts in one command, or calls in a row, share it)
#   here, after:  python benchmarks/gpu/gpu_vs_peers.py --record <files_at>/runs.jsonl ...   # the section of RESULTS.md
#
# Every part writes its log and tables to $OUT (what comes back), or to ./gpu-out without one.
# `prepare --python 3.11` fetches the wheels for this machine's Python instead, to rehearse a part here on the CPU
# (`check` then installs them into a scratch folder and runs the parts' smoke versions).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}  # the machine's Python (`check`: one set up like it)
PART=${1:-}
shift || true

# Versions: those this checkout is tested with (make's .venv), so the GPU machine runs what CI ran; the two that
# make test does not install are pinned here (trl as in pyproject's bench extra).
WHEELS="transformers tokenizers datasets dill multiprocess fsspec evaluate hjson pydantic pydantic-core annotated-types
typing-inspection pillow"
PINNED="trl==1.16.0 liger-kernel==0.8.5"

prepare() {
    local py=3.12 venv=${VENV:-.venv}
    [[ ${1:-} == --python ]] && py=$2
    [[ -x $venv/bin/python ]] || { echo "prepare: no $venv (run make first)"; exit 2; }
    local pip=("$venv/bin/python" -m pip)
    rm -rf .whl .whl-qlora && mkdir -p .whl .whl-qlora .gpu
    local platforms=(--python-version "$py" --implementation cp --only-binary=:all: --no-deps)
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
        manylinux2014_x86_64 any; do platforms+=(--platform "$p"); done
    local specs=($PINNED)
    for name in $WHEELS; do
        specs+=("$name==$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$name'))")")
    done
    "${pip[@]}" download -q "${platforms[@]}" -d .whl "${specs[@]}"
    # DeepSpeed publishes a source archive only: built here into a pure-Python wheel (its CUDA ops compile on first
    # use there, where nvcc is).
    local ds
    ds=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('deepspeed'))")
    DS_BUILD_OPS=0 "${pip[@]}" wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$ds"
    # bitsandbytes ships a library per CUDA and ROCm release (43 MiB); the machine's PyTorch is built for CUDA 13, so
    # only the CUDA 13 libraries (and the CPU one it loads first) travel.
    "${pip[@]}" download -q "${platforms[@]}" --platform manylinux_2_24_x86_64 -d .whl-qlora "bitsandbytes>=0.45"
    "$venv/bin/python" - .whl-qlora/bitsandbytes-*.whl <<'EOF'
import base64, hashlib, re, sys, zipfile
from pathlib import Path

src = Path(sys.argv[1])
dst = src.with_suffix(".tmp")
keep = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    names = [n for n in zin.namelist() if not n.endswith(".so") or keep.search(n)]
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    lines = []
    for n in names:
        if n == record:
            continue
        data = zin.read(n)
        zout.writestr(n, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{n},sha256={digest},{len(data)}")
    zout.writestr(record, "\n".join(lines + [f"{record},,"]) + "\n")
dst.replace(src)
EOF
    cp ../shared/data/code_alpaca_2k/code_alpaca_2k.json .gpu/
    du -sh .whl .whl-qlora .gpu
}

install() {  # there: the carried wheels over the machine's packages, this checkout's src/ first on the path
    local site=/tmp/site
    [[ -d .whl && -d .whl-qlora ]] || { echo "no .whl/ or .whl-qlora/: run 'bash benchmarks/gpu/run.sh prepare'" \
        "here and carry them"; exit 2; }
    # Once per machine: the parts of one command (or of calls on a warm machine) share the install (~20 s each).
    local wheels
    wheels=$(cd "$ROOT" && ls .whl/*.whl .whl-qlora/*.whl)
    if [[ $(cat "$site/.tunebook-wheels" 2>/dev/null) != "$wheels" ]]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            .whl/*.whl .whl-qlora/*.whl
        echo "$wheels" >"$site/.tunebook-wheels"
    fi
    export PYTHONPATH="$ROOT/src:$site${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    "$PY" - <<'EOF'
import importlib.metadata as m, platform, torch
names = "torch transformers accelerate datasets evaluate peft trl deepspeed liger-kernel bitsandbytes".split()
found = []
for n in names:
    try:
        found.append(f"{n} {m.version(n)}")
    except m.PackageNotFoundError:
        found.append(f"{n} -")
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
print(f"Python {platform.python_version()}; {gpu}; " + ", ".join(found), flush=True)
EOF
}

OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
DATA=$ROOT/.gpu/code_alpaca_2k.json
case $PART in
prepare) prepare "$@" ;;
peers)  # point 7: gpu_vs_peers.py for the shapes named (comma-separated), each run's figures kept as it ends
    install
    "$PY" benchmarks/gpu/gpu_vs_peers.py --train_data "$DATA" --out "$OUT" --shapes "${1:?a shape, e.g. SmolLM2-135M}" \
        "${@:2}" 2>&1 | tee -a "$OUT/peers.log"
    ;;
packed)  # point 3: one training step per packed-attention backend, SmolLM2-135M and Llama-3.2-1B shapes
    install
    "$PY" benchmarks/packed_attention.py --train_data "$DATA" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/packed.log"
    ;;
tests)  # point 8 (QLoRA included) and the CUDA cases of the equivalence tests; `-n 6` (pytest-xdist) takes ~2.5 min
    install
    # appended, as the lease runs this part twice; pytest's -rA summary names every test's outcome
    "$PY" -m pytest -m gpu tests/gpu tests/equivalence -p no:cacheprovider -rA "$@" 2>&1 | tee -a "$OUT/tests.log"
    ;;
lease)  # what one 15-minute lease should run first, in one command of under 10 minutes: each part is cut at its
    # own limit (a part's finished runs stay in $OUT), the last gets what is left; 8 files come back, no more.
    # The open questions of the second H100 lease (RESULTS.md, 2026-11-26): why the compiled 1B run ended 0.15 lower
    # in loss than eager, and the 1B shape's MFU (28% compiled, goal 45%), 35% of whose step is the LM head.
    install
    end=$(($(date +%s) + ${LEASE_SECONDS:-560}))
    part() { # seconds, then the part's arguments
        local s=$1 left=$((end - $(date +%s)))
        shift
        ((left > 30)) || { echo "lease: no time left for: $*"; return 0; }
        timeout -k 5 $((s < left ? s : left)) bash "$ROOT/benchmarks/gpu/run.sh" "$@" || echo "lease: part ended ($?): $*"
    }
    # 1. gradients through packed rows in bf16 per SDPA kernel (cuDNN's, which eager takes with a mask, the others,
    #    compiled blocks; flex and compile take most of the time), and the fused loss's backward by vocabulary
    #    slices, each against the plain computation; -v names each outcome as it comes, in case the part is cut
    part 120 tests -v --tb=short -p no:benchmark -k "fused_loss_on_cuda or bf16_autocast_are"
    # 2. the recipe on the 1B shape: default, default without cuDNN's attention, compiled, on one machine (the first
    #    builds the model, ~25 s); runs.jsonl keeps each window's loss, to see where the losses part
    part 110 peers Llama-3.2-1B --seq_lens 2048 --systems tunebook --work_dir /tmp/gvp
    part 80 peers Llama-3.2-1B --seq_lens 2048 --systems tunebook --work_dir /tmp/gvp --no_cudnn_attention
    part 80 peers Llama-3.2-1B --seq_lens 2048 --systems tunebook --work_dir /tmp/gvp \
        --tunebook_args "--torch_compile true"
    # 3. the fused loss's backward on CUDA: slices of the vocabulary (its default there now) against row chunks, one
    #    profiled 1B step each
    part 60 packed --shapes Llama-3.2-1B --seq_lens 2048 --backends sdpa --steps 8 --ce_backward vocab
    part 60 packed --shapes Llama-3.2-1B --seq_lens 2048 --backends sdpa --steps 8 --ce_backward rows
    # 4. every CUDA test (~2.6 min with -n 6), then FlexAttention in the recipe (compiling flex takes over a minute)
    #    and SmolLM2-135M against the peers: a second command's, where the first leaves too little
    part 180 tests -n 6 -q --tb=short -rfE -p no:benchmark
    part 150 peers Llama-3.2-1B --seq_lens 2048 --systems tunebook --work_dir /tmp/gvp \
        --tunebook_args "--attn_implementation flex_attention"
    part 600 peers SmolLM2-135M --seq_lens 2048 --work_dir /tmp/gvp
    ;;
vlm)  # issue 45 point 7: image-text SFT of a Qwen2.5-VL-3B shape (random weights, its published sizes) against TRL's
    # SFTTrainer, bf16, pictures x4 (up to 192 image tokens a row), 40 steps of 8 rows; each run's record in $OUT as
    # it ends. Here, after: python benchmarks/vlm_sft.py --shape qwen2.5-vl-3b --device cuda --from_records FILE
    install
    "$PY" benchmarks/vlm_sft.py --shape qwen2.5-vl-3b --device cuda --bf16 --image_scale 4 --max_pixels 200704 \
        --examples 512 --batch 8 --max_steps 40 --timing_warmup 5 --max_length 1024 --lr 1e-5 --num_workers 4 \
        --work_dir /tmp/vlm --records "$OUT/vlm.jsonl" --no_write "$@" 2>&1 | tee -a "$OUT/vlm.log"
    ;;
plan)  # issue 47 point 3: tunebook plan against torch.cuda.max_memory_allocated, the Llama-3.2-1B shape (random
    # weights from its config.json): SFT full, LoRA and checkpointed, DPO and GRPO with LoRA, 4 steps each (~5 min?)
    install
    "$PY" benchmarks/plan_gpu.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/plan.log"
    ;;
grpo-gen)  # issue 46 point 6: GRPO generation, transformers generate vs vLLM (colocated; a server if asked), on a
    # Qwen2.5-0.5B shape (random weights, its published sizes), bf16, 8 completions of 512 tokens per prompt. vLLM is
    # not among the carried wheels (hundreds of MB): the vLLM rows need a machine that has it; without it only the
    # transformers rows run, and the table says so.
    install
    only=(transformers transformers-async)
    "$PY" -c "import vllm" 2>/dev/null && only+=(vllm-colocate vllm-colocate-async)
    "$PY" benchmarks/grpo_generation.py --accelerate_config single_gpu.yaml --max_new_tokens 512 --steps 6 \
        --memory_share 0.4 --prompts 8 --num_generations 8 --model_config '{"model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": true}' \
        --only "${only[@]}" --work_dir /tmp/grpo-gen --records "$OUT/grpo_gen.jsonl" \
        --no_write "$@" 2>&1 | tee -a "$OUT/grpo_gen.log"
    ;;
check)  # here, after `prepare --python 3.11`: the carried set installs and every part's code path runs on the CPU
    install
    "$PY" benchmarks/gpu/gpu_vs_peers.py --smoke --systems tunebook,trl --out "$OUT" 2>&1 | tail -5
    "$PY" benchmarks/packed_attention.py --smoke --train_data "$DATA" --out "$OUT" 2>&1 | tail -5
    "$PY" -m pytest -m gpu tests/gpu tests/equivalence -p no:cacheprovider -q 2>&1 | tail -3
    ;;
*)
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"
    exit 2
    ;;
esac
