from __future__ import annotations

import pytest
import yaml

from tunebook.config import SFTConfig, load_config, parse_config, save_config
from tunebook.errors import ConfigError


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


def test_structured_values_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # load_config checks that local data files exist
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"text": "x"}\n')
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
        (["--per_device_train_batch_size", "0"], r"'per_device_train_batch_size' must be >= 1, got 0 \(in command"),
        (["--warmup_ratio", "1.5"], r"config key .warmup_ratio. must be in \[0, 1\), got 1.5"),
        (["--eval_split_ratio", "0.1", "--eval_data", "x.jsonl"], r"eval_data or eval_split_ratio"),
        (["--max_steps"], r"--max_steps needs a value"),
        (["positional"], r"unexpected argument 'positional'"),
        (["--config", "/nonexistent/config.yaml"], r"config file not found: /nonexistent/config.yaml"),
        (["--load_best_model_at_end", "true"], r"load_best_model_at_end needs evaluations during training"),
        (["--early_stopping_patience", "-1"], r"config key .early_stopping_patience. must be >= 0, got -1"),
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


def test_resolved_config_round_trips(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"text": "x"}\n')
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
    from tunebook.config import ClassifyConfig

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
    from tunebook.run.logging import log_run_start

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


# --------------------------------------------------------------------------------------------------------------
# Bounds of numeric keys (issue 42, point 4): declared with each field, checked in the config check


def test_every_numeric_key_of_every_recipe_declares_its_bounds():
    """A new numeric key cannot forget its bounds: every int, float, optional and list of them has them."""
    import dataclasses

    from tunebook.config import TrainConfig, numeric_keys
    from tunebook.recipe import RECIPES, recipe_config_class

    for name in RECIPES:
        cls = recipe_config_class(name)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        keys = numeric_keys(cls)
        assert {"learning_rate", "adam_beta1", "max_steps", "seed", "max_seq_length"} <= set(keys), name
        unbounded = [key for key in keys if fields[key].metadata.get("bounds") is None]
        assert not unbounded, f"{name}: numeric keys without bounds: {unbounded}"
        misplaced = [k for k, f in fields.items() if "bounds" in f.metadata and k not in keys]
        assert not misplaced, f"{name}: bounds on keys that hold no number: {misplaced}"
        # A recipe's own default (new_default) keeps the base's bounds.
        base = {f.name: f for f in dataclasses.fields(TrainConfig)}
        for key in ("learning_rate", "warmup_ratio", "per_device_train_batch_size", "max_steps"):
            assert fields[key].metadata["bounds"] == base[key].metadata["bounds"], (name, key)
        parse_config(cls).validate()  # every default lies within its bounds
    assert "reward_weights" in numeric_keys(recipe_config_class("grpo"))  # list[float] | None counts


@pytest.mark.parametrize(
    "argv, message",
    [
        # The four: each reached torch (AdamW, steps.py) after data preparation, the last blamed on the LR.
        (["--learning_rate", "nan"], "config key 'learning_rate' must be a finite number >= 0, got nan (in command line)"),
        (["--adam_beta1", "2.0"], "config key 'adam_beta1' must be in [0, 1), got 2.0 (in command line)"),
        (["--num_train_epochs", "nan"], "config key 'num_train_epochs' must be a finite number >= 0, got nan (in command line)"),
        (["--max_grad_norm", "nan"], "config key 'max_grad_norm' must be a finite number >= 0, got nan (in command line)"),
        (["--max_grad_norm", "inf"], "config key 'max_grad_norm' must be a finite number >= 0, got inf (in command line)"),
        (["--adam_beta2", "1"], "config key 'adam_beta2' must be in [0, 1), got 1.0 (in command line)"),
        (["--seed", "-1"], "config key 'seed' must be in [0, 4294967295], got -1 (in command line)"),
        (["--max_steps", "-2"], "config key 'max_steps' must be >= -1, got -2 (in command line)"),
        (["--pad_to_multiple_of", "0"], "config key 'pad_to_multiple_of' must be >= 1, got 0 (in command line)"),
        (["--lora_dropout", "-inf"], "config key 'lora_dropout' must be a finite number in [0, 1), got -inf (in command line)"),
    ],
)  # fmt: skip
def test_out_of_bounds_and_non_finite_values_are_one_line(argv, message):
    with pytest.raises(ConfigError) as error:
        load_config(SFTConfig, argv)
    assert str(error.value) == message


