"""Multi-process and multi-node launches on CPU with gloo, through real `accelerate launch` processes.

- Two "nodes" on loopback (two launch commands, `--num_machines 2 --machine_rank 0|1`, one process each, each with
  its own data cache) train together: the result equals one process with the combined batch.
- Nodes launched with different configs stop at the preflight check with one message naming the key, in seconds.
- An FSDP config on a CPU stops at start-up instead of silently training with another engine.
- Under DDP with gradient accumulation, gradients are all-reduced only on the last micro-batch of each step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from support import ROOT, TINY_TEST_MODEL, free_port, kill_group, launch

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TOL = 1e-5
COMMON = [
    "--model_config", json.dumps(TINY_TEST_MODEL),
    *"""--disable_tqdm true --synthetic_train_size 200 --synthetic_eval_size 13 --max_steps 4 --logging_steps 1
    --learning_rate 1e-3 --warmup_ratio 0 --eval_on_start false --generation_eval false --report_to none
    --per_device_eval_batch_size 4""".split(),
]  # fmt: skip


def _node_command(rank: int, port: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--quiet",
            "--config_file", str(ROOT / "accelerate_configs" / "multi_cpu.yaml"),
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
            str(ROOT / "recipes" / "sft.py"), *args]  # fmt: skip


def _two_nodes(tmp_path, args_of_node):
    """Start both node commands at once; returns their CompletedProcess-like (returncode, output) pairs."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            _node_command(r, port, args_of_node(r)),
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # killed as a group on a timeout: the launcher's children too
        )  # fmt: skip
        for r in (0, 1)
    ]
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_group(q)
            raise
        results.append((p.returncode, out))
    return results


def _model(path):
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_two_nodes_on_loopback_train_together_like_one_process(tmp_path):
    out = tmp_path / "two-nodes"
    nodes = _two_nodes(
        tmp_path,
        lambda r: [
            *COMMON,
            "--per_device_train_batch_size",
            "2",
            "--output_dir",
            str(out),
            "--cache_dir",
            str(tmp_path / f"cache-node{r}"),
        ],  # fmt: skip  (node-local caches)
    )
    for rank, (code, log) in enumerate(nodes):
        assert code == 0, f"node {rank}:\n{log[-4000:]}"
    assert "Preflight: 2 processes agree" in nodes[0][1]
    one = tmp_path / "one"
    single = launch("recipes/sft.py", [*COMMON, "--per_device_train_batch_size", "4", "--output_dir", str(one)])
    assert single.returncode == 0, single.stderr[-3000:]
    two_summary, one_summary = (json.loads((d / "summary.json").read_text()) for d in (out, one))
    assert two_summary["num_processes"] == 2 and two_summary["train_tokens"] == one_summary["train_tokens"]
    a, b = _model(one), _model(out)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=TOL, rtol=TOL, msg=f"parameter {name}")


def test_nodes_with_different_configs_stop_at_the_preflight_check(tmp_path):
    start = time.monotonic()
    nodes = _two_nodes(
        tmp_path,
        lambda r: [*COMMON, "--output_dir", str(tmp_path / "out"), "--learning_rate", ["1e-3", "2e-3"][r]],
    )
    assert time.monotonic() - start < 120
    for rank, (code, log) in enumerate(nodes):
        assert code != 0, f"node {rank} should have stopped"
        assert f"tunebook: error (rank {rank}): preflight: the processes of this launch disagree" in log
        assert "config key 'learning_rate': 0.001 on rank 0" in log and "0.002 on rank 1" in log
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_compiled_blocks_under_ddp_train_like_one_eager_process(tmp_path):
    """torch_compile under DDP (2 gloo processes, packed rows: static graphs) ends with the weights of one eager
    process with the combined batch (1e-4: compiled kernels round differently from eager's)."""
    args = [*COMMON, "--packing", "true", "--max_seq_length", "64"]
    two, one = tmp_path / "two", tmp_path / "one"
    compiled = launch("recipes/sft.py", [*args, "--per_device_train_batch_size", "2", "--torch_compile", "true",
                                         "--output_dir", str(two)], accelerate_config="multi_cpu.yaml")  # fmt: skip
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    eager = launch("recipes/sft.py", [*args, "--per_device_train_batch_size", "4", "--output_dir", str(one)])
    assert eager.returncode == 0, eager.stderr[-3000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["torch_compile_shapes"] == "static"
    assert summary["torch_compile_recompiles"] == 0
    a, b = _model(one), _model(two)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=1e-4, msg=f"parameter {name}")


