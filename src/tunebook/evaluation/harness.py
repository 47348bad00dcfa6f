"""Benchmark evaluation through lm-evaluation-harness, on the model in memory, on every process at once.

lm-eval does what it is for: loading the tasks, building their prompts (few-shot, the chat template), the metrics,
filters and aggregation. What it asks of a model is `lm_eval.api.model.LM`'s three requests (`loglikelihood`,
`loglikelihood_rolling`, `generate_until`); `TunebookLM` answers them with our model and tokenizer:

- on every process, so that a sharded model (FSDP2, ZeRO-3) runs: lm-eval sees one process (`rank` 0 of
  `world_size` 1) everywhere and hands each the same requests; we form batches from them, give batch i to process
  i mod N, run every process through the same number of forward passes (a process short of batches runs one again
  and drops it) and gather the answers back in order. A batch holds the same requests on any number of processes,
  so every answer, and every figure lm-eval makes of them, equals a single-process evaluation's exactly;
- with the model as it trains (the prepared model, under the run's mixed precision), never reloaded;
- leaving the process as it was: lm-eval is asked not to seed the global random generators, and their states
  (Python, numpy, torch) are put back afterwards anyway, so a run with the harness at its evaluations trains on
  exactly as one without; the model's train/eval mode is restored.

The prompts go through lm-eval's own tokenisation rules (`TemplateLM`: a context's trailing spaces move to its
continuation; an empty context is the BOS token, else EOS), and generation stops at the task's `until` strings and
at the model's end of turn (`stop_token_ids`). Where the figures can differ from lm-eval's `hf` model with its
defaults, and why: docs/evaluation.md.
"""

# lm-eval is imported after `import_lm_eval`, which keeps the environment as it was:
# ruff: noqa: E402
from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..config.harness import harness_tasks, import_lm_eval

import_lm_eval()  # first: lm-eval's own import would set an environment variable for the process

from lm_eval.api.model import TemplateLM
from lm_eval.defaults import DEFAULT_OTHER_SEED
from lm_eval.evaluator import evaluate
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from lm_eval.models.utils_hf import stop_sequences_criteria
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..data.collate import left_padded
from ..errors import ConfigError, DataError
from ..models.wrappers import unwrap
from ..progress import progress_bar
from ..training.loss import output_layer_at
from .generate import stop_token_ids

__all__ = ["TunebookLM", "harness_figures", "harness_summary", "run_harness"]

MAX_GEN_TOKS = 256  # lm-eval's default for a task that sets no max_gen_toks (HFLM.max_gen_toks)


