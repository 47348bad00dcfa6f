"""`unwrap` finds the model accelerate's `extract_model_from_parallel` finds, without importing DeepSpeed, and
accelerate's own (behind `get_state_dict` and `save_pretrained`) no longer imports it either."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed as dist
from accelerate.utils import extract_model_from_parallel

from tunebook.models.wrappers import unwrap


def test_unwrap_equals_accelerates_for_each_wrapper(tmp_path):
    model = torch.nn.Linear(4, 2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        for wrapped in (model, torch.nn.DataParallel(model), ddp, torch.compile(ddp), torch.compile(model)):
            accelerates = extract_model_from_parallel(wrapped, keep_torch_compile=False)
            assert unwrap(wrapped) is accelerates is model
    finally:
        dist.destroy_process_group()


def test_unwrap_does_not_import_deepspeed():
    code = (
        "import sys, torch; from tunebook.models.wrappers import unwrap; "
        "m = torch.nn.Linear(2, 2); assert unwrap(torch.nn.DataParallel(m)) is m; "
        "assert 'deepspeed' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_saving_the_final_model_does_not_import_deepspeed(tmp_path):
    """accelerate's `get_state_dict` and transformers' `save_pretrained` unwrap with `extract_model_from_parallel`,
    which imported DeepSpeed wherever it is installed (0.3 s of every run's end); once imported, its engine is
    still looked for."""
    code = f"""
import sys
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models
from accelerate.utils import is_deepspeed_available
import accelerate.utils.other as other
from tunebook.training.checkpoint import save_final_model
from tunebook.training.accelerator import build_accelerator

assert is_deepspeed_available()  # installed for the tests: the case that imported it
accelerator = build_accelerator(1)
model = accelerator.prepare(LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({{"a": 0, "<unk>": 1}}, "<unk>")))
save_final_model(accelerator, model, tokenizer, {str(tmp_path)!r})
assert "deepspeed" not in sys.modules, "imported by the final save"
import deepspeed
assert other.is_deepspeed_available()
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    assert (tmp_path / "model.safetensors").is_file()
