"""The preflight check: ranks that agree pass, a missing rank or a disagreement is one clear error, in seconds."""

from __future__ import annotations

import time

import pytest
import torch.multiprocessing as mp

from tunebook.distributed import disagreements, preflight_check

FACTS = {
    "world_size": 2,
    "config": {"learning_rate": 1e-4, "max_steps": 10},
    "data": {"train": "aaaa", "eval": "bbbb"},
    "versions": {"torch": "2.13.0"},
}


def _rank(rank, init_file, result_file, scenario):
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    facts = json.loads(json.dumps(FACTS))
    if scenario == "missing" and rank == 1:
        time.sleep(8)  # alive, but never reaches the check
        return
    if scenario == "config" and rank == 1:
        facts["config"]["learning_rate"] = 3e-4
    start = time.monotonic()
    try:
        preflight_check(facts, timeout=3, rank=rank, world_size=2)
        outcome = "ok"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"outcome": outcome, "seconds": time.monotonic() - start}, f)


def _run(tmp_path, scenario):
    import json

    tmp_path.mkdir(parents=True, exist_ok=True)
    result = tmp_path / "result.json"
    mp.start_processes(_rank, args=(str(tmp_path / "init"), str(result), scenario), nprocs=2, start_method="spawn")
    return json.loads(result.read_text())


@pytest.mark.slow
def test_agreeing_ranks_pass_and_a_missing_rank_fails_within_the_timeout(tmp_path):
    assert _run(tmp_path / "a", "agree")["outcome"] == "ok"
    missing = _run(tmp_path / "b", "missing")
    assert missing["outcome"].startswith("PreflightError: preflight: rank 0")
    assert "within 3 s (preflight_timeout)" in missing["outcome"] and "machine_rank" in missing["outcome"]
    assert missing["seconds"] < 30  # seconds, not the process group's 30 minutes


@pytest.mark.slow
def test_a_config_difference_names_the_key_on_every_rank(tmp_path):
    outcome = _run(tmp_path, "config")["outcome"]
    assert outcome.startswith("PreflightError") and "config key 'learning_rate': 0.0001 on rank 0" in outcome


def test_disagreements_name_world_size_data_and_versions():
    a = {**FACTS, "rank": 0, "host": "node-a"}
    b = {**FACTS, "rank": 1, "host": "node-b", "world_size": 4, "data": {"train": "cccc", "eval": "bbbb"},
         "versions": {"torch": "2.11.0"}}  # fmt: skip
    problems = disagreements([a, b])
    assert any("world size 2 on rank 0 (node-a) vs 4 on rank 1 (node-b)" in p for p in problems)
    assert any(p.startswith("prepared train data differ") for p in problems)
    assert any(p == "torch 2.13.0 on rank 0 (node-a) vs 2.11.0 on rank 1 (node-b)" for p in problems)
    assert disagreements([a, {**a, "rank": 1}]) == []
