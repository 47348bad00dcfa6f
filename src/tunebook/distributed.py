"""Starting several processes (one machine or many) so that a bad start fails loudly instead of hanging.

Two rules:
- Data is prepared before the processes wait for each other, never inside a collective. With Accelerate's
  `main_process_first()` the other ranks wait in a barrier while the main process tokenises; a barrier has the
  process group's timeout (NCCL's watchdog kills it after 10 minutes by default), so a large data set killed the
  run. Here every process takes a file lock on each cache entry it needs (`preparation_lock`, keyed by the entry's
  fingerprint) instead: the first one builds it, the others wait on the lock (no timeout) and then map the finished
  files. Runs that need other entries (other data, tokenizer or settings) in the same cache do not wait.
- Then a preflight check joins all ranks with its own, short timeout and compares what they must agree on: world
  size, the resolved config, the prepared data and the library versions. A node that never started, a rank that
  crashed while preparing, or nodes launched with different configs or data are named in one message.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from .errors import ConfigError, TrainingError, TunebookError, first_line, same_on_every_rank
from .preparation import preparation_lock

__all__ = [
    "PreflightError",
    "data_fingerprint",
    "preflight_check",
    "prepare_then_join",
    "preparation_lock",
    "run_facts",
]

logger = logging.getLogger("tunebook")


class PreflightError(ConfigError):
    """The processes of a launch could not meet, or do not agree on what they are about to train."""


def data_fingerprint(dataset) -> str | None:
    """A content hash of a prepared data set: its size, columns and 64 rows spread over it.

    Cheap at any size, and it differs when two nodes prepared different data (other files, tokenizer, length or
    packing settings), which a hash of the file names would miss.
    """
    if dataset is None:
        return None
    from .data.cache import fingerprint

    n = len(dataset)
    rows = sorted({i * (n - 1) // 63 for i in range(64)}) if n else []
    sample = dataset.select(rows).to_dict() if rows else {}
    return fingerprint({"rows": n, "columns": sorted(dataset.column_names), "sample": sample})


def run_facts(config, data, num_processes: int) -> dict[str, Any]:
    """What every rank must agree on before training: world size, config, data, library versions."""
    from .config import config_to_dict
    from .run.record import versions

    resolved = config_to_dict(config)
    resolved.pop("cache_dir", None)  # node-local caches may live at different paths
    return {
        "world_size": num_processes,
        "config": resolved,
        "data": {"train": data_fingerprint(data.train), "eval": data_fingerprint(getattr(data, "eval", None))},
        "versions": versions(),
    }


_ADVICE = (
    "Check that every node was started (the same command with machine_rank 0..num_machines-1 and the same "
    "num_processes), that main_process_ip:main_process_port is reachable from every node (firewall; "
    "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME naming the right network interface), and the log of every rank for "
    "an earlier error (data, model, out of memory). docs/distributed.md lists what to check."
)


def preflight_check(facts: dict[str, Any], timeout: float, rank: int, world_size: int) -> None:
    """Meet all ranks within `timeout` seconds and compare their `facts`; raise `PreflightError` otherwise.

    Runs over its own gloo group (CPU sockets, whatever the training backend) with `monitored_barrier`, which
    names the ranks that did not arrive. Call it on every rank after data preparation and before training.
    """
    if world_size <= 1:
        return
    import torch.distributed as dist

    facts = {**facts, "host": socket.gethostname(), "rank": rank}
    wait = timedelta(seconds=timeout)
    group = None
    try:
        group = dist.new_group(backend="gloo", timeout=wait)
        dist.monitored_barrier(group=group, timeout=wait, wait_all_ranks=True)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, facts, group=group)
    except RuntimeError as e:  # DistBackendError and gloo's timeouts are RuntimeErrors
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise PreflightError(
            f"preflight: rank {rank} on {facts['host']} could not meet all {world_size} processes within "
            f"{timeout:.0f} s (preflight_timeout): {first}. {_ADVICE}"
        ) from None
    finally:
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # the group may be broken by the failure above; nothing left to release
                pass
    problems = disagreements(gathered)
    if problems:
        raise PreflightError("preflight: the processes of this launch disagree:\n  " + "\n  ".join(problems))


def disagreements(gathered: list[dict[str, Any]]) -> list[str]:
    """Human-readable differences between the ranks' facts (empty when they all agree)."""
    first = gathered[0]
    where = lambda f: f"rank {f['rank']} ({f['host']})"  # noqa: E731
    problems = []
    for other in gathered[1:]:
        if other["world_size"] != first["world_size"]:
            problems.append(f"world size {first['world_size']} on {where(first)} vs {other['world_size']} on "
                            f"{where(other)}: every node must be launched with the same num_processes")  # fmt: skip
        keys = sorted(k for k in first["config"].keys() | other["config"].keys()
                      if first["config"].get(k) != other["config"].get(k))  # fmt: skip
        for key in keys:
            problems.append(f"config key {key!r}: {first['config'].get(key)!r} on {where(first)} vs "
                            f"{other['config'].get(key)!r} on {where(other)}")  # fmt: skip
        for split in ("train", "eval"):
            if first["data"][split] != other["data"][split]:
                problems.append(f"prepared {split} data differ between {where(first)} and {where(other)} "
                                "(content fingerprints): give every node the same data files, or one shared "
                                "cache_dir prepared once with `tunebook prepare`")  # fmt: skip
        for lib in sorted(first["versions"].keys() | other["versions"].keys()):
            if first["versions"].get(lib) != other["versions"].get(lib):
                problems.append(f"{lib} {first['versions'].get(lib)} on {where(first)} vs "
                                f"{other['versions'].get(lib)} on {where(other)}")  # fmt: skip
    return list(dict.fromkeys(problems))


