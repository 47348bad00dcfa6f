"""tunebook.compat against the installed libraries: each private attribute it reads or sets is still there and means
what it did, so a release that moves one fails here, by name; and no other module touches private attributes."""

from __future__ import annotations

import atexit
import re
import subprocess
import sys
import threading

import pytest
import torch
from support import ROOT

from tunebook import compat


def _accelerator_with_everything():
    from accelerate import Accelerator

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    accelerator = Accelerator(cpu=True)
    return accelerator, accelerator.prepare(model, optimizer, scheduler)


def test_accelerate_prepared_objects_and_gradient_sync():
    accelerator, (model, optimizer, scheduler) = _accelerator_with_everything()
    assert compat.prepared_models(accelerator) == [model]
    assert compat.prepared_optimizers(accelerator) == [optimizer]
    assert compat.prepared_schedulers(accelerator) == [scheduler]
    for sync in (False, True):
        compat.set_sync_gradients(accelerator, sync)
        assert accelerator.sync_gradients is sync


def test_set_last_lr_is_what_get_last_lr_returns():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    compat.set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]


def test_dynamo_counters_code_reset_suppressed_errors_and_compiled_modules():
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def double(x):
        return x * 2

    start_ok, start_total = compat.compiled_frames()
    compiled = torch.compile(double, backend="eager")
    compiled(torch.ones(3))
    ok, total = compat.compiled_frames()
    assert ok == start_ok + 1 and total == start_total + 1
    assert len(_debug_get_cache_entry_list(double.__code__)) == 1
    compat.forget_compiled_code(double)
    assert _debug_get_cache_entry_list(double.__code__) == []

    setting = torch._dynamo.config.suppress_errors
    with compat.suppress_compile_errors():
        assert torch._dynamo.config.suppress_errors is True
    assert torch._dynamo.config.suppress_errors == setting

    module = torch.nn.Linear(2, 2)
    assert compat.inner_of_compiled(torch.compile(module)) is module
    assert compat.inner_of_compiled(module) is None

    size = torch.zeros(5)
    compat.mark_dynamic(size, 0)
    assert 0 in getattr(size, "_dynamo_weak_dynamic_indices", set())
    assert compat.dtensor_type() is torch.distributed.tensor.DTensor


def test_transformers_model_attributes(tiny_model_config):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**tiny_model_config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert compat.attn_implementation(model.config) == "eager"
    model.set_attn_implementation("sdpa")
    assert compat.attn_implementation(model.config) == "sdpa"
    assert compat.can_set_attn_implementation(model) is True
    assert compat.has_recurrent_cache(model) is False
    assert compat.no_split_modules(model) == ["LlamaDecoderLayer"]
    copy = compat.model_from_config(type(model), config, dtype=torch.bfloat16)
    assert type(copy) is type(model) and copy.dtype == torch.bfloat16


def test_datasets_indices_and_fingerprint():
    import datasets

    data = datasets.Dataset.from_dict({"x": [10, 11, 12, 13]})
    assert compat.indices_mapping(data) is None
    view = data.select([3, 1])
    assert compat.indices_mapping(view).column(0).to_pylist() == [3, 1]
    assert isinstance(compat.fingerprint(data), str) and compat.fingerprint(view) != compat.fingerprint(data)


def test_cpython_thread_shutdown_and_exit_handlers():
    assert callable(threading._shutdown)  # the hook shut_down_threads calls; its fallback would skip pools' hooks
    # In a process of its own: the shutdown also runs the thread pools' exit hooks (concurrent.futures refuses new
    # work from then on), which in the test process would fail every later model load that uses a pool.
    code = ("import threading\nfrom tunebook import compat\nworker = threading.Thread(target=lambda: None)\n"
            "worker.start()\ncompat.shut_down_threads()\nprint(worker.is_alive())\n")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout == "False\n", result.stderr

    count = compat.exit_callback_count()
    atexit.register(print, "never")
    assert compat.exit_callback_count() == count + 1
    atexit.unregister(print)
    # run_exit_handlers runs (and clears) every handler: pytest's own too, so in a process of its own.
    code = "import atexit\nfrom tunebook import compat\natexit.register(print, 'ran')\ncompat.run_exit_handlers()\n"
    result = subprocess.run([sys.executable, "-c", code + "print('after')"], capture_output=True, text=True)
    assert result.stdout == "ran\nafter\n", result.stderr


