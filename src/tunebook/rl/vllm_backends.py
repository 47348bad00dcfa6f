"""vLLM as GRPO's generation engine (`use_vllm: true`), TRL's two ways:

- `vllm_mode: colocate`: an engine inside each training process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so it shares
  the process, and on a GPU the device, with the trainer: `vllm_gpu_memory_utilization` caps its share and
  `vllm_enable_sleep_mode` frees its memory between generations). New weights arrive as tensors through the
  workers' `reload_weights(weights_iterator=...)`, no copy on disk.
- `vllm_mode: server`: one engine in its own process (`tunebook vllm-serve --model ...`), reached over HTTP
  (`/v1/completions` with token-id prompts, per-request seeds and log-probs). New weights arrive as a safetensors
  directory that the main process writes and the server's workers reload (`POST /collective_rpc` with
  `reload_weights(weights_path=...)`): the server must see the trainer's disk (same machine or a shared file system).

Both use `reload_weights`, which works on every vLLM platform, the CPU one included; TRL's way,
`model.load_weights` on the worker's model, fails on the CPU backend and can leave the model half loaded. The
prefix cache is reset after every reload: its keys and values were computed with the old weights.

Each completion is its own request with its own seed (`completion_seed`), as with the transformers backend; the
engine reports the log-probability of every token it sampled after temperature (`logprobs_mode:
processed_logprobs`, as TRL sets it), what the trainer compares with its own (`tunebook.rl.mismatch`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config.grpo import VLLM_INSTALL
from ..errors import ConfigError, TunebookError
from .engine_weights import engine_weights, write_engine_model
from .generation import Generated, GenerationBackend, Sampling

__all__ = ["VLLMColocated", "VLLMServer", "make_vllm_backend", "require_vllm"]


def require_vllm():
    """The vllm module, or the one line that says how to install it."""
    try:
        import vllm
    except ImportError:
        raise ConfigError(
            f"use_vllm: true needs vLLM, which is not installed here; install it with: {VLLM_INSTALL}"
        ) from None
    return vllm


@contextmanager
def _engine_environment():
    """What an engine in this process needs while it starts, and nothing left behind: vLLM's V1 engine core in the
    same process (not a child), and on the CPU platform its worker replaces `torch.set_num_threads` for good (a
    no-op that warns), which would silently pin the trainer's own thread count: put back once it has started."""
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous


def _engine_dtype(model, accelerator) -> str:
    """The dtype the trainer computes in: under bf16/fp16 mixed precision that, not the float32 master weights'."""
    precision = getattr(accelerator, "mixed_precision", "no")
    if precision in ("bf16", "fp16"):
        return {"bf16": "bfloat16", "fp16": "float16"}[precision]
    dtype = next(model.parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")


class VLLMColocated(GenerationBackend):
    """An engine in this process, started from a directory holding the policy's weights (`write_engine_model`)."""

    name = "vllm (colocated)"
    starts_from_policy = True

    def __init__(self, config, model, tokenizer, accelerator, directory: Path, log):
        vllm = require_vllm()
        self.log, self.sleep = log, bool(config.vllm_enable_sleep_mode)
        write_engine_model(model, tokenizer, directory)  # every process its own copy: each starts its own engine
        options = {
            "model": str(directory),
            "skip_tokenizer_init": True,  # token ids in, token ids out: the trainer's tokenizer renders and decodes
            "dtype": _engine_dtype(model, accelerator),
            "seed": config.seed,
            "max_model_len": config.vllm_max_model_length or (config.max_prompt_length + config.max_new_tokens),
            "logprobs_mode": "processed_logprobs",
            "enable_prefix_caching": True,  # a group's G completions share their prompt
        }
        # On vLLM's CPU platform the same key is the share of the machine's memory the engine reserves.
        options.update(gpu_memory_utilization=config.vllm_gpu_memory_utilization)
        if torch.cuda.is_available():
            options.update(enable_sleep_mode=self.sleep)
        self.shared_group = accelerator.num_processes > 1
        if self.shared_group:  # each process its own engine, in the training job's process group
            options.update(distributed_executor_backend="external_launcher")
        start = time.perf_counter()
        with _engine_environment():
            self.llm = vllm.LLM(**options)
        log.info("vLLM engine (colocated) started in %.1f s from %s", time.perf_counter() - start, directory)
        if self.sleep:
            self.llm.sleep(level=1)

    def generate(self, prompt_ids, seeds, sampling: Sampling, images=None) -> Generated:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if images is not None:
            raise ConfigError("use_vllm: prompts with images are not supported yet; use the transformers backend")
        params = [_sampling_params(SamplingParams, sampling, seed) for seed in seeds]
        if self.sleep:
            self.llm.wake_up()
        try:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        finally:
            if self.sleep:
                self.llm.sleep(level=1)
        completions = [o.outputs[0] for o in outputs]
        token_ids = [list(c.token_ids) for c in completions]
        log_probs = [
            [step[token].logprob for step, token in zip(c.logprobs, ids)] for c, ids in zip(completions, token_ids)
        ]
        return Generated(token_ids, log_probs)

    def push_weights(self, model, accelerator=None) -> None:
        weights = list(engine_weights(model))  # collective under FSDP2/ZeRO-3: every process gathers, each its own
        if self.sleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        if self.sleep:
            self.llm.sleep(level=1)

    def close(self) -> None:
        # In the training job's process group (external launcher) vLLM's shutdown destroys that group, which the
        # final evaluation and save still need: the engine then goes with the process.
        if not self.shared_group:
            del self.llm


def _sampling_params(cls, sampling: Sampling, seed: int):
    return cls(n=1, seed=seed, temperature=sampling.temperature, top_p=sampling.top_p,
               max_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_token_ids), logprobs=0,
               detokenize=False, skip_special_tokens=False, ignore_eos=False)  # fmt: skip