def test_bounds_errors_name_the_file_and_line_and_list_items(tmp_path):
    from tunebook.config import GRPOConfig

    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-4\nadam_beta1: 2.0\n")
    with pytest.raises(ConfigError) as error:
        load_config(SFTConfig, ["--config", str(path)])
    assert str(error.value) == f"config key 'adam_beta1' must be in [0, 1), got 2.0 (in {path}, line 2)"
    path.write_text("learning_rate: .nan\n")  # YAML's own NaN
    with pytest.raises(ConfigError, match=r"'learning_rate' must be a finite number >= 0, got nan \(in .*line 1\)"):
        load_config(SFTConfig, ["--config", str(path)])
    with pytest.raises(ConfigError) as error:
        load_config(GRPOConfig, ["--reward_functions", "[exact_match, format_regex]", "--reward_weights", "[1, .nan]"])
    assert (
        str(error.value) == "config key 'reward_weights' must be a finite number, got nan (item 2) (in command line)"
    )
    assert load_config(GRPOConfig, ["--reward_weights", "[-0.5]"]).reward_weights == [-0.5]  # any finite weight
    with pytest.raises(ConfigError, match=r"'temperature' must be > 0, got 0.0 \(in config\(...\) arguments\)"):
        parse_config(GRPOConfig, overrides={"temperature": 0}, overrides_from="config(...) arguments")
    with pytest.raises(ConfigError, match=r"^config key 'top_p' must be in \(0, 1\], got 1.5$"):
        GRPOConfig(top_p=1.5).validate()  # built directly, not parsed: validate checks the bounds too


