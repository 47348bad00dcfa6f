"""`tunebook vllm-serve --model DIR [--host H] [--port P] [vLLM server options]`: a vLLM engine for GRPO's
`vllm_mode: server`, as `trl vllm-serve` starts one.

It runs vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`) with what the trainer
needs of it: dev mode (`VLLM_SERVER_DEV_MODE=1`) for `POST /collective_rpc` (new weights, `reload_weights`) and
`POST /reset_prefix_cache`, and `--logprobs-mode processed_logprobs` (the sampled tokens' log-probs after
temperature, what the trainer compares with its own). Any other option goes to vLLM unchanged
(`--gpu-memory-utilization 0.9`, `--tensor-parallel-size 2`, `--max-model-len 4096`, ...). The server must see the
trainer's output directory (it reloads weights from there): the same machine or a shared file system.
"""

from __future__ import annotations

import os
import sys

from ..errors import ConfigError

__all__ = ["vllm_serve", "server_command"]

CPU_MEMORY_SHARE = 0.3
USAGE = "usage: tunebook vllm-serve --model MODEL_DIR [--host HOST] [--port PORT] [vLLM server options]"


def server_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the command line, the environment) of the server `argv` asks for; a missing --model is a one-line error."""
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        raise ConfigError(f"tunebook vllm-serve needs --model (a model directory or Hub id)\n{USAGE}")
    options = list(argv)
    if not any(a.startswith("--logprobs-mode") for a in options):
        options += ["--logprobs-mode", "processed_logprobs"]
    if not any(a.startswith("--host") for a in options):
        options += ["--host", "0.0.0.0"]
    if not any(a.startswith("--gpu-memory-utilization") for a in options) and not _cuda():
        # vLLM's CPU platform reads it as the share of the machine's memory to reserve, 0.92 by default: on a
        # training machine that leaves the trainer almost nothing
        options += ["--gpu-memory-utilization", str(CPU_MEMORY_SHARE)]
    environment = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *options], environment


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def vllm_serve(argv: list[str]) -> None:
    from ..rl.vllm_backends import require_vllm

    require_vllm()
    command, environment = server_command(argv)
    print("tunebook vllm-serve:", " ".join(command[1:]), flush=True)
    os.execvpe(command[0], command, environment)  # the server is this process: signals reach it directly