class VLLMServer(GenerationBackend):
    """A `tunebook vllm-serve` (or `vllm serve` in dev mode) engine reached over HTTP."""

    name = "vllm (server)"

    def __init__(self, config, accelerator, weights_dir: Path, log):
        self.url = config.vllm_server_base_url or f"http://{config.vllm_server_host}:{config.vllm_server_port}"
        self.url = self.url.rstrip("/")
        self.timeout, self.log = config.vllm_server_timeout, log
        self.accelerator, self.weights_dir = accelerator, weights_dir
        self.model_name = self._wait_for_server()
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="vllm-client")

    def _request(self, path: str, body: dict | None = None, timeout: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
            text = response.read().decode()
        return json.loads(text) if text else None

    def _wait_for_server(self) -> str:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                models = self._request("/v1/models", timeout=5)
                return models["data"][0]["id"]
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
                if time.monotonic() > deadline:
                    raise TunebookError(
                        f"no vLLM server answered at {self.url} within vllm_server_timeout={self.timeout:g} s "
                        f"({error}); start one with: tunebook vllm-serve --model MODEL --port "
                        f"{self.url.rsplit(':', 1)[-1]}"
                    ) from None
                time.sleep(1.0)

    def _complete(self, prompt: list[int], seed: int, sampling: Sampling) -> tuple[list[int], list[float]]:
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed, "n": 1, "logprobs": 0,
                "stop_token_ids": list(sampling.stop_token_ids), "skip_special_tokens": False,
                "return_token_ids": True, "include_stop_str_in_output": True}  # fmt: skip
        try:
            choice = self._request("/v1/completions", body)["choices"][0]
        except urllib.error.HTTPError as error:
            raise TunebookError(
                f"the vLLM server at {self.url} refused a completion: {error.read()[:300]!r}"
            ) from None
        return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]

    def generate(self, prompt_ids, seeds, sampling: Sampling, images=None) -> Generated:
        if images is not None:
            raise ConfigError("use_vllm: prompts with images are not supported yet; use the transformers backend")
        results = list(self.pool.map(lambda args: self._complete(*args, sampling), zip(prompt_ids, seeds)))
        return Generated([r[0] for r in results], [r[1] for r in results])

    def push_weights(self, model, accelerator=None) -> None:
        """The main process writes the weights and has the server reload them; every process gathers (FSDP2,
        ZeRO-3) and waits, so none generates from the old weights once this returns."""
        accelerator = accelerator or self.accelerator
        accelerator.wait_for_everyone()  # every process's last generation has finished
        target = self.weights_dir if accelerator.is_main_process else None
        weights = engine_weights(model)
        if target is not None:
            from safetensors.torch import save_file

            scratch = target.with_name(target.name + ".writing")
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            save_file({n: t.cpu().contiguous().clone() for n, t in weights}, str(scratch / "model.safetensors"))
            shutil.rmtree(target, ignore_errors=True)
            scratch.rename(target)
            self._request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(target)}})
            self._request("/reset_prefix_cache", {})
        else:
            for _ in weights:  # the gathers are collective: take part, keep nothing
                pass
        accelerator.wait_for_everyone()

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def make_vllm_backend(config, model, accelerator, tokenizer, log) -> GenerationBackend:
    """The configured vLLM backend; its scratch files under the run's output directory (`vllm/`)."""
    if config.vllm_mode == "server":
        return VLLMServer(config, accelerator, Path(config.output_dir) / "vllm" / "weights", log)
    directory = Path(config.output_dir) / "vllm" / f"engine-{accelerator.process_index}"
    return VLLMColocated(config, model, tokenizer, accelerator, directory, log)
