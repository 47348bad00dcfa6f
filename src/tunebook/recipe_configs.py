"""The config dataclass of each recipe. Defaults are the recipe's embedded default run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from .config import TrainConfig, config_field, new_default
from .errors import ConfigError
from .locations import looks_like_local_data, looks_like_local_path
from .models.tiny import TINY_BERT, TINY_LLAMA
from .user_code import load_function

__all__ = [
    "ChatModelConfig",
    "ClassifyConfig",
    "DPOConfig",
    "GRPOConfig",
    "ModelDataConfig",
    "PretrainConfig",
    "RewardConfig",
    "SFTConfig",
]


def _streamed(spec) -> bool:
    """Whether a train_data/eval_data value streams any source (checked here without loading the data code)."""
    items = spec if isinstance(spec, list) else [spec]
    return any(isinstance(item, dict) and item.get("streaming") is True for item in items)


def _data_paths(spec) -> list[str]:
    """The paths a train_data/eval_data value names (read here without loading the data code)."""
    items = spec if isinstance(spec, list) else [] if spec is None else [spec]
    return [str(item["path"]) if isinstance(item, dict) else item for item in items
            if isinstance(item, str) or (isinstance(item, dict) and item.get("path") is not None)]  # fmt: skip


@dataclass
class ModelDataConfig(TrainConfig):
    """The model, tokenizer and data fields every recipe shares (fields only; each recipe adds its own)."""

    # --- model and tokenizer
    model_name_or_path: str | None = config_field("Local HF model directory or Hub name to fine-tune.", None)
    model_revision: str | None = config_field("Branch, tag or commit of a Hub model (and of its tokenizer).", None)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = config_field(
        "Weights' dtype in memory. auto: float32 for the weights that train (bf16/fp16 mixed precision comes from the "
        "accelerate config and computes in half precision over float32 master weights); with LoRA the frozen base "
        "as stored in the checkpoint. bfloat16/float16: all weights in that dtype, trained ones too (less memory, "
        "updates lose precision).",
        "auto",
    )
    use_safetensors: bool = config_field(
        "Load weights only from safetensors files; false also allows pickled .bin weights (which can run code).",
        True,
    )
    model_config: dict | str | None = config_field(
        "Build a fresh model from this config dict (or JSON/YAML file) instead of loading weights; unset with no "
        "model_name_or_path either: the recipe's tiny default model (the embedded offline run).",
        None,
    )
    tokenizer_name_or_path: str | None = config_field(
        "Tokenizer to load (default: the model's); with no model either, one is trained locally on train_data.",
        None,
    )
    trust_remote_code: bool = config_field(
        "Allow a model or tokenizer directory to run its own Python code (off: only standard architectures load).",
        False,
    )
    tokenizer_vocab_size: int = config_field("Vocabulary size of a locally trained tokenizer.", 512, bounds="[1, inf)")
    attn_implementation: str | None = config_field(
        "Attention kernel: sdpa, eager, flash_attention_2 (None: model default).", "sdpa"
    )
    # --- LoRA / QLoRA through peft (pip install 'tunebook[peft]')
    use_peft: bool = config_field(
        "Train LoRA adapters instead of all weights: the base stays frozen, checkpoints hold only the adapters and "
        "the output is a peft adapter directory.",
        False,
    )
    lora_r: int = config_field("Rank of the LoRA update matrices.", 16, bounds="[1, inf)")
    lora_alpha: float = config_field(
        "LoRA scale numerator: the update is scaled by lora_alpha / lora_r.", 32, bounds="(0, inf)"
    )
    lora_dropout: float = config_field("Dropout on the input of the LoRA update.", 0.05, bounds="[0, 1)")
    lora_target_modules: str | list[str] = config_field(
        "Modules that get adapters: all-linear (every linear layer except the output head), a module name, or a "
        "list of names (e.g. [q_proj, v_proj]).",
        "all-linear",
    )
    modules_to_save: list[str] | None = config_field(
        "Modules trained in full and saved with the adapters (e.g. [embed_tokens, lm_head] when the tokenizer has "
        "new tokens); a classifier's head is always trained.",
        None,
    )
    merge_adapter: bool = config_field(
        "Also write the adapters folded into the base weights, as a plain model directory in output_dir/merged.",
        False,
    )
    load_in_4bit: bool = config_field(
        "QLoRA: load the base model quantised to 4-bit NF4 through bitsandbytes (CUDA only; needs use_peft and "
        "model_name_or_path).",
        False,
    )
    # --- data
    train_data: str | dict | list | None = config_field(
        "A local file (json, jsonl, jsonl.gz, csv, tsv, parquet, arrow, txt) or folder, a Hub data set name, or a "
        "mapping {path, name, split, revision, data_files, data_dir, columns, weight | samples, streaming}, or a list of "
        "them (streaming: true reads it as training goes, uncached). "
        "A folder or Hub data set with several splits needs split. None: generate the recipe's synthetic task.",
        None,
    )
    eval_data: str | dict | list | None = config_field(
        "Evaluation data, same forms as train_data (e.g. {path: HuggingFaceH4/ultrachat_200k, split: test_sft}).", None
    )
    eval_split_ratio: float = config_field(
        "Hold out this fraction of train_data for evaluation when eval_data is unset (0: no split).",
        0.0,
        bounds="[0, 1)",
    )
    mixture_stopping_strategy: Literal["all_exhausted", "first_exhausted"] = config_field(
        "A mixture of streamed sources (streaming: true) ends its pass over the data when every source has run out "
        "(all_exhausted: the smaller ones start again meanwhile, keeping their weights) or the first one has "
        "(first_exhausted: nothing is read twice within a pass). The stream then starts its next pass.",
        "all_exhausted",
    )
    stream_shuffle: bool = config_field(
        "With streaming: true: shuffle the training rows within each group a reader makes at a time "
        "(packing_buffer_size examples for sft, 256 documents for pretrain), seeded by the group's position, so a "
        "resumed run sees the same order. Off: the order of the files.",
        True,
    )
    max_seq_length: int = config_field("Longest tokenised example in tokens.", 1024, bounds="[2, inf)")
    dataset_num_proc: int | None = config_field("Processes for tokenisation (None: one).", None, bounds="[1, inf)")
    pad_to_multiple_of: int | None = config_field(
        "Round padded batch lengths up to a multiple of this (tensor-core friendly).", 8, bounds="[1, inf)"
    )
    synthetic_train_size: int = config_field(
        "Training examples of the synthetic task (when train_data is None).", 8000, bounds="[1, inf)"
    )
    synthetic_eval_size: int = config_field(
        "Held-out examples of the synthetic task (when train_data is None).", 200, bounds="[1, inf)"
    )

    # The model a recipe builds when the config names none: the embedded default's (tunebook.models.tiny).
    tiny_model: ClassVar[dict] = TINY_LLAMA
    # Whether the recipe reads streamed training data (streaming: true on a source; tunebook.data.streaming).
    streams: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_config is None and self.model_name_or_path is None:
            self.model_config = dict(self.tiny_model)

    def validate(self) -> None:
        super().validate()
        if self.eval_split_ratio > 0 and self.eval_data is not None:
            raise ConfigError("set eval_data or eval_split_ratio, not both")
        if self.model_name_or_path and self.model_config:
            raise ConfigError("set model_name_or_path (load weights) or model_config (fresh model), not both")
        for key, what, marker in (
            ("model_name_or_path", "model", "config.json"),
            ("tokenizer_name_or_path", "tokenizer", "tokenizer_config.json"),
        ):
            value = getattr(self, key)
            if value and looks_like_local_path(value) and not Path(value).expanduser().exists():
                raise ConfigError(f"{what} path not found: {value} ({key})")
            if value and Path(value).expanduser().is_file():
                gguf = "; convert a .gguf file with `tunebook convert-gguf`" if value.endswith(".gguf") else ""
                raise ConfigError(f"{key} {value} is a file, not a {what} directory (a folder with {marker}) or a "
                                  f"Hub name{gguf}")  # fmt: skip
        for key in ("merge_adapter", "load_in_4bit"):
            if getattr(self, key) and not self.use_peft:
                raise ConfigError(f"{key}: true needs use_peft: true")
        if self.load_in_4bit and not self.model_name_or_path:
            raise ConfigError("load_in_4bit quantises pretrained weights: set model_name_or_path")
        if _streamed(self.eval_data):
            raise ConfigError(
                "eval_data: streaming: true is for train_data; evaluation data is read whole, and cached"
            )
        if _streamed(self.train_data):
            self.validate_streaming()

    def check_files(self) -> None:
        """Every local train_data/eval_data path (a list's entries and mappings' `path`s too) exists; Hub data set
        names ("name", "org/name") are not checked here."""
        super().check_files()
        for key in ("train_data", "eval_data"):
            for path in _data_paths(getattr(self, key)):
                if looks_like_local_data(path) and not Path(path).expanduser().exists():
                    raise ConfigError(f"{key}: data file or folder not found: {path}")

    def validate_streaming(self) -> None:
        """What a streamed train_data cannot honour: it has no length, so no epochs to count or split."""
        if not self.streams:
            raise ConfigError("train_data: streaming: true is read by the pretrain and sft recipes; remove it here")
        if self.max_steps < 0:
            raise ConfigError(f"max_steps={self.max_steps} with streaming: true: a stream's length is not known, so "
                              "num_train_epochs cannot be counted; set max_steps")  # fmt: skip
        if self.eval_split_ratio > 0:
            raise ConfigError("eval_split_ratio with streaming: true: a stream cannot hold out a fraction of rows "
                              "it has not read; give eval_data")  # fmt: skip
        for key in ("save_strategy", "eval_strategy"):
            if getattr(self, key) == "epoch":
                raise ConfigError(f"{key}: epoch with streaming: true: a stream's epochs are not known in steps; use "
                                  "steps")  # fmt: skip


@dataclass
class ChatModelConfig(ModelDataConfig):
    """Fields of the recipes that render conversations with a chat template (fields only)."""

    chat_template: str | None = config_field(
        "Chat template: Jinja text, a .jinja file, or a tokenizer directory (or Hub name) to take it from. Default: "
        "the tokenizer's own, or ChatML with <|im_start|>/<|im_end|> added as tokens. The token ending an assistant "
        "turn becomes eos_token, so the model learns to stop.",
        None,
    )


@dataclass
class SFTConfig(ChatModelConfig):
    """Supervised fine-tuning of a causal LM on instruction or chat data.

    The defaults are the embedded offline run: a synthetic digit task, a locally trained tokenizer and a tiny
    Llama built from config. Hyperparameters such as `learning_rate` are tuned for that tiny model; configs for
    real models set their own (see recipes/configs/sft/).
    """

    # --- data
    data_format: Literal["auto", "chat", "sharegpt", "alpaca", "prompt_completion", "text"] = config_field(
        "Data format; auto detects it from the columns (in this order): chat (messages), sharegpt (conversations), "
        "alpaca (instruction, output), prompt_completion (prompt, completion: strings or message lists), text "
        "(dataset_text_field; every token carries the loss).",
        "auto",
    )
    dataset_text_field: str = config_field("The plain-text column of text data (data_format text).", "text")
    overlong_examples: Literal["truncate", "drop"] = config_field(
        "Truncate or drop examples longer than max_seq_length.", "truncate"
    )
    assistant_only_loss: bool = config_field(
        "Compute the loss on assistant turns only; in a prompt/completion row, on its completion's only (the prompt "
        "is context, its assistant turns too: TRL's completion_only_loss).",
        True,
    )
    split_turns: bool = config_field(
        "One example per assistant turn: the conversation up to it, rendered as the chat template renders it when "
        "that turn is the last (as at generation). For templates that render earlier turns differently once later "
        "ones follow (Qwen3, GPT-OSS), which stop otherwise; costs about k times the tokens for k turns.",
        False,
    )
    packing: bool = config_field(
        "Pack examples into rows of max_seq_length (best-fit decreasing) with attention kept inside each example; "
        "removes nearly all padding.",
        False,
    )
    packing_buffer_size: int = config_field(
        "With streaming: true: examples read, tokenised and (with packing) packed best-fit together at a time. "
        "Larger packs fuller rows; a resumed run reads the current buffer again.",
        1000,
        bounds="[1, inf)",
    )
    group_by_length: bool = config_field(
        "Without packing: batch examples of similar length together, so a batch pads only to similar lengths. "
        "Off by default (as in TrainingArguments): it makes batches less random, and where length correlates "
        "with content it hurts; on the synthetic task it groups by task and the model stops learning.",
        False,
    )
    # --- evaluation
    generation_eval: bool = config_field("Score greedy generations against the reference answers (exact match).", True)
    generation_max_new_tokens: int = config_field("Tokens to generate per eval prompt.", 32, bounds="[1, inf)")
    generation_eval_max_samples: int = config_field(
        "Generate answers for at most this many eval examples (0: all): generation is slow, and an eval split of "
        "thousands would take longer than training.",
        64,
        bounds="[0, inf)",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/sft-default")
    learning_rate: float = new_default(3e-3)
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = new_default("cosine")
    warmup_ratio: float = new_default(0.05)
    per_device_train_batch_size: int = new_default(32)
    per_device_eval_batch_size: int = new_default(100)
    num_train_epochs: float = new_default(2.0)
    logging_steps: int = new_default(25)

    streams: ClassVar[bool] = True

    def validate(self) -> None:
        super().validate()
        if self.split_turns and not self.assistant_only_loss:
            raise ConfigError("split_turns: true with assistant_only_loss: false would train on a conversation's "
                              "earlier turns once for every later turn; set assistant_only_loss: true")  # fmt: skip

    def validate_streaming(self) -> None:
        super().validate_streaming()
        if self.group_by_length:
            raise ConfigError("group_by_length with streaming: true: a stream's lengths are not known ahead to group "
                              "by; pack instead (packing: true)")  # fmt: skip


@dataclass
class ClassifyConfig(ModelDataConfig):
    """Text or text-pair classification with `AutoModelForSequenceClassification`.

    The defaults are the embedded offline run: a generated 4-topic task, a locally trained WordPiece tokenizer and
    a tiny BERT built from config (tunebook.models.TINY_BERT).
    """

    tiny_model: ClassVar[dict] = TINY_BERT

    # --- data
    text_column: str = config_field("Column with the text to classify.", "text")
    text_pair_column: str | None = config_field("Column with the second text of a pair (None: single texts).", None)
    label_column: str = config_field("Column with the labels: class names (strings) or class ids (integers).", "label")
    label_names: list[str] | None = config_field(
        "The classes in id order (None: the sorted distinct string labels of train_data, or 0..K-1 for integers).",
        None,
    )
    # --- evaluation
    metrics: list[str] = config_field(
        "evaluate metrics computed on the eval set (Tunebook ships accuracy, f1, precision, recall offline).",
        default_factory=lambda: ["accuracy", "f1", "precision", "recall"],
    )
    metric_average: Literal["binary", "macro", "micro", "weighted"] | None = config_field(
        "Averaging of f1/precision/recall (None: binary for 2 classes, else macro).", None
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/classify-default")
    max_seq_length: int = new_default(128, "Longest tokenised example in tokens (longer ones are truncated).")
    learning_rate: float = new_default(2e-3)
    warmup_ratio: float = new_default(0.05)
    per_device_train_batch_size: int = new_default(32)
    per_device_eval_batch_size: int = new_default(64)
    num_train_epochs: float = new_default(2.0)
    synthetic_train_size: int = new_default(4000)
    synthetic_eval_size: int = new_default(400)

    def validate(self) -> None:
        super().validate()
        if self.label_names is not None and len(set(self.label_names)) != len(self.label_names):
            raise ConfigError(f"label_names has duplicates: {self.label_names}")
        if self.label_names is not None and len(self.label_names) < 2:
            raise ConfigError(f"label_names needs at least 2 classes, got {self.label_names}")


@dataclass
class PretrainConfig(ModelDataConfig):
    """Continued pretraining of a causal LM on plain text (next-token loss on every token).

    The defaults are the embedded offline run: generated topical documents, a locally trained tokenizer and a
    tiny Llama built from config (tunebook.models.TINY_LLAMA); evaluation reports loss and perplexity.
    """

    streams: ClassVar[bool] = True

    # --- data
    text_column: str = config_field("Column holding the documents (a .txt file gives a 'text' column).", "text")
    text_sample_by: Literal["document", "paragraph", "line"] = config_field(
        "What one document is in a .txt file: the whole file, each blank-line separated paragraph, or each line.",
        "paragraph",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/pretrain-default")
    max_seq_length: int = new_default(
        256, "Tokens per training row (documents are cut to fit and never attend across)."
    )
    learning_rate: float = new_default(3e-3)
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = new_default("cosine")
    warmup_ratio: float = new_default(0.05)
    per_device_train_batch_size: int = new_default(16)
    per_device_eval_batch_size: int = new_default(16)
    num_train_epochs: float = new_default(2.0)
    synthetic_train_size: int = new_default(2000, "Documents of the synthetic corpus (when train_data is None).")
    synthetic_eval_size: int = new_default(
        100, "Held-out documents of the synthetic corpus (when train_data is None)."
    )


@dataclass
class DPOConfig(ChatModelConfig):
    """Direct Preference Optimization of a causal LM on (prompt, chosen, rejected) pairs.

    The defaults are the embedded offline run: generated preference pairs over the SFT default's digit task (the
    correct answer chosen, a plausible wrong one rejected), a locally trained tokenizer and a tiny Llama that a
    brief SFT warm-up on the chosen answers first teaches the task format.
    """

    # --- data
    overlong_examples: Literal["truncate", "drop"] = config_field(
        "Pairs longer than max_seq_length: cut the responses to fit (the prompt is kept whole) or drop the pair.",
        "truncate",
    )
    # --- DPO
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"] = config_field(
        "The preference loss, TRL's formulas (but see label_smoothing, rpo_alpha and orpo): sigmoid (DPO), ipo, hinge "
        "(SLiC), robust (rDPO), or, with no reference model at all, simpo (SimPO, length-normalised, margin "
        "simpo_gamma) or orpo (odds ratio plus the chosen response's NLL: its token mean over the response, per pair; "
        "TRL's is one token mean over the batch's prompt and response tokens).",
        "sigmoid",
    )
    beta: float = config_field(
        "Strength of the KL penalty towards the reference model: the implicit reward is beta x the log-ratio of "
        "policy to reference (TRL's default 0.1; lower lets the policy move further). ipo: the regulariser tau, "
        "the target per-token log-ratio margin is 1/(2 beta). simpo: the reward scale, beta x mean per-token "
        "log-prob (the SimPO paper uses 2-2.5). orpo: the weight lambda of the odds-ratio term (paper 0.1).",
        0.1,
        bounds="(0, inf)",
    )
    label_smoothing: float = config_field(
        "Assumed probability that a preference label is flipped, sigmoid and robust only (conservative DPO, cDPO, "
        "and robust DPO); 0 is plain DPO. sigmoid's is cDPO as in TRL <= 0.19: TRL 1.16's sigmoid ignores it.",
        0.0,
        bounds="[0, 0.5)",
    )
    simpo_gamma: float = config_field(
        "simpo only: the target reward margin gamma, loss -log sigmoid(beta x (chosen - rejected mean log-prob) - "
        "gamma) (TRL's default 0.5).",
        0.5,
        bounds="[0, inf)",
    )
    rpo_alpha: float | None = config_field(
        "Add rpo_alpha x the chosen response's NLL per token to the loss (RPO; the paper uses 1.0): each response's "
        "token mean, then the mean over pairs (TRL's is one token mean over the batch's chosen tokens). Any "
        "loss_type but orpo, whose NLL term is built in. null: none.",
        None,
        bounds="[0, inf)",
    )
    precompute_ref_log_probs: bool = config_field(
        "Compute the reference model's log-probabilities of every pair once before training and cache them with "
        "the data (no reference forward, or second model, during training).",
        False,
    )
    sft_warmup_steps: int | None = config_field(
        "Optimizer steps of plain SFT on the chosen responses before DPO, for a model that has not learnt the task "
        "format; unset: 150 for a fresh model built from a config (the embedded default), 0 for a loaded one.",
        None,
        bounds="[0, inf)",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/dpo-default")
    max_seq_length: int = new_default(64, "Longest prompt + response in tokens.")
    learning_rate: float = new_default(2e-3)
    warmup_ratio: float = new_default(0.1)
    per_device_train_batch_size: int = new_default(32, "Pairs per micro-batch per process.")
    per_device_eval_batch_size: int = new_default(64, "Pairs per evaluation batch per process.")
    max_steps: int = new_default(100)
    logging_steps: int = new_default(10)
    synthetic_train_size: int = new_default(4000, "Preference pairs of the synthetic task (when train_data is None).")
    synthetic_eval_size: int = new_default(200, "Held-out pairs of the synthetic task (when train_data is None).")

    def validate(self) -> None:
        super().validate()
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust"):
            raise ConfigError(f"label_smoothing applies to loss_type sigmoid or robust only, not {self.loss_type}")
        if self.rpo_alpha is not None and self.loss_type == "orpo":
            raise ConfigError("rpo_alpha does not apply to loss_type orpo: its loss already holds the chosen NLL")
        if self.precompute_ref_log_probs and self.loss_type in ("simpo", "orpo"):
            raise ConfigError(f"precompute_ref_log_probs needs a reference model; loss_type {self.loss_type} has none")

    def __post_init__(self) -> None:
        fresh = self.model_name_or_path is None  # before the tiny model fills model_config in
        super().__post_init__()
        if self.sft_warmup_steps is None:
            self.sft_warmup_steps = 150 if fresh else 0


@dataclass
class RewardConfig(ChatModelConfig):
    """A reward model: `AutoModelForSequenceClassification` with one output, trained on (prompt, chosen, rejected)
    pairs with the Bradley-Terry loss (an optional `margin` column is subtracted from the reward difference).

    The defaults are the embedded offline run: the DPO default's digit-task pairs (the correct answer chosen, a
    plausible wrong one rejected), a locally trained tokenizer and a tiny Llama with a one-output head built from
    config; evaluation reports pairwise accuracy on held-out pairs.
    """

    # --- data
    overlong_examples: Literal["truncate", "drop"] = config_field(
        "Pairs longer than max_seq_length: cut the responses to fit (the prompt is kept whole) or drop the pair.",
        "truncate",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/reward-default")
    max_seq_length: int = new_default(64, "Longest prompt + response in tokens.")
    learning_rate: float = new_default(1e-3)
    warmup_ratio: float = new_default(0.1)
    per_device_train_batch_size: int = new_default(32, "Pairs per micro-batch per process.")
    per_device_eval_batch_size: int = new_default(64, "Pairs per evaluation batch per process.")
    max_steps: int = new_default(300)
    logging_steps: int = new_default(25)
    synthetic_train_size: int = new_default(8000, "Preference pairs of the synthetic task (when train_data is None).")
    synthetic_eval_size: int = new_default(200, "Held-out pairs of the synthetic task (when train_data is None).")


# GRPO's built-in reward functions (tunebook.rl.rewards), named here so a config is checked without torch.
BUILTIN_REWARDS = ("exact_match", "format_regex", "length_penalty")


@dataclass
class GRPOConfig(ChatModelConfig):
    """Group Relative Policy Optimization of a causal LM on prompts, with rewards from Python functions.

    The defaults are the embedded offline run: the SFT default's digit task as prompts with reference answers, a
    locally trained tokenizer and a tiny Llama that a short SFT warm-up first teaches the answer format, then GRPO
    with the exact-match reward; the held-out exact match of greedy answers is reported before and after.
    """

    # --- data
    max_prompt_length: int = config_field("Longest prompt in tokens (rendered with the chat template); longer "
                                          "prompts are dropped, with a warning.", 48, bounds="[1, inf)")  # fmt: skip
    reference_column: str = config_field(
        "Column of the prompt data with the reference answer: what `exact_match` compares against, what the "
        "evaluation's exact match uses, and what an SFT warm-up trains on.",
        "answer",
    )
    # --- generation
    num_generations: int = config_field(
        "Completions sampled per prompt (the group G of GRPO); advantages compare completions of one prompt.",
        8,
        bounds="[2, inf)",
    )
    max_new_tokens: int = config_field(
        "Longest completion in tokens, in training and evaluation (the default run's answers are short; reasoning "
        "tasks need hundreds).",
        12,
        bounds="[1, inf)",
    )
    temperature: float = config_field("Sampling temperature of the completions.", 1.0, bounds="(0, inf)")
    top_p: float = config_field(
        "Nucleus sampling: sample from the smallest set of tokens with this probability.", 1.0, bounds="(0, 1]"
    )
    # --- loss
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = config_field(
        "How token losses are averaged: grpo, each completion's token mean then the mean over completions; dapo, "
        "the mean over every completion token of the step (longer completions are not under-weighted); dr_grpo, "
        "the token sum over completions x max_new_tokens (a constant, no length bias).",
        "dapo",
    )
    scale_rewards: Literal["group", "batch", "none"] = config_field(
        "Divide each advantage (reward minus its group's mean) by the group's reward std, the generation batch's, "
        "or nothing (Dr. GRPO: the group std over-weights easy and hard prompts). With a reward model next to a "
        "0/1 reward use batch: where a group's 0/1 rewards are all equal, its own std makes the reward model's "
        "noise a full-size advantage. frac_reward_zero_std counts groups of equal rewards under each (TRL's, under "
        "batch, whether the whole batch's are).",
        "group",
    )
    epsilon: float = config_field(
        "Lower clipping range of the probability ratio: clip at 1 - epsilon.", 0.2, bounds="(0, inf)"
    )
    epsilon_high: float | None = config_field(
        "Upper clipping range: clip at 1 + epsilon_high (DAPO's clip-higher uses 0.28); unset: epsilon.",
        None,
        bounds="(0, inf)",
    )
    num_iterations: int = config_field(
        "Optimizer updates per generation batch (mu); with more than one, the ratio is against the log-probs the "
        "policy had when it sampled.",
        1,
        bounds="[1, inf)",
    )
    beta: float = config_field(
        "Weight of the KL penalty towards the reference model (the starting model; with LoRA the policy with its "
        "adapters off); 0 loads no reference.",
        0.0,
        bounds="[0, inf)",
    )
    # --- rewards
    reward_functions: list[str] = config_field(
        "Reward functions: built-in names (exact_match, format_regex, length_penalty) and your own as "
        "path/to/file.py:function, each called as f(prompts, completions, **columns) -> list of floats.",
        default_factory=lambda: ["exact_match"],
    )
    reward_weights: list[float] | None = config_field(
        "One weight per reward function (then reward_model), any number (a negative one penalises what that "
        "function rewards); unset: 1 each.",
        None,
        bounds="(-inf, inf)",
    )
    reward_model: str | None = config_field(
        "A reward model directory (from recipes/reward.py) used as one more reward function.", None
    )
    format_pattern: str | None = config_field(
        "Regular expression the whole (stripped) completion must match for the format_regex reward.", None
    )
    length_penalty_buffer: int = config_field(
        "length_penalty: completions longer than max_new_tokens minus this many tokens are penalised, linearly "
        "down to -1 at max_new_tokens.",
        16,
        bounds="[0, inf)",
    )
    sft_warmup_steps: int | None = config_field(
        "Optimizer steps of plain SFT on the prompts' reference answers before GRPO, for a model that has not "
        "learnt the answer format; unset: 200 for a fresh model built from a config (the embedded default), 0 "
        "for a loaded one.",
        None,
        bounds="[0, inf)",
    )
    sft_warmup_learning_rate: float = config_field(
        "Constant learning rate of the SFT warm-up. Not decayed: a warm-up annealed to 0 ends in a sharp minimum "
        "that GRPO's first updates knock it out of.",
        1e-3,
        bounds="(0, inf)",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/grpo-default")
    max_seq_length: int = new_default(64, "Longest prompt + answer of the SFT warm-up in tokens.")
    learning_rate: float = new_default(3e-4)
    warmup_ratio: float = new_default(0.15)
    per_device_train_batch_size: int = new_default(16, "Prompts per micro-batch per process.")
    per_device_eval_batch_size: int = new_default(64, "Prompts per evaluation batch per process.")
    max_steps: int = new_default(60)
    logging_steps: int = new_default(5)
    eval_steps: int = new_default(20)
    synthetic_train_size: int = new_default(8000, "Prompts of the synthetic task (when train_data is None).")
    synthetic_eval_size: int = new_default(200, "Held-out prompts of the synthetic task (when train_data is None).")

    def validate(self) -> None:
        super().validate()
        if not self.reward_functions and not self.reward_model:
            raise ConfigError("GRPO needs at least one reward: reward_functions or reward_model")
        for spec in self.reward_functions:
            if spec not in BUILTIN_REWARDS and ":" not in spec:
                raise ConfigError(
                    f"unknown reward function {spec!r}: use one of {', '.join(BUILTIN_REWARDS)}, or "
                    "path/to/file.py:function_name for your own"
                )
            if spec not in BUILTIN_REWARDS:  # a file that is missing or does not import stops here, before torch
                load_function(spec, "reward function")
        rewards = len(self.reward_functions) + bool(self.reward_model)
        if self.reward_weights is not None and len(self.reward_weights) != rewards:
            raise ConfigError(
                f"reward_weights has {len(self.reward_weights)} values for {rewards} rewards "
                "(reward_functions, then reward_model); give one weight each"
            )
        if self.reward_model and not (Path(self.reward_model).expanduser() / "config.json").is_file():
            raise ConfigError(
                f"reward_model {self.reward_model}: not a model directory (no config.json there); "
                "train one with recipes/reward.py"
            )

    def __post_init__(self) -> None:
        fresh = self.model_name_or_path is None  # before the tiny model fills model_config in
        super().__post_init__()
        if self.sft_warmup_steps is None:
            self.sft_warmup_steps = 200 if fresh else 0
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