class TunebookLM(TemplateLM):
    """lm-eval's model interface over a (prepared) causal LM and its tokenizer, on every process of `accelerator`
    (or of none: one process). `max_length`: the longest input (None: the model config's, as lm-eval reads it)."""

    def __init__(self, model: torch.nn.Module, tokenizer, accelerator=None, *, batch_size: int = 8,
                 max_length: int | None = None, disable_tqdm: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.model, self.tokenizer, self.accelerator = model, tokenizer, accelerator
        self.inner = unwrap(model)
        self.batch_size = batch_size
        self.max_length = max_length or resolve_max_length(self.inner.config, tokenizer)
        self.disable_tqdm = disable_tqdm
        self.processes = accelerator.num_processes if accelerator is not None else 1
        self.index = accelerator.process_index if accelerator is not None else 0
        self.pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
        self._device = next(self.inner.parameters()).device

    # --- what lm-eval reads of a model
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:  # as lm-eval's hf model: BOS, else EOS, before an empty context
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # As lm-eval's hf model: the tokenizer's own special tokens, except when the text (a rendered chat
        # template) already starts with the BOS token.
        if add_special_tokens is None:
            bos = self.tokenizer.bos_token
            add_special_tokens = not has_bos_prefix(string, bos)
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # --- the three requests
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # lm-eval's tokenising bar, shown as the run's progress bars are (disable_tqdm), on the main process only
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.disable_tqdm or self.index != 0)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether greedy decoding gives it) of each (key, context ids,
        continuation ids); the input cut from the left to `max_length`, as lm-eval's hf model does."""
        rows = [(context + continuation, len(continuation)) for _, context, continuation in requests]
        for (key, _, _), (_, n) in zip(requests, rows, strict=True):
            if not 0 < n <= self.max_length:
                raise DataError(f"lm-eval task: the continuation {key[1] if key else ''!r} is {n} tokens, which do not "
                                f"fit the model's max_length {self.max_length}")  # fmt: skip
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][0]), rows[i][0]))  # longest first, as lm-eval
        return self._spread([order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)],
                            lambda batch: self._loglikelihoods([rows[i] for i in batch]), len(rows),
                            "Harness log-likelihoods")  # fmt: skip

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-probability, in windows of `max_length` (lm-eval's own windows), summed per text."""
        windows, owner = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(text)
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1):
                windows.append((None, *make_disjoint_window(window)))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[index] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation with the task's generation settings (greedy unless it samples), ended at its
        `until` strings, the model's end of turn or `max_gen_toks` tokens; contexts cut from the left to leave room."""
        args = [request.args for request in requests]
        encoded = [self.tok_encode(context) for context, _ in args]
        groups: dict[str, list[int]] = {}  # one batch holds one set of generation settings
        for i, (_, settings) in enumerate(args):
            groups.setdefault(json.dumps(settings, sort_keys=True, default=str), []).append(i)
        batches = []
        for members in groups.values():
            members = sorted(members, key=lambda i: (-len(encoded[i]), encoded[i]))
            batches += [members[i : i + self.batch_size] for i in range(0, len(members), self.batch_size)]
        return self._spread(batches, lambda batch: self._generate([encoded[i] for i in batch], args[batch[0]][1]),
                            len(args), "Harness generation")  # fmt: skip

    # --- batches on every process, answers gathered in order
    def _spread(self, batches: list[list[int]], compute: Callable[[list[int]], list], count: int, desc: str) -> list:
        """`compute` of batch i on process i mod N, every process through the same number of batches (a short one
        repeats its first and drops the answers), the answers gathered and put back in the requests' order."""
        mine = batches[self.index :: self.processes]
        rounds = -(-len(batches) // self.processes)
        answers = []
        with self._evaluating():
            shown = progress_bar(self.index == 0, self.disable_tqdm, iterable=range(rounds), desc=desc, leave=False)
            for r in shown:
                batch = mine[r] if r < len(mine) else (mine or batches)[0]
                out = compute(batch)
                if r < len(mine):
                    answers += zip(batch, out, strict=True)
        if self.processes > 1:
            from accelerate.utils import gather_object

            answers = gather_object(answers)
        result = [None] * count
        for i, answer in answers:
            result[i] = answer
        return result

    @contextmanager
    def _evaluating(self):
        """Eval mode (the wrapper's too: DDP's, FSDP's) without gradients, then the former mode."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def _loglikelihoods(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """One forward pass over right-padded rows; logits only at the continuations' positions."""
        inputs = [tokens[-(self.max_length + 1) :][:-1] for tokens, _ in rows]
        width = max(map(len, inputs))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        positions, targets = [], []
        for r, (row, (tokens, n)) in enumerate(zip(inputs, rows, strict=True)):
            ids[r, : len(row)] = torch.tensor(row)
            mask[r, : len(row)] = 1
            positions += range(r * width + len(row) - n, r * width + len(row))  # where each continuation token is due
            targets += tokens[-n:]
        positions = torch.tensor(positions, device=self._device)
        targets = torch.tensor(targets, device=self._device)
        with output_layer_at(self.model, positions):
            logits = self.model(input_ids=ids.to(self._device), attention_mask=mask.to(self._device)).logits
        if logits.dim() == 3:  # no output layer module to cut at: pick the positions here
            logits = logits.reshape(-1, logits.shape[-1]).index_select(0, positions)
        logprobs = F.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1).double().cpu()
        greedy = (logprobs.argmax(dim=-1) == targets).cpu()
        answers, start = [], 0
        for _, n in rows:
            answers.append((float(chosen[start : start + n].sum()), bool(greedy[start : start + n].all())))
            start += n
        return answers

    def _generate(self, contexts: list[list[int]], settings: dict) -> list[str]:
        """One left-padded batch through `generate` (every process together: `synced_gpus` with several)."""
        kwargs = dict(normalize_gen_kwargs(settings, MAX_GEN_TOKS))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tokenizer.decode(self.eot_token_id))
        max_gen_toks = kwargs.pop("max_gen_toks")
        kwargs.pop("max_length", None)
        if self.max_length <= max_gen_toks:
            raise ConfigError(f"lm-eval task: max_gen_toks {max_gen_toks} leaves no room for a prompt in the model's "
                              f"max_length {self.max_length}")  # fmt: skip
        contexts = [c[-(self.max_length - max_gen_toks) :] for c in contexts]
        ids, mask = left_padded(contexts, self.pad_id)
        width = ids.shape[1]
        if not kwargs.get("do_sample"):  # greedy: the generation config's sampling settings do not apply
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = self.inner.generate(
            input_ids=ids.to(self._device),
            attention_mask=mask.to(self._device),
            max_new_tokens=max_gen_toks,
            stopping_criteria=stop_sequences_criteria(self.tokenizer, until, width, len(contexts)),
            eos_token_id=stop_token_ids(self.inner, self.tokenizer),
            pad_token_id=self.pad_id,
            synced_gpus=self.processes > 1,
            **kwargs,
        )
        texts = self.tokenizer.batch_decode(out[:, width:].tolist(), skip_special_tokens=True)
        return [postprocess_generated_text(text, until, None) for text in texts]


