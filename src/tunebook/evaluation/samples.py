"""Replies to prompts: a prompt rendered as a recipe renders its prompts, one reply generated (greedy or sampled,
streamed as it is made) and stopped by the one stop-token rule (`stop_token_ids`). `tunebook chat` talks through
it, and `sample_prompts` in a causal-LM recipe's config has the model answer the same prompts at every evaluation
(`prompt_sampler`), so a run shows what its model says, before training and as it trains.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from ..data.tokenize import render_chat
from ..models.wrappers import unwrap
from .generate import stop_token_ids

__all__ = ["generate_reply", "prompt_ids", "prompt_sampler", "sample_generations"]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, conversation: list[dict] | str, *, special_tokens: bool = True):
    """The token ids of a prompt: a conversation (messages) rendered with the chat template and its generation
    prompt (the assistant's turn to answer), or plain text, tokenised with the tokenizer's own special tokens
    (a BOS, say) unless `special_tokens` is False (the pretrain recipe trains on documents without them)."""
    if isinstance(conversation, str):
        return tokenizer(conversation, add_special_tokens=special_tokens)["input_ids"]
    text = render_chat(tokenizer, conversation, generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens


@torch.no_grad()
def generate_reply(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    streamer=None,
    synced_gpus: bool = False,
) -> str:
    """The model's reply to `input_ids`, decoded without special tokens: greedy with `temperature` 0, else sampled
    at that temperature; it ends at the model's end of turn (`stop_token_ids`) or after `max_new_tokens`.

    `streamer` (transformers' `TextStreamer` or `TextIteratorStreamer`) receives the tokens as they are made.
    `synced_gpus`: every process generates together (a sharded model, FSDP or ZeRO-3, needs every process in each
    forward; one that has finished keeps stepping until all have)."""
    device = next(model.parameters()).device
    inputs = torch.tensor([input_ids], dtype=torch.long, device=device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    out = model.generate(
        input_ids=inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_token_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        streamer=streamer,
        synced_gpus=synced_gpus,
        # The generation config's own sampling settings (a chat model's top_p, say) do not apply to greedy decoding.
        **({"top_p": None, "top_k": None, "temperature": None} if temperature <= 0 else {}),
        **sampling,
    )
    return tokenizer.decode(out[0, inputs.shape[1] :], skip_special_tokens=True)


def sample_generations(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    accelerator,
    *,
    max_new_tokens: int,
    chat: bool,
) -> list[dict[str, str]]:
    """Greedy replies to `prompts` as [{"prompt", "completion"}], each prompt a user turn (`chat`) or plain text.

    Every process generates every prompt, the same text from the same weights: a sharded model (FSDP, ZeRO-3) needs
    every process in each forward, and the prompts are few. Greedy decoding draws no random numbers and the model
    is in eval mode meanwhile (then in its former mode): training goes on exactly as without them."""
    inner = unwrap(model)
    was_training = inner.training
    inner.eval()
    try:
        samples = []
        for prompt in prompts:
            ids = prompt_ids(
                tokenizer, [{"role": "user", "content": prompt}] if chat else prompt, special_tokens=False
            )
            completion = generate_reply(inner, tokenizer, ids, max_new_tokens=max_new_tokens,
                                        synced_gpus=accelerator.num_processes > 1)  # fmt: skip
            samples.append({"prompt": prompt, "completion": completion})
        return samples
    finally:
        inner.train(was_training)


def prompt_sampler(
    config, model, tokenizer: PreTrainedTokenizerBase, accelerator, chat: bool = True
) -> Callable[[], list[dict[str, str]]] | None:
    """What generates the config's `sample_prompts` (greedy, `sample_max_new_tokens` each) at every evaluation
    (`tunebook.training.start_training`'s `samples`), or None when it has none. `chat`: each prompt is a user turn
    in the chat template (sft, dpo, grpo); else plain text, as pretraining reads it."""
    if not config.sample_prompts:
        return None

    def sample() -> list[dict[str, str]]:
        return sample_generations(model, tokenizer, config.sample_prompts, accelerator,
                                  max_new_tokens=config.sample_max_new_tokens, chat=chat)  # fmt: skip

    return sample