def prepare_then_join(accelerator, config, prepare, cache_dir: Path, log: logging.Logger):
    """`prepare(config, cache_dir, log)`, then the preflight check of all ranks; logs how long the data took and what
    was built.

    What the recipes call instead of preparing inside `accelerator.main_process_first()` (see the module notes):
    `prepare` takes the lock of each cache entry it builds, so the first process builds it and the others map it.
    """
    try:
        data = prepare(config, cache_dir, log)
    except TunebookError as error:  # every process meets it: one report per machine
        raise same_on_every_rank(error) from None
    if accelerator.num_processes > 1:
        facts = run_facts(config, data, accelerator.num_processes)
        preflight_check(facts, config.preflight_timeout, accelerator.process_index, accelerator.num_processes)
        log.info("Preflight: %d processes agree on config, data and versions", accelerator.num_processes)
    log.info(
        "Data ready in %.1f s (%s)", data.seconds, "built: " + ", ".join(data.built) if data.built else "all cached"
    )
    return data


def decided_by_main(accelerator, decide: Callable[[], Any]) -> Any:
    """`decide()` on the main process only, its answer (or its error) on every process: a choice that reads files
    (verifying a checkpoint of many GB) is made once, and made the same everywhere. A `TunebookError` is raised on
    every process as the same line; any other error is raised as it is by the main process, and as one line naming
    it by the others, which would otherwise wait for an answer that never comes."""
    answer, error = None, None
    if accelerator.is_main_process:
        try:
            answer = decide()
        except Exception as raised:
            error = raised
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        shared = [answer, None]
        if isinstance(error, TunebookError):
            shared[1] = (type(error), str(error))
        elif error is not None:
            shared[1] = (TrainingError, f"the main process failed: {type(error).__name__}: {first_line(error)}")
        broadcast_object_list(shared, from_process=0)
        answer = shared[0]
        if error is None and shared[1] is not None:
            error = shared[1][0](shared[1][1])
    if isinstance(error, TunebookError):
        raise same_on_every_rank(error)
    if error is not None:
        raise error
    return answer