@contextmanager
def _random_states_kept():
    """Python's, numpy's and torch's (CPU and CUDA) global random states as they were, whatever ran inside."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def run_harness(model: torch.nn.Module, tokenizer, tasks: Sequence[str], accelerator=None, *, limit: int | None = None,
                num_fewshot: int | None = None, batch_size: int = 8, chat_template: bool | None = None,
                max_length: int | None = None, bootstrap_iters: int = 0, log_samples: bool = False,
                disable_tqdm: bool = True) -> dict[str, Any]:  # fmt: skip
    """lm-eval's evaluation of `tasks` (registry names, task YAMLs, directories of them) on `model`, run by every
    process of `accelerator` together; lm-eval's results dict, the same on every process. `chat_template` None: the
    tokenizer's chat template when it has one (few-shot examples as turns). `bootstrap_iters` 0: no standard errors
    (lm-eval's bootstrap forks a process pool; a mean's would be cheap, but lm-eval computes none of them with 0).

    lm-eval's `evaluate` runs the tasks as `simple_evaluate` prepares them (`_load_tasks`); `simple_evaluate` itself
    is not called: it would also seed the process's random generators and, at every call, collect the machine's
    environment (torch's collect_env: pip, nvidia-smi, ~2 s) and the git commit of the working directory."""
    resolved = harness_tasks(list(tasks), key="tasks")
    if chat_template is None:
        chat_template = bool(getattr(tokenizer, "chat_template", None))
    lm = TunebookLM(model, tokenizer, accelerator, batch_size=batch_size, max_length=max_length,
                    disable_tqdm=disable_tqdm)  # fmt: skip
    with _random_states_kept():
        results = evaluate(lm=lm, task_dict=_load_tasks(resolved, num_fewshot), limit=limit,
                           bootstrap_iters=bootstrap_iters, log_samples=log_samples,
                           apply_chat_template=chat_template, fewshot_as_multiturn=chat_template)  # fmt: skip
    results["tunebook"] = {"chat_template": chat_template, "max_length": lm.max_length, "batch_size": batch_size,
                           "processes": lm.processes}  # fmt: skip
    return results


def _load_tasks(resolved, num_fewshot: int | None) -> dict[str, Any]:
    """The tasks as lm-eval 0.4.13's `simple_evaluate` prepares them: `num_fewshot` replaces a task's own count
    unless the task fixes 0; a task with none gets 0; each few-shot sampler is seeded with lm-eval's default seed
    (its own generator, not the process's), so the few-shot examples are the ones `lm_eval` picks."""
    loaded = resolved.manager().load(list(resolved.specs))
    for task in loaded["tasks"].values():
        default = task.get_config("num_fewshot")
        if num_fewshot is not None and default != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    return loaded


def harness_figures(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's results as flat metrics.jsonl keys, `harness/<task>/<metric>` (a filter other than `none` joins
    the metric's name: `exact_match_strict-match`); standard errors and non-numbers left out."""
    figures = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, where = key.partition(",")
            if not where or "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = metric if where == "none" else f"{metric}_{where}"
            figures[f"harness/{task}/{name}"] = float(value)
    return figures


def harness_summary(results: dict[str, Any], step: int) -> dict[str, Any]:
    """What summary.json keeps of a harness run (`eval_harness`): each task's figures, documents and few-shot count,
    how the prompts were made, and lm-eval's version."""
    from lm_eval import __version__

    tasks: dict[str, dict[str, Any]] = {}
    for name, value in harness_figures(results).items():
        _, task, metric = name.split("/", 2)
        tasks.setdefault(task, {})[metric] = value
    samples = results.get("n-samples", {})
    shots = results.get("n-shot", {})
    return {
        "step": step,
        "tasks": tasks,
        "documents": {t: samples[t].get("effective") for t in tasks if t in samples},
        "num_fewshot": {t: shots[t] for t in tasks if t in shots},
        **results.get("tunebook", {}),
        "lm_eval_version": __version__,
    }
