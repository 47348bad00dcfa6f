"""`tunebook chat MODEL_DIR`: talk to a model a run saved, in the terminal.

    tunebook chat outputs/sft-default                          # interactive: an empty line or /exit quits
    tunebook chat outputs/sft-default --prompt "Reverse the digits.\\n123"   # one reply, then exit
    tunebook chat outputs/run --system "Answer briefly." --temperature 0.7 --max_new_tokens 512

MODEL_DIR is what a causal-LM run (sft, pretrain, dpo, grpo) saved or `tunebook export` wrote: a model directory
(with `merge_adapter`, `output_dir/merged` too) or a LoRA adapter directory, loaded with its base model. Prompts
are rendered with the saved tokenizer's chat template (a tokenizer without one gets the plain text, each turn
continuing the text so far), replies are streamed as they are generated and end at the model's end of turn (the
one stop-token rule, `tunebook.evaluation.stop_token_ids`). The conversation is kept across turns; `/reset` clears
it. Greedy by default (`--temperature 0`).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer
from transformers.utils import logging as hf_logging

from ..errors import ConfigError, ModelError, first_line
from ..evaluation.samples import generate_reply, prompt_ids
from ..training.checkpoint import TRAINER_STATE, list_checkpoints
from ..training.manifest import MANIFEST
from .arguments import whole_number

__all__ = ["Chat", "Streamer", "chat", "check_model_dir", "load_chat_model"]


def chat(argv: list[str], read: Callable[[str], str] = input, out: TextIO | None = None) -> None:
    """The `tunebook chat` command: `--prompt` prints one reply and returns; otherwise a conversation read line by
    line with `read` (the terminal's `input`) until an empty line, `/exit` or the end of input."""
    args = _parser().parse_args(argv)
    out = out or sys.stdout
    model, tokenizer = load_chat_model(args.model_dir, trust_remote_code=args.trust_remote_code)
    session = Chat(model, tokenizer, system=args.system, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature)  # fmt: skip
    streamer = Streamer(tokenizer, out)
    if args.prompt is not None:
        session.reply(args.prompt, streamer)
        out.write("\n")
        return
    how = "chat template" if session.templated else "no chat template: plain text"
    out.write(f"Chatting with {args.model_dir} ({how}). An empty line or /exit quits, /reset clears the history.\n")
    while True:
        try:
            line = read(">>> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        if line.strip() in ("", "/exit"):
            return
        if line.strip() == "/reset":
            session.reset()
            out.write("(history cleared)\n")
            continue
        try:
            session.reply(line, streamer)
        except KeyboardInterrupt:  # Ctrl-C while it answers: stop there, and leave
            out.write("\n")
            return
        out.write("\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunebook chat", description="Talk to a model a Tunebook run saved.")
    parser.add_argument("model_dir", help="a model or LoRA adapter directory (a run's output_dir, or an export)")
    parser.add_argument("--prompt", help="answer this one prompt, print the reply and exit")
    parser.add_argument("--system", help="a system message at the start of the conversation")
    parser.add_argument("--max_new_tokens", type=whole_number(1), default=256, help="tokens per reply at most (256)")
    parser.add_argument("--temperature", type=_non_negative, default=0.0,
                        help="0 (the default): greedy; above 0: sample at this temperature")  # fmt: skip
    parser.add_argument("--trust_remote_code", action="store_true", help="allow the model's own Python code")
    return parser


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


class Chat:
    """A conversation with a model: the history of turns (or, without a chat template, the text so far), each new
    prompt answered with all of it as context. A conversation longer than the model's context drops its oldest
    turns (the system message stays)."""

    def __init__(self, model, tokenizer, *, system: str | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0):  # fmt: skip
        self.model, self.tokenizer = model, tokenizer
        self.system, self.max_new_tokens, self.temperature = system, max_new_tokens, temperature
        self.templated = bool(tokenizer.chat_template)
        self.history: list[dict[str, str]] = []  # user and assistant turns (with a chat template)
        self.text = ""  # the text so far (without one)

    def reset(self) -> None:
        self.history, self.text = [], ""

    def reply(self, prompt: str, streamer=None) -> str:
        """The model's answer to `prompt` (streamed to `streamer` as it is made), added to the history."""
        ids = self._prompt_ids(prompt)
        answer = generate_reply(self.model, self.tokenizer, ids, max_new_tokens=self.max_new_tokens,
                                temperature=self.temperature, streamer=streamer)  # fmt: skip
        if self.templated:
            self.history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        else:
            self.text += prompt + answer + "\n"
        return answer

    def _prompt_ids(self, prompt: str) -> list[int]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        limit = getattr(self.model.config, "max_position_embeddings", None) or float("inf")
        while True:
            if self.templated:
                ids = prompt_ids(self.tokenizer, system + self.history + [{"role": "user", "content": prompt}])
            else:
                ids = prompt_ids(self.tokenizer, (self.system + "\n" if self.system else "") + self.text + prompt)
            if len(ids) + self.max_new_tokens <= limit or not (self.history or self.text):
                return ids
            self.history = self.history[2:]  # the oldest exchange goes first
            self.text = self.text.split("\n", 1)[1] if "\n" in self.text else ""


def load_chat_model(model_dir: str | Path, trust_remote_code: bool = False):
    """(model, tokenizer) of a model directory or a LoRA adapter directory (with its base model), in eval mode on
    the GPU when there is one. Anything else is one line saying what the directory is and what to do instead."""
    path = Path(model_dir).expanduser()
    check_model_dir(path)
    tokenizer = _tokenizer(path, trust_remote_code)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar, in front of the conversation
    try:
        if (path / "adapter_config.json").is_file():
            model = _adapter_model(path, tokenizer, trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ModelError(f"{path}: the model does not load: {first_line(error)}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval(), tokenizer


def check_model_dir(path: Path) -> None:
    """One line when `path` is not a causal LM's model or adapter directory (`tunebook chat`, `tunebook evaluate`)."""
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory: give a model directory (a run's output_dir, or an export)")
    if (path / TRAINER_STATE).is_file() or (path / MANIFEST).is_file():
        raise ConfigError(f"{path} is a training checkpoint, not a model: tunebook export {path} OUT_DIR (--merge "
                          "for a LoRA run's merged model), then tunebook chat OUT_DIR")  # fmt: skip
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        if checkpoints := list_checkpoints(path):
            raise ConfigError(f"{path} holds checkpoints but no model (the run did not finish): tunebook export "
                              f"{checkpoints[-1]} OUT_DIR, then tunebook chat OUT_DIR")  # fmt: skip
        raise ConfigError(f"{path} is not a model directory (no config.json or adapter_config.json)")
    if (path / "config.json").is_file():
        heads = json.loads((path / "config.json").read_text()).get("architectures") or []
    else:
        heads = [json.loads((path / "adapter_config.json").read_text()).get("task_type") or ""]
    if any(h.endswith("ForSequenceClassification") or h == "SEQ_CLS" for h in heads):
        raise ConfigError(f"{path} is a sequence classifier (classify or reward): tunebook chat talks to a causal "
                          "language model (sft, pretrain, dpo, grpo)")  # fmt: skip


def _tokenizer(path: Path, trust_remote_code: bool):
    source = path
    if not (path / "tokenizer_config.json").is_file() and (path / "adapter_config.json").is_file():
        source = _base_path(path)  # an adapter saved without its tokenizer: its base model's
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ModelError(f"{path}: no tokenizer loads from {source}: {first_line(error)}") from None


def _base_path(adapter_dir: Path) -> str:
    """The adapter's base model: a Hub name, an absolute path, or a path relative to the adapter directory."""
    base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    if not base:
        raise ConfigError(f"{adapter_dir / 'adapter_config.json'} names no base model (base_model_name_or_path)")
    beside = adapter_dir / base
    return str(beside) if not Path(base).is_absolute() and beside.is_dir() else base


def _adapter_model(adapter_dir: Path, tokenizer, trust_remote_code: bool):
    """The base model with the adapters on it. The tokenizer may have tokens the base lacks (ChatML markers added
    for training): the embeddings grow to its size first, as peft's `AutoPeftModelForCausalLM` does."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ConfigError(f"{adapter_dir} is a LoRA adapter, which needs peft: pip install 'tunebook[peft]'") from None
    revision = json.loads((adapter_dir / "adapter_config.json").read_text()).get("revision")
    base = AutoModelForCausalLM.from_pretrained(_base_path(adapter_dir), revision=revision, dtype="auto",
                                                trust_remote_code=trust_remote_code)  # fmt: skip
    if len(tokenizer) > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(len(tokenizer))
    with warnings.catch_warnings():  # peft asks transformers a deprecated question on loading: not the user's concern
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return PeftModel.from_pretrained(base, adapter_dir)


class Streamer(TextStreamer):
    """transformers' `TextStreamer` writing to `out` (the terminal, or a test's buffer), without the prompt and the
    special tokens, each piece as soon as it is whole text."""

    def __init__(self, tokenizer, out: TextIO):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out = out

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text)
        self.out.flush()