def test_fsdp_config_on_a_cpu_stops_instead_of_training_with_another_engine(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("FSDP runs on this machine")
    out = tmp_path / "fsdp"
    result = launch("recipes/sft.py", [*COMMON, "--output_dir", str(out)], accelerate_config="fsdp.yaml",
                    launcher_args=("--num_processes", "1"))  # fmt: skip
    text = result.stdout + result.stderr
    assert result.returncode != 0 and "the accelerate config asks for FSDP but Accelerate started" in text
    assert not (out / "model.safetensors").exists()


def test_a_script_that_starts_its_run_at_import_stops_with_how_to_guard_it(tmp_path):
    """Each DataLoader worker of a multi-process run, from the fork server, imports the launched script: without the
    guard it would train again in every worker."""
    out = tmp_path / "out"
    result = launch("tests/distributed/run_at_import.py", [*COMMON, "--output_dir", str(out)],
                    accelerate_config="multi_cpu.yaml")  # fmt: skip
    assert result.returncode != 0
    assert "run_at_import.py starts its run when it is imported" in result.stdout + result.stderr
    assert 'put its run under `if __name__ == "__main__":`' in result.stdout + result.stderr
    assert not (out / "model.safetensors").exists()


def test_ddp_all_reduces_gradients_only_on_the_last_micro_batch_of_each_step(tmp_path):
    """Also in an epoch's last window, fetched whole while the loader already reports its end (Accelerate's own
    accumulate() synced every micro-batch there; under DeepSpeed that stepped the engine each time)."""
    k, steps = 4, 5
    out = tmp_path / "count"
    args = [*COMMON, "--max_steps", str(steps), "--gradient_accumulation_steps", str(k), "--synthetic_train_size",
            "40", "--per_device_train_batch_size", "2", "--output_dir", str(out)]  # fmt: skip
    result = launch("tests/distributed/count_allreduces.py", args, accelerate_config="multi_cpu.yaml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        record = json.loads((out / f"allreduces-rank{rank}.json").read_text())
        step_at = record["step_at"]
        assert len(step_at) == steps and record["backward_passes"] == step_at[-1]
        # The run crossed an epoch: one step's window was not k micro-batches (the epoch's last, shorter one).
        windows = [b - a for a, b in zip([0, *step_at], step_at)]
        assert max(windows) == k and min(windows) < k, windows
        # Every bucket's all-reduce fired during the backward of a step's last micro-batch, and every step had one.
        assert sorted(set(record["allreduce_at"])) == step_at, record


SRUN = """#!/bin/bash
# Stand-in for Slurm's srun: the command once per node of the allocation, concurrently, with SLURM_NODEID set.
n=$SLURM_NNODES
while [[ "$1" == --* ]]; do [[ "$1" == --nodes=1 ]] && n=1; shift; done
pids=()
for ((i = 0; i < n; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
"""


def test_a_lora_checkpoint_of_an_fsdp2_sharded_model_holds_the_whole_adapters(tmp_path):
    """Under FSDP2 the adapters and the base weights are DTensor shards: the checkpoint's adapter directory (and the
    base copy beside it) must hold the gathered weights, the same files as from the unsharded model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result = launch("tests/distributed/fsdp2_lora_save.py", [str(tmp_path)], accelerate_config="multi_cpu.yaml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plain, sharded = (
        load_file(tmp_path / d / "adapter" / "adapter_model.safetensors") for d in ("unsharded", "sharded")
    )
    assert sorted(sharded) == sorted(plain) and any("lora_B" in k for k in plain)
    for key in plain:
        torch.testing.assert_close(sharded[key], plain[key], rtol=0, atol=0, msg=key)
    config = json.loads((tmp_path / "sharded" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "../base_model"  # relative to the adapter directory
    base_plain, base_sharded = (
        AutoModelForCausalLM.from_pretrained(tmp_path / d / "base_model").state_dict()
        for d in ("unsharded", "sharded")
    )
    assert sorted(base_sharded) == sorted(base_plain)
    for key in base_plain:
        torch.testing.assert_close(base_sharded[key], base_plain[key], rtol=0, atol=0, msg=key)


def test_an_fp16_overflow_in_one_fsdp2_shard_skips_the_update_on_every_rank(tmp_path):
    """Accelerate's FSDP2 scaler is torch's plain GradScaler: an overflow in rank 1's gradient shard alone must still
    skip the update on both ranks (counted by the loop's fp16 skip), and the next update goes ahead on both."""
    result = launch("tests/distributed/fsdp2_fp16_skip.py", [str(tmp_path)], accelerate_config="multi_cpu.yaml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1], ranks
    assert ranks[0]["scaler"] == "GradScaler" and ranks[0]["sharded"] == "DTensor"
    skipped, taken = ranks[0]["updates"]
    assert (skipped["updated"], skipped["weights_changed"], taken["updated"], taken["weights_changed"]) == (
        False, False, True, True)  # fmt: skip
    assert skipped["scale"] < 2.0**16 and ranks[0]["skipped_updates"] == 1


def test_the_slurm_script_prepares_once_then_launches_every_node(tmp_path):
    """scripts/slurm/train.sbatch under stand-ins for srun and scontrol: 2 "nodes" on loopback, CPU processes."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text(SRUN)
    (stubs / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "4242", "GPUS_PER_NODE": "1",
        "MAIN_PROCESS_PORT": str(free_port()), "ACCELERATE_CONFIG": "accelerate_configs/multi_cpu.yaml",
        "TUNEBOOK_CACHE": str(tmp_path / "shared-cache"), "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    out = tmp_path / "run"
    result = subprocess.run(
        ["bash", "scripts/slurm/train.sbatch", "recipes/sft.py", *COMMON, "--output_dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    assert "tunebook: 2 node(s) x 1 GPU(s), main 127.0.0.1:" in log
    assert "train tokenisation" in log  # `tunebook prepare` built the caches ...
    assert "Data ready" in log and "(all cached)" in log  # ... and the launched recipe only loaded them
    assert "Preflight: 2 processes agree" in log
    assert json.loads((out / "summary.json").read_text())["num_processes"] == 2


@pytest.mark.multiprocess
def test_an_fsdp2_sharded_policy_reaches_the_inference_engine_whole_on_every_process(tmp_path):
    """GRPO's weight sync under FSDP2: every process gathers the DTensor shards into the whole weights, under plain
    names, LoRA merged, as the unsharded model gives them."""
    result = launch("tests/distributed/engine_weights_sharded.py", ["fsdp2", str(tmp_path)],
                    accelerate_config="multi_cpu.yaml")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    from engine_weights_sharded import same_as_unsharded

    same_as_unsharded(tmp_path / "fsdp2")