@pytest.mark.parametrize(
    "args, message",
    [
        (["--learning_rate", "nan"], "config key 'learning_rate' must be a finite number >= 0, got nan (in command line)"),
        (["--adam_beta1", "2.0"], "config key 'adam_beta1' must be in [0, 1), got 2.0 (in command line)"),
        (["--num_train_epochs", "nan"], "config key 'num_train_epochs' must be a finite number >= 0, got nan (in command line)"),
        (["--max_grad_norm", "nan"], "config key 'max_grad_norm' must be a finite number >= 0, got nan (in command line)"),
        (["--train_data", "[missing/train.jsonl]"], "train_data: data file or folder not found: missing/train.jsonl"),
    ],
)  # fmt: skip
def test_tunebook_train_stops_at_the_config_check_before_torch(args, message, tmp_path):
    """`tunebook train` finds these in its config check: one line, and torch never imported."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom tunebook.cli import main\ntry:\n    main(sys.argv[1:])\n"
        "except BaseException as error:\n    sys.excepthook(type(error), error, None)\n"
        "print('imported torch' if 'torch' in sys.modules else 'no torch')"
    )
    result = subprocess.run([sys.executable, "-c", code, "train", "sft", *args], capture_output=True, text=True,
                            cwd=tmp_path, timeout=60)  # fmt: skip
    assert result.stderr == f"tunebook: error: {message}\n"
    assert result.stdout.strip() == "no torch"


def test_missing_local_data_files_are_found_by_the_config_check(tmp_path, monkeypatch):
    """Every local path of train_data/eval_data, in lists and mappings too; Hub names are left to the data code."""
    from tunebook.config import DPOConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "folder").mkdir()
    cases = {
        "missing/train.jsonl": "train_data: data file or folder not found: missing/train.jsonl",
        "[here.jsonl, {path: gone.csv, weight: 2}]": "train_data: data file or folder not found: gone.csv",
        "{path: ./gone, split: train}": "train_data: data file or folder not found: ./gone",
        "[HuggingFaceH4/ultrachat_200k, data/a/b]": "train_data: data file or folder not found: data/a/b",
    }
    for value, message in cases.items():
        with pytest.raises(ConfigError) as error:
            load_config(SFTConfig, ["--train_data", value])
        assert str(error.value) == message
    with pytest.raises(ConfigError, match="^eval_data: data file or folder not found: ~/no/such/eval.parquet$"):
        load_config(DPOConfig, ["--eval_data", "{path: ~/no/such/eval.parquet}"])
    ok = "[here.jsonl, {path: folder, split: train}, HuggingFaceH4/ultrachat_200k, {path: trl-lib/tldr}]"
    assert load_config(SFTConfig, ["--train_data", ok]).train_data[0] == "here.jsonl"
    # A config read for another purpose (a finished run's config.yaml, by `tunebook export`) is not checked.
    assert parse_config(SFTConfig, overrides={"train_data": "gone.jsonl"}).train_data == "gone.jsonl"


def test_a_model_path_that_is_a_file_is_called_a_file(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError) as error:
        load_config(SFTConfig, ["--model_name_or_path", str(data)])
    assert str(error.value) == (
        f"model_name_or_path {data} is a file, not a model directory (a folder with config.json) or a Hub name"
    )
    with pytest.raises(ConfigError, match="tokenizer_name_or_path .* is a file, not a tokenizer directory"):
        load_config(SFTConfig, ["--tokenizer_name_or_path", str(data)])
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="is a file, not a model directory .*tunebook convert-gguf"):
        load_config(SFTConfig, ["--model_name_or_path", str(gguf)])


def test_a_pip_model_name_is_checked_with_the_config():
    # before torch loads: the package is looked up in the installed distributions' file lists
    with pytest.raises(ConfigError, match=r"^pip:not-installed-anywhere: no pip package .*--no-deps"):
        load_config(SFTConfig, ["--model_name_or_path", "pip:not-installed-anywhere"])
    with pytest.raises(ConfigError, match=r"^pip:pytest: the package pytest holds no .gguf file"):
        load_config(SFTConfig, ["--tokenizer_name_or_path", "pip:pytest"])


# --------------------------------------------------------------------------------------------------------------
# Validation as flat tuples of plain check functions (issue 43, point 3)


def test_config_classes_validate_without_super_chains():
    """Each config class's `validate` (and `__post_init__`, `check_files`) runs plain functions of
    `tunebook.config.checks` in one flat tuple: no `super()` call through the class levels, so a class's checks and
    their order read in one place. Only `__init_subclass__` (the dataclass-field hook of `new_default`) may call it."""
    import ast
    from pathlib import Path

    import tunebook.config

    folder = Path(tunebook.config.__file__).parent
    calls = []
    for path in sorted(folder.glob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef) or function.name == "__init_subclass__":
                continue
            calls += [
                f"{path.name}:{node.lineno} in {function.name}"
                for node in ast.walk(function)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
            ]
    assert len(list(folder.glob("*.py"))) >= 5  # the package's modules were found
    assert not calls, f"super() calls in tunebook.config: {calls}"


@pytest.mark.parametrize(
    "cls_name, values, message",
    [
        # A value out of bounds is named before any rule that ties keys together.
        ("SFTConfig", {"adam_beta1": 2.0, "push_to_hub": True}, "config key 'adam_beta1' must be in [0, 1)"),
        # The rules every recipe shares, then those of recipes with a model and data, then the recipe's own.
        ("GRPOConfig", {"hub_model_id": "a/b/c", "reward_functions": []}, "hub_model_id must be 'name' or"),
        ("DPOConfig", {"merge_adapter": True, "loss_type": "orpo", "rpo_alpha": 1.0}, "merge_adapter: true needs"),
        # A streamed train_data's checks (sft's group_by_length among them) before sft's split_turns.
        ("SFTConfig", {"train_data": {"path": "x.jsonl", "streaming": True}, "max_steps": 5, "group_by_length": True,
                       "split_turns": True, "assistant_only_loss": False}, "group_by_length with streaming: true"),
        ("ClassifyConfig", {"eval_split_ratio": 0.1, "eval_data": "x.jsonl", "label_names": ["a"]}, "set eval_data or"),
    ],
)  # fmt: skip
def test_a_config_with_two_faults_reports_the_first_check(cls_name, values, message):
    import tunebook.config

    with pytest.raises(ConfigError) as error:
        getattr(tunebook.config, cls_name)(**values).validate()
    assert str(error.value).startswith(message)


def test_sample_prompts_in_the_causal_lm_configs_only(tmp_path):
    from tunebook.config import ClassifyConfig, DPOConfig, GRPOConfig, PretrainConfig, RewardConfig

    config = load_config(SFTConfig, ["--sample_prompts", '["12345", "Sort the digits.\\n312"]'])
    assert config.sample_prompts == ["12345", "Sort the digits.\n312"] and config.sample_max_new_tokens == 64
    for cls in (PretrainConfig, DPOConfig, GRPOConfig):
        assert parse_config(cls, overrides={"sample_prompts": '["hi"]'}).sample_prompts == ["hi"]
    assert SFTConfig().sample_prompts == [] and SFTConfig().sample_prompts is not SFTConfig().sample_prompts
    for cls in (ClassifyConfig, RewardConfig):  # no generations from a classifier
        with pytest.raises(ConfigError, match="unknown config key 'sample_prompts'"):
            parse_config(cls, overrides={"sample_prompts": '["hi"]'})
    with pytest.raises(ConfigError, match=r"sample_prompts: item 2 must be a non-empty string, got 12345 \(quote"):
        load_config(SFTConfig, ["--sample_prompts", "[hi, 12345]"])
    with pytest.raises(ConfigError, match="sample_max_new_tokens' must be in"):
        load_config(SFTConfig, ["--sample_max_new_tokens", "0"])
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    with pytest.raises(ConfigError, match="this run has no eval data: set eval_data or eval_split_ratio"):
        load_config(SFTConfig, ["--train_data", str(data), "--sample_prompts", "[hi]"])
    assert load_config(SFTConfig, ["--train_data", str(data), "--eval_split_ratio", "0.1",
                                   "--sample_prompts", "[hi]"]).sample_prompts == ["hi"]  # fmt: skip