def test_fake_tensors_dispatch_modes_and_storage_keys():
    with compat.fake_tensor_mode():
        fake = torch.empty(1000, 1000)  # no data behind it
    assert fake.shape == (1000, 1000) and compat.is_fake(fake) and not compat.is_fake(torch.ones(1))
    seen = []

    class Seen(compat.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    real = torch.ones(4)
    with Seen():
        doubled = real * 2
    assert seen == ["aten.mul.Tensor"]
    # One key per storage: views share it, other tensors do not; fake and meta tensors too (data_ptr is 0 there).
    assert compat.storage_key(real) == compat.storage_key(real[1:]) != compat.storage_key(doubled)
    assert compat.storage_key(fake) == compat.storage_key(fake.view(-1)) != compat.storage_key(fake + 1)


def test_liger_instance_patch_is_importable():
    pytest.importorskip("liger_kernel")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # noqa: F401


# Underscore attributes that are Tunebook's own (its marks on a hook, a shell and an error, a config's, a lock's), and
# documented API: `os._exit`, a named tuple's `_replace`, IPython's `_render_traceback_` protocol.
ALLOWED = {"_tunebook", "_tunebook_errors", "_aliases_used", "_fd", "_exit", "_replace", "_shown_in_ipython",
           "_render_traceback_"}  # fmt: skip
PRIVATE = re.compile(r"(?<![\w.])([A-Za-z_][\w\]\)]*(?:\.[A-Za-z_]\w*)*)\.(_[a-z]\w*)")
PRIVATE_NAME = re.compile(r"(?:getattr|hasattr|setattr)\([^,]+,\s*[\"'](_[a-z]\w*)[\"']")


def _private_uses(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if code.lstrip().startswith(("from .", "import .")) or '"""' in code:
            continue
        names = [m.group(2) for m in PRIVATE.finditer(code) if m.group(1).split(".")[0] not in ("self", "cls")]
        names += PRIVATE_NAME.findall(code)
        found += [f"{number}: {name}" for name in names if name not in ALLOWED]
    return found


def test_no_private_access_outside_compat():
    files = sorted((ROOT / "src" / "tunebook").rglob("*.py")) + sorted((ROOT / "recipes").glob("*.py"))
    files = [f for f in files if f.name != "compat.py" and f.parent != ROOT / "src" / "tunebook" / "recipes"]
    uses = {str(f.relative_to(ROOT)): _private_uses(f.read_text()) for f in files}
    assert {name: found for name, found in uses.items() if found} == {}


def test_the_private_access_check_finds_them():
    assert _private_uses("x = accelerator._models[0]\n") == ["1: _models"]
    assert _private_uses('y = getattr(model, "_is_stateful", False)\n') == ["1: _is_stateful"]
    assert _private_uses("self._start = 1\nfrom ._x import y\nz = a.__name__\n") == []


def test_image_token_counts_of_a_processor():
    from tunebook.config.tiny import TINY_LLAVA, TINY_QWEN2_VL
    from tunebook.models.tokenizer import train_chat_tokenizer
    from tunebook.models.vision import tiny_processor

    tokenizer = train_chat_tokenizer(["what colour is the square? red"] * 10, vocab_size=300)
    # LLaVA: the tower's fixed 2 x 2 patches whatever the size; Qwen2-VL: one per 28 x 28 pixels as resized.
    assert compat.image_token_counts(tiny_processor(TINY_LLAVA, tokenizer), [(56, 56), (30, 200)]) == [4, 4]
    assert compat.image_token_counts(tiny_processor(TINY_QWEN2_VL, tokenizer), [(56, 56), (28, 56)]) == [4, 2]


def test_lm_eval_task_entry_of_a_yaml(tmp_path):
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip('lm-evaluation-harness is not installed: pip install "tunebook[eval]"')
    (tmp_path / "task.yaml").write_text("task: my_task\ndataset_path: json\n")
    (tmp_path / "group.yaml").write_text("group: my_group\ntask: [my_task]\n")
    (tmp_path / "none.yaml").write_text("dataset_path: json\n")
    assert compat.lm_eval_task_entry(tmp_path / "task.yaml").name == "my_task"
    assert compat.lm_eval_task_entry(tmp_path / "group.yaml").kind.name == "GROUP"
    assert compat.lm_eval_task_entry(tmp_path / "missing.yaml") is None
    with pytest.raises(ValueError, match="Unknown config shape"):
        compat.lm_eval_task_entry(tmp_path / "none.yaml")
