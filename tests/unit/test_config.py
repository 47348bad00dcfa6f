from __future__ import annotations

import pytest
import yaml

from tunebook.config import load_config, parse_config, save_config
from tunebook.errors import ConfigError
from tunebook.recipe_configs import SFTConfig


def test_defaults_are_the_embedded_run():
    config = parse_config(SFTConfig)
    assert config.train_data is None and config.model_name_or_path is None
    assert config.generation_eval is True


def test_file_then_overrides_in_both_syntaxes(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-4\nmax_steps: 7\nlogging_steps: 3\n")
    config = load_config(SFTConfig, ["--config", str(path), "--max_steps", "9", "--gradient_checkpointing=true"])
    assert config.learning_rate == pytest.approx(1e-4)  # YAML 1.1 reads 1e-4 as a string: coerced to float
    assert config.max_steps == 9 and config.logging_steps == 3
    assert config.gradient_checkpointing is True


def test_structured_values_from_the_command_line():
    config = load_config(
        SFTConfig, ["--train_data", "[{path: a.jsonl, weight: 2}, b.jsonl]", "--model_config", "{model_type: llama}"]
    )
    assert config.train_data == [{"path": "a.jsonl", "weight": 2}, "b.jsonl"]
    assert config.model_config == {"model_type": "llama"}
    assert load_config(SFTConfig, ["--eval_data", "null"]).eval_data is None


def test_exponent_numbers_inside_a_model_config_are_floats(tmp_path):
    """YAML 1.1 reads 1e-5 (and JSON's 1e-05) as strings; transformers' configs then reject rms_norm_eps."""
    json_text = '{"rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 1e+5}, "name": "x1e5", "layers": [2e0]}'
    config = load_config(SFTConfig, ["--model_config", json_text])
    assert config.model_config == {"rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 1e5}, "name": "x1e5",
                                   "layers": [2.0]}  # fmt: skip
    path = tmp_path / "c.yaml"
    path.write_text("model_config:\n  model_type: llama\n  rms_norm_eps: 1e-6\n")
    assert load_config(SFTConfig, ["--config", str(path)]).model_config["rms_norm_eps"] == 1e-6


def test_unknown_key_names_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'lerning_rate'.*did you mean 'learning_rate'"):
        load_config(SFTConfig, ["--lerning_rate", "1"])
    path = tmp_path / "c.yaml"
    path.write_text("# a comment\nlearning_rate: 1.0e-4\nper_device_batch_size: 4\n")
    with pytest.raises(
        ConfigError,
        match=rf"per_device_batch_size.*{path.name}, line 3\).*did you mean 'per_device_(train|eval)_batch_size'",
    ):
        load_config(SFTConfig, ["--config", str(path)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "ten"], r"max_steps.*expected an integer, got 'ten'"),
        (["--gradient_checkpointing", "maybe"], r"gradient_checkpointing.*expected true or false"),
        (["--lr_scheduler_type", "exponential"], r"lr_scheduler_type.*not one of"),
        (["--per_device_train_batch_size", "0"], r"per_device_train_batch_size must be >= 1"),
        (["--warmup_ratio", "1.5"], r"warmup_ratio must be in \[0, 1\)"),
        (["--eval_split_ratio", "0.1", "--eval_data", "x.jsonl"], r"eval_data or eval_split_ratio"),
        (["--max_steps"], r"--max_steps needs a value"),
        (["positional"], r"unexpected argument 'positional'"),
        (["--config", "/nonexistent/config.yaml"], r"config file not found: /nonexistent/config.yaml"),
        (["--load_best_model_at_end", "true"], r"load_best_model_at_end needs evaluations during training"),
        (["--early_stopping_patience", "-1"], r"early_stopping_patience must be >= 0"),
        (["--eval_strategy", "sometimes"], r"eval_strategy.*not one of"),
        (["--split_turns", "true", "--assistant_only_loss", "false"], r"split_turns: true with assistant_only_loss"),
    ],
)
def test_bad_values_are_rejected_with_key_and_value(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(SFTConfig, argv)


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("learning_rate: 1e-4\nmax_steps: [1, 2\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml, line \d+: not valid YAML"):
        load_config(SFTConfig, ["--config", str(path)])


def test_resolved_config_round_trips(tmp_path):
    config = load_config(SFTConfig, ["--max_steps", "5", "--train_data", "[a.jsonl, b.jsonl]"])
    save_config(config, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["max_steps"] == 5
    assert load_config(SFTConfig, ["--config", str(tmp_path / "config.yaml")]) == config


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit) as e:
        load_config(SFTConfig, ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--learning_rate" in out and "--train_data" in out and "Peak AdamW learning rate" in out


def test_classify_config_lists_and_label_names():
    from tunebook.recipe_configs import ClassifyConfig

    config = load_config(ClassifyConfig, ["--metrics", "[accuracy, f1]", "--label_names", "[neg, pos]"])
    assert config.metrics == ["accuracy", "f1"] and config.label_names == ["neg", "pos"]
    with pytest.raises(ConfigError, match="label_names has duplicates"):
        load_config(ClassifyConfig, ["--label_names", "[a, a]"])


def test_bare_and_negated_boolean_flags():
    config = load_config(SFTConfig, ["--packing", "--max_steps", "3", "--no_eval_on_start", "--use_peft"])
    assert config.packing and config.use_peft and not config.eval_on_start and config.max_steps == 3
    assert load_config(SFTConfig, ["--packing", "false"]).packing is False
    assert load_config(SFTConfig, ["--max_steps", "3", "--packing"]).packing is True
    with pytest.raises(ConfigError, match="--max_steps needs a value"):
        load_config(SFTConfig, ["--max_steps", "--packing"])


def test_trl_names_are_aliases_and_are_logged_once(tmp_path, caplog):
    import logging

    from tunebook.config import aliases_used
    from tunebook.logging import log_run_start

    config = load_config(SFTConfig, ["--max_length", "256", "--lora_modules_to_save", "[lm_head]"])
    assert config.max_seq_length == 256 and config.modules_to_save == ["lm_head"]
    assert aliases_used(config) == {"max_length": "max_seq_length", "lora_modules_to_save": "modules_to_save"}
    path = tmp_path / "c.yaml"
    path.write_text("torch_dtype: bfloat16\nevaluation_strategy: epoch\n")
    from_file = load_config(SFTConfig, ["--config", str(path)])
    assert from_file.dtype == "bfloat16" and from_file.eval_strategy == "epoch"
    with pytest.raises(ConfigError, match="'max_seq_length' is given twice"):
        load_config(SFTConfig, ["--max_length", "256", "--max_seq_length", "128"])

    class FakeAccelerator:
        num_processes, device, mixed_precision = 1, "cpu", "no"

        class distributed_type:
            value = "NO"

    with caplog.at_level(logging.INFO, logger="tunebook"):
        log_run_start(logging.getLogger("tunebook"), config, FakeAccelerator())
    notes = [r.getMessage() for r in caplog.records if "TRL's" in r.getMessage()]
    assert notes == [
        "Config key 'max_length' (TRL's / transformers' name) is read as 'max_seq_length'",
        "Config key 'lora_modules_to_save' (TRL's / transformers' name) is read as 'modules_to_save'",
    ]
