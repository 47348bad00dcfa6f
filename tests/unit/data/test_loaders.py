from __future__ import annotations

import numpy as np
import pytest
import torch

from tunebook.config import SFTConfig
from tunebook.data.collate import PackedCollator, PadCollator
from tunebook.data.loaders import LengthGroupedSampler, build_loader, fixed_batch_shape, train_and_eval_loaders


def _lengths(n=1000, seed=0):
    return np.random.default_rng(seed).integers(5, 500, size=n)


def test_length_grouped_batches_pad_far_less_than_random_ones():
    lengths = _lengths()
    order = list(LengthGroupedSampler(lengths, batch_size=8, seed=1))
    assert sorted(order) == list(range(len(lengths)))

    def padded(order):
        batches = [lengths[order[i : i + 8]] for i in range(0, len(order), 8)]
        return sum(len(b) * b.max() for b in batches)

    random_order = np.random.default_rng(1).permutation(len(lengths)).tolist()
    assert padded(order) < 0.7 * padded(random_order)
    assert lengths[order[:8]].max() == lengths.max()  # the longest batch first: out-of-memory shows at step 1


def test_order_depends_only_on_seed_and_epoch():
    lengths = _lengths()
    a, b = LengthGroupedSampler(lengths, 8, seed=1), LengthGroupedSampler(lengths, 8, seed=1)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    assert list(LengthGroupedSampler(lengths, 8, seed=2)) != list(a)


def test_loader_uses_the_length_grouped_sampler_only_when_shuffling_with_lengths():
    data = [{"x": i} for i in range(10)]
    loader = build_loader(data, 2, lambda b: b, shuffle=True, seed=0, lengths=np.arange(10), group_size=4)
    assert isinstance(loader.sampler, LengthGroupedSampler) and loader.sampler.batch_size == 4
    assert not isinstance(build_loader(data, 2, lambda b: b, shuffle=True, seed=0).sampler, LengthGroupedSampler)


@pytest.mark.parametrize(
    ("compile", "cuda", "static"),
    [(False, True, False), (True, False, True), ("auto", False, False), ("auto", True, True)],
)
def test_under_torch_compile_packed_training_batches_have_one_shape(compile, cuda, static, monkeypatch):
    """torch_compile: training batches of packed rows are micro-batch x max_seq_length (one shape, static graphs), the
    epoch's last batch filled up with rows of padding alone that carry no label; evaluation batches and padded
    examples keep the shape of their rows. `auto` gives them one shape where CUDA may compile them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    rows = [{"input_ids": [5] * n, "labels": [5] * n, "seq_lengths": [n]} for n in (9, 20, 7, 12, 10)]
    config = SFTConfig(packing=True, max_seq_length=32, torch_compile=compile, dataloader_num_workers=0,
                       dataloader_pin_memory=False, per_device_train_batch_size=2, per_device_eval_batch_size=2)  # fmt: skip
    train, evaluation = train_and_eval_loaders(config, rows, rows, PackedCollator(0, pad_to_multiple_of=8))
    batches = list(train)
    assert sum(b["attention_mask"].sum().item() for b in batches) == 58  # every real token, once
    assert sum((b["labels"] != -100).sum().item() for b in batches) == 58  # none in the rows of padding
    real_rows = [row.any().item() for b in batches for row in b["attention_mask"]]
    if static:
        assert {tuple(b["input_ids"].shape) for b in batches} == {(2, 32)}
        assert real_rows.count(False) == 1  # the last batch's second row: padding alone
    else:
        assert sorted(b["input_ids"].shape[0] for b in batches) == [1, 2, 2] and all(real_rows)
    assert fixed_batch_shape(train) == ((2, 32) if static else None) and fixed_batch_shape(evaluation) is None
    assert {tuple(b["input_ids"].shape) for b in evaluation} == {(2, 24), (2, 16), (1, 16)}
    padded, _ = train_and_eval_loaders(config, rows, None, PadCollator(0, pad_to_multiple_of=8))
    assert fixed_batch_shape(padded) is None
    with pytest.raises(ValueError, match="a packed row of 20 tokens is longer than row_length 16"):
        PackedCollator(0, row_length=16)(rows[:2])


def _whose_worker(batch):
    """Collate: the worker's pid, its parent's pid and the parent's command line."""
    import os

    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().replace(b"\0", b" ").decode()
    return {"pid": os.getpid(), "parent": os.getppid(), "parent_command": parent, "batch": batch}


def _rank_loader(rank, init_file, result_dir):
    import json
    import os

    import torch.distributed as dist

    from tunebook.data.loaders import build_loader, start_worker_server

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    start_worker_server(2)
    loader = build_loader(list(range(8)), 2, _whose_worker, shuffle=False, seed=0, num_workers=2)
    batches = list(loader)
    with open(f"{result_dir}/rank{rank}.json", "w") as f:
        json.dump({"pid": os.getpid(), "batches": batches}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_workers_of_a_process_in_a_group_are_forked_by_a_fork_server_that_imported_tunebook(tmp_path):
    """Forked from a training process whose gloo/NCCL threads run collectives, a worker can start with a lock held
    that no thread will release, and hang (seen in ~1 of 40 GRPO runs under ZeRO-3). In a process group of several
    processes, workers come from a fork server (one per process), which imported the process's Tunebook modules."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_rank_loader, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [b["batch"] for b in result["batches"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        servers = {b["parent"] for b in result["batches"]}
        assert len({b["pid"] for b in result["batches"]}) == 2 and len(servers) == 1 and result["pid"] not in servers
        command = result["batches"][0]["parent_command"]
        assert "multiprocessing.forkserver" in command and "'tunebook.data.loaders'" in command


def test_workers_of_a_single_process_are_forked_from_it():
    import os

    batches = list(build_loader(list(range(4)), 2, _whose_worker, shuffle=False, seed=0, num_workers=2))
    assert [b["batch"] for b in batches] == [[0, 1], [2, 3]]
    assert {b["parent"] for b in batches} == {os.getpid()}
