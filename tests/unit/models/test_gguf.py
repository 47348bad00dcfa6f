"""tunebook.models.gguf: `pip:` model names, the cached GGUF conversion, the GGUF's context length. No real weights:
tiny GGUF files written by the gguf package, transformers' GGUF loading replaced by tiny models."""

from __future__ import annotations

import json

import pytest
from support import TINY_TEST_MODEL

from tunebook.models import gguf as gguf_module
from tunebook.models.gguf import convert_gguf, gguf_context_length, resolve_model_name

gguf = pytest.importorskip("gguf")


def write_gguf(path, context_length: int | None = 4096):
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    if context_length is not None:
        writer.add_context_length(context_length)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_context_length_comes_from_the_architecture_s_metadata(tmp_path):
    assert gguf_context_length(write_gguf(tmp_path / "a.gguf", 4096)) == 4096
    assert gguf_context_length(write_gguf(tmp_path / "b.gguf", None)) is None


def test_a_converted_tokenizer_is_limited_to_the_gguf_context_and_saved_without_loading_flags(
    tmp_path, monkeypatch, tiny_tokenizer
):
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    path = write_gguf(tmp_path / "tiny.gguf", 2048)
    tiny_tokenizer.model_max_length = int(1e30)  # what transformers gives a tokenizer read from a GGUF file
    tiny_tokenizer.init_kwargs.update(is_local=True, local_files_only=True)  # and what from_pretrained records
    values = dict(TINY_TEST_MODEL)
    config = AutoConfig.for_model(values.pop("model_type"), **values, vocab_size=len(tiny_tokenizer))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer)
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_pretrained", lambda *a, **k: AutoModelForCausalLM.from_config(config)
    )
    out = convert_gguf(path, tmp_path / "out")
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert saved["model_max_length"] == 2048
    assert "is_local" not in saved and "local_files_only" not in saved
    assert transformers.AutoTokenizer.from_pretrained.__name__ == "<lambda>"  # the real loader never ran


def test_a_pip_name_resolves_to_the_package_s_folder_or_to_one_cached_conversion(tmp_path, monkeypatch):
    folder = tmp_path / "site/pkg/model"
    folder.mkdir(parents=True)
    gguf_file = write_gguf(tmp_path / "site/pkg/Tiny.Q4_1.gguf")
    found = {"pip:with-folder": folder, "pip:with-gguf": gguf_file}
    monkeypatch.setattr(gguf_module, "package_model", found.__getitem__)
    monkeypatch.setenv("TUNEBOOK_CACHE", str(tmp_path / "cache"))
    conversions = []

    def fake_convert(source, out_dir):
        conversions.append(source)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(gguf_module, "convert_gguf", fake_convert)
    assert resolve_model_name("pip:with-folder") == str(folder)
    assert resolve_model_name("org/model") == "org/model" and resolve_model_name("./x") == "./x"
    first = resolve_model_name("pip:with-gguf")
    assert first == resolve_model_name("pip:with-gguf")  # converted once, then read from the cache
    assert conversions == [gguf_file]
    assert first.startswith(str(tmp_path / "cache" / "gguf" / "Tiny.Q4_1-")) and (tmp_path / first).is_dir()


def test_without_gguf_reading_one_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import sys

    from tunebook.errors import ModelError

    path = write_gguf(tmp_path / "a.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ModelError, match=r"needs the gguf package: pip install 'tunebook\[gguf\]'$"):
        gguf_context_length(path)
