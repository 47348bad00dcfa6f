"""The config classes every recipe's config builds on: `TrainConfig` (outputs, optimisation, batching, speed,
logging, evaluation, checkpoints, processes) and `ModelDataConfig` / `ChatModelConfig` (model, tokenizer, LoRA, data).

`CausalLMConfig` holds the fields of the recipes that train a causal LM (sft, pretrain, dpo, grpo), listed beside
their other base class.

They share fields, not behaviour: each class's `validate` runs a flat tuple of the plain functions in
`tunebook.config.checks`, and calls no base class's `validate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from .checks import MODEL_DATA_CHECKS, TRAINING_CHECKS, check_data_files
from .fields import config_field, inherit_new_defaults
from .tiny import TINY_LLAMA

__all__ = ["CausalLMConfig", "ChatModelConfig", "ModelDataConfig", "TrainConfig", "fill_cache_dir", "fill_tiny_model"]


def fill_cache_dir(config) -> None:
    """cache_dir's computed default, resolved when the config is built so config.yaml and `--help` show the value a
    run uses."""
    if config.cache_dir is None:
        from ..locations import default_cache_dir

        config.cache_dir = str(default_cache_dir())


def fill_tiny_model(config) -> None:
    """A config that names no model builds the recipe's tiny default (`tiny_model`): the embedded offline run."""
    if config.model_config is None and config.model_name_or_path is None:
        config.model_config = dict(config.tiny_model)


@dataclass
class TrainConfig:
    """Fields every recipe shares. Names follow transformers' `TrainingArguments` where the concept is the same."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        inherit_new_defaults(cls)  # before @dataclass turns the class body into fields

    # --- outputs
    output_dir: str = config_field(
        "Where the model, checkpoints, metrics.jsonl and summary.json go.",
        "outputs/run",
        section="outputs",
        common=True,
    )
    cache_dir: str | None = config_field(
        "Cache for tokenised data and generated assets (unset: $TUNEBOOK_CACHE or ~/.cache/tunebook).",
        None,
        section="outputs",
    )
    push_to_hub: bool = config_field(
        "At the end, upload the final model directory (model, tokenizer, model card, config.yaml, summary.json, "
        "metrics.jsonl, report.png; never checkpoints or tracker files) to the Hub as hub_model_id. Needs network "
        "and a token with write access (HF_TOKEN or `hf auth login`), both checked at start-up.",
        False,
        section="hub",
        common=True,
    )
    hub_model_id: str | None = config_field(
        "The Hub repository to push to, 'name' or 'org/name' (with push_to_hub).", None, section="hub", common=True
    )
    hub_private_repo: bool | None = config_field(
        "Create the repository private (None: the Hub's default for the account); an existing one is left as is.",
        None,
        section="hub",
    )
    # --- optimisation
    learning_rate: float = config_field(
        "Peak AdamW learning rate.", 5e-5, bounds="[0, inf)", section="training", common=True
    )
    weight_decay: float = config_field(
        "AdamW weight decay (not applied to biases and norm weights).", 0.0, bounds="[0, inf)", section="training"
    )
    adam_beta1: float = config_field("AdamW beta1.", 0.9, bounds="[0, 1)", section="training")
    adam_beta2: float = config_field("AdamW beta2.", 0.999, bounds="[0, 1)", section="training")
    adam_epsilon: float = config_field("AdamW epsilon.", 1e-8, bounds="[0, inf)", section="training")
    max_grad_norm: float = config_field(
        "Clip the global gradient norm to this (0 disables clipping).", 1.0, bounds="[0, inf)", section="training"
    )
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = config_field(
        "Learning-rate schedule after warmup.", "linear", section="training", common=True
    )
    warmup_ratio: float = config_field(
        "Fraction of the optimizer steps spent warming up linearly from 0.",
        0.0,
        bounds="[0, 1)",
        section="training",
        common=True,
    )
    # --- batching and length of training
    per_device_train_batch_size: int | Literal["auto"] = config_field(
        "Micro-batch size per process. auto: the largest the run's memory plan fits on this device (`tunebook "
        "plan`), at most the recipe's default, with gradient_accumulation_steps raised to keep the default's "
        "samples per optimizer step; the choice is logged at the start.",
        8,
        bounds="[1, inf)",
        section="training",
        common=True,
    )
    per_device_eval_batch_size: int = config_field(
        "Evaluation batch size per process.", 8, bounds="[1, inf)", section="evaluation"
    )
    gradient_accumulation_steps: int = config_field(
        "Micro-batches per optimizer step.", 1, bounds="[1, inf)", section="training", common=True
    )
    num_train_epochs: float = config_field(
        "Epochs to train when max_steps is -1.", 1.0, bounds="[0, inf)", section="training", common=True
    )
    max_steps: int = config_field(
        "Optimizer steps to train; -1 uses num_train_epochs, 0 only evaluates.",
        -1,
        bounds="[-1, inf)",
        section="training",
        common=True,
    )
    gradient_checkpointing: bool = config_field(
        "Recompute activations in backward to save memory.", False, section="training"
    )
    # --- speed
    torch_compile: bool | Literal["auto"] = config_field(
        "Compile each transformer block with torch.compile (regional compilation: one block's compile serves all). "
        "auto: only where it was measured to pay back: on CUDA, packed rows of one shape, at least 1,000 micro-batches "
        "(an H100: 1.27x eager's tokens/s after ~10 s of compiling), not under DeepSpeed, Liger or a 4-bit base; on a "
        "2-core CPU the first step takes ~15 s more for 6-10% per step (README).",
        "auto",
    )
    use_liger_kernel: bool = config_field(
        "Liger's Triton kernels for RMSNorm, RoPE and SwiGLU (pip install liger-kernel; CUDA only).",
        False,
    )
    fused_cpu_layers: bool = config_field(
        "On a CPU, RMSNorm and rotary embeddings of models whose code is Llama's (Mistral, Qwen2/3, ...) run as fused "
        "autograd functions: the same math in fewer passes over memory (~5% of a step on the vs_peers model).",
        True,
    )
    # --- logging, evaluation, checkpoints
    logging_steps: int = config_field(
        "Log train metrics every N optimizer steps.", 10, bounds="[1, inf)", section="outputs", common=True
    )
    log_every_seconds: float = config_field(
        "Longest silence of the log while training: a progress line (step, loss so far, tokens/s, elapsed, ETA) after "
        "the first optimizer step and whenever this many seconds pass without a logged step, whatever logging_steps "
        "says. A log line only: metrics.jsonl keeps one record every logging_steps.",
        30.0,
        bounds="(0, inf)",
        section="outputs",
    )
    eval_strategy: Literal["steps", "epoch"] = config_field(
        "When to evaluate during training: every eval_steps optimizer steps, or at the end of every epoch. There is "
        "always an evaluation at the end when there is eval data.",
        "steps",
        section="evaluation",
        common=True,
    )
    eval_steps: int = config_field(
        "With eval_strategy steps: evaluate every N optimizer steps (0: only at the end).",
        0,
        bounds="[0, inf)",
        section="evaluation",
        common=True,
    )
    eval_on_start: bool = config_field(
        "Also evaluate before the first step, to compare with the trained model.", True, section="evaluation"
    )
    metric_for_best_model: str | None = config_field(
        "Evaluation metric that picks the best checkpoint, e.g. eval_loss or eval_accuracy (the eval_ prefix may be "
        "left out). Default eval_loss when load_best_model_at_end or early_stopping_patience asks for one.",
        None,
        section="evaluation",
    )
    greater_is_better: bool | None = config_field(
        "Whether a larger metric_for_best_model is better (None: false for losses and perplexity, else true).",
        None,
        section="evaluation",
    )
    load_best_model_at_end: bool = config_field(
        "Export the best checkpoint's weights as the final model instead of the last step's. Every evaluation that "
        "improves on the best saves a checkpoint, which checkpoint rotation keeps.",
        False,
        section="evaluation",
    )
    early_stopping_patience: int = config_field(
        "Stop training after this many evaluations in a row without improving metric_for_best_model (0: never).",
        0,
        bounds="[0, inf)",
        section="evaluation",
    )
    save_strategy: Literal["steps", "epoch", "no"] = config_field(
        "When to save resumable checkpoints: every save_steps optimizer steps, at the end of every epoch, or never "
        "(a stop signal still saves one).",
        "steps",
        section="outputs",
    )
    save_steps: int = config_field(
        "With save_strategy steps: save every N optimizer steps (0: no step checkpoints).",
        0,
        bounds="[0, inf)",
        section="outputs",
        common=True,
    )
    save_total_limit: int = config_field(
        "Keep at most this many checkpoints, the newest (0: keep all).", 2, bounds="[0, inf)", section="outputs"
    )
    resume_from_checkpoint: str | None = config_field(
        "Continue a run exactly where it stopped: 'latest' (the newest complete checkpoint in output_dir; an error "
        "when there is none), 'auto' (the newest one, or a fresh start when there is none: for jobs that are "
        "requeued) or a checkpoint directory. Keys that would change what the run computes (data, batches, model, "
        "seed) must equal the checkpoint's; the learning-rate schedule and optimizer settings follow the new config.",
        None,
        section="outputs",
        common=True,
    )
    overwrite_output_dir: bool = config_field(
        "Start afresh in an output_dir that holds another run's checkpoints, deleting them (and its metrics, "
        "summary and tracker logs); without it such a run stops at start-up.",
        False,
        section="outputs",
    )
    nan_policy: Literal["stop", "skip"] = config_field(
        "On a non-finite loss or gradient norm: stop (exit non-zero, keeping the last good checkpoint) or skip "
        "that update and count it.",
        "stop",
        section="training",
    )
    peak_flops: float | None = config_field(
        "Peak FLOP/s of one device for the MFU figure (default: the data-sheet bf16 value of known GPUs; none on CPU).",
        None,
        bounds="(0, inf)",
    )
    report_to: str | list[str] = config_field(
        "Experiment trackers (through Accelerate): tensorboard, trackio, wandb, mlflow, a list of them, auto "
        "(tensorboard when installed) or none. They get the config and every metrics.jsonl record; local ones write "
        "under output_dir/runs.",
        "auto",
        section="outputs",
        common=True,
    )
    disable_tqdm: bool = config_field("Turn off progress bars.", False, section="outputs")
    # --- several processes and machines
    preflight_timeout: int = config_field(
        "Seconds all processes get to meet after data preparation; a node that never started, a crashed rank or "
        "ranks that disagree on config, data or versions then stop the run with one message instead of a hang.",
        300,
        bounds="[1, inf)",
    )
    ddp_timeout: int = config_field(
        "Timeout in seconds of the process group's collectives (torch.distributed); raise it if evaluation or a "
        "checkpoint save on one rank makes the others wait longer.",
        1800,
        bounds="[1, inf)",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = config_field(
        "Log level of the main process.", "INFO", section="outputs"
    )
    # numpy (data order, accelerate's set_seed) takes seeds from 0 to 2**32 - 1
    seed: int = config_field(
        "Seed for model init, data order and dropout.", 42, bounds="[0, 4294967295]", section="training"
    )
    # --- data loading
    dataloader_num_workers: int = config_field(
        "DataLoader worker processes that collate batches in the background (0: collate in the training loop).",
        2,
        bounds="[0, inf)",
    )
    dataloader_prefetch_factor: int = config_field("Batches each worker prepares ahead.", 2, bounds="[1, inf)")
    dataloader_pin_memory: bool = config_field("Pin host memory for faster copies when training on CUDA.", True)
    dataloader_non_blocking: bool = config_field(
        "Copy batches to the device asynchronously (with pinned memory), overlapping the copy with compute.",
        True,
    )

    def __post_init__(self) -> None:
        """Computed defaults, resolved here so that config.yaml and `--help` show the values a run uses."""
        fill_cache_dir(self)

    def validate(self) -> None:
        """Reject impossible settings with the key and value at fault: each numeric key outside its bounds (declared
        with the field), then the rules that tie keys together."""
        for check in TRAINING_CHECKS:
            check(self)

    def check_files(self) -> None:
        """Check that the local files this run will read exist, before it starts: what `load_config` (a command
        line) does after `validate`, and a config parsed for another purpose (a finished run's config.yaml, read by
        `tunebook export` after its data has moved) does not. Recipe configs with data override it."""


@dataclass
class ModelDataConfig(TrainConfig):
    """The model, tokenizer and data fields every recipe shares (fields only; each recipe adds its own)."""

    # --- model and tokenizer
    model_name_or_path: str | None = config_field(
        "Local HF model directory or Hub name to fine-tune.", None, section="model", common=True
    )
    model_revision: str | None = config_field(
        "Branch, tag or commit of a Hub model (and of its tokenizer).", None, section="model"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = config_field(
        "Weights' dtype in memory. auto: float32 for the weights that train (bf16/fp16 mixed precision comes from the "
        "accelerate config and computes in half precision over float32 master weights); with LoRA the frozen base "
        "as stored in the checkpoint. bfloat16/float16: all weights in that dtype, trained ones too (less memory, "
        "updates lose precision).",
        "auto",
        section="model",
        common=True,
    )
    use_safetensors: bool = config_field(
        "Load weights only from safetensors files; false also allows pickled .bin weights (which can run code).",
        True,
        section="model",
    )
    model_config: dict | str | None = config_field(
        "Build a fresh model from this config dict (or JSON/YAML file) instead of loading weights; unset with no "
        "model_name_or_path either: the recipe's tiny default model (the embedded offline run).",
        None,
        section="model",
    )
    tokenizer_name_or_path: str | None = config_field(
        "Tokenizer to load (default: the model's); with no model either, one is trained locally on train_data.",
        None,
        section="model",
    )
    trust_remote_code: bool = config_field(
        "Allow a model or tokenizer directory to run its own Python code (off: only standard architectures load).",
        False,
        section="model",
    )
    tokenizer_vocab_size: int = config_field(
        "Vocabulary size of a locally trained tokenizer.", 512, bounds="[1, inf)", section="model"
    )
    attn_implementation: str | None = config_field(
        "Attention kernel: sdpa, eager, flash_attention_2 (None: model default).", "sdpa", section="model"
    )
    # --- LoRA / QLoRA through peft (pip install 'tunebook[peft]')
    use_peft: bool = config_field(
        "Train LoRA adapters instead of all weights: the base stays frozen, checkpoints hold only the adapters and "
        "the output is a peft adapter directory.",
        False,
        section="lora",
        common=True,
    )
    lora_r: int = config_field("Rank of the LoRA update matrices.", 16, bounds="[1, inf)", section="lora", common=True)
    lora_alpha: float = config_field(
        "LoRA scale numerator: the update is scaled by lora_alpha / lora_r.",
        32,
        bounds="(0, inf)",
        section="lora",
        common=True,
    )
    lora_dropout: float = config_field(
        "Dropout on the input of the LoRA update.", 0.05, bounds="[0, 1)", section="lora"
    )
    lora_target_modules: str | list[str] = config_field(
        "Modules that get adapters: all-linear (every linear layer except the output head), a module name, or a "
        "list of names (e.g. [q_proj, v_proj]).",
        "all-linear",
        section="lora",
    )
    modules_to_save: list[str] | None = config_field(
        "Modules trained in full and saved with the adapters (e.g. [embed_tokens, lm_head] when the tokenizer has "
        "new tokens); a classifier's head is always trained.",
        None,
        section="lora",
    )
    merge_adapter: bool = config_field(
        "Also write the adapters folded into the base weights, as a plain model directory in output_dir/merged.",
        False,
        section="lora",
    )
    load_in_4bit: bool = config_field(
        "QLoRA: load the base model quantised to 4-bit NF4 through bitsandbytes (CUDA only; needs use_peft and "
        "model_name_or_path).",
        False,
        section="lora",
    )
    # --- data
    train_data: str | dict | list | None = config_field(
        "A local file (json, jsonl, jsonl.gz, csv, tsv, parquet, arrow, txt) or folder, a Hub data set name, or a "
        "mapping {path, name, split, revision, data_files, data_dir, columns, weight | samples, streaming}, or a list of "
        "them (streaming: true reads it as training goes, uncached). "
        "A folder or Hub data set with several splits needs split. None: generate the recipe's synthetic task.",
        None,
        section="data",
        common=True,
    )
    eval_data: str | dict | list | None = config_field(
        "Evaluation data, same forms as train_data (e.g. {path: HuggingFaceH4/ultrachat_200k, split: test_sft}).",
        None,
        section="data",
        common=True,
    )
    eval_split_ratio: float = config_field(
        "Hold out this fraction of train_data for evaluation when eval_data is unset (0: no split).",
        0.0,
        bounds="[0, 1)",
        section="data",
    )
    mixture_stopping_strategy: Literal["all_exhausted", "first_exhausted"] = config_field(
        "A mixture of streamed sources (streaming: true) ends its pass over the data when every source has run out "
        "(all_exhausted: the smaller ones start again meanwhile, keeping their weights) or the first one has "
        "(first_exhausted: nothing is read twice within a pass). The stream then starts its next pass.",
        "all_exhausted",
        section="data",
    )
    stream_shuffle: bool = config_field(
        "With streaming: true: shuffle the training rows within each group a reader makes at a time "
        "(packing_buffer_size examples for sft, 256 documents for pretrain), seeded by the group's position, so a "
        "resumed run sees the same order. Off: the order of the files.",
        True,
        section="data",
    )
    max_seq_length: int = config_field(
        "Longest tokenised example in tokens.", 1024, bounds="[2, inf)", section="data", common=True
    )
    dataset_num_proc: int | None = config_field(
        "Processes for tokenisation (None: one).", None, bounds="[1, inf)", section="data"
    )
    pad_to_multiple_of: int | None = config_field(
        "Round padded batch lengths up to a multiple of this (tensor-core friendly).",
        8,
        bounds="[1, inf)",
        section="data",
    )
    synthetic_train_size: int = config_field(
        "Training examples of the synthetic task (when train_data is None).", 8000, bounds="[1, inf)", section="data"
    )
    synthetic_eval_size: int = config_field(
        "Held-out examples of the synthetic task (when train_data is None).", 200, bounds="[1, inf)", section="data"
    )

    # The model a recipe builds when the config names none: the embedded default's (tunebook.config.tiny).
    tiny_model: ClassVar[dict] = TINY_LLAMA
    # Whether the recipe reads streamed training data (streaming: true on a source; tunebook.data.stream).
    streams: ClassVar[bool] = False

    def __post_init__(self) -> None:
        fill_cache_dir(self)
        fill_tiny_model(self)

    def validate(self) -> None:
        for check in (*TRAINING_CHECKS, *MODEL_DATA_CHECKS):
            check(self)

    def check_files(self) -> None:
        check_data_files(self)


@dataclass
class ChatModelConfig(ModelDataConfig):
    """Fields of the recipes that render conversations with a chat template (fields only)."""

    chat_template: str | None = config_field(
        "Chat template: Jinja text, a .jinja file, or a tokenizer directory (or Hub name) to take it from. Default: "
        "the tokenizer's own, or ChatML with <|im_start|>/<|im_end|> added as tokens. The token ending an assistant "
        "turn becomes eos_token, so the model learns to stop.",
        None,
        section="model",
    )


@dataclass
class CausalLMConfig:
    """Fields of the recipes that train a causal LM (sft, pretrain, dpo, grpo; fields only): a second base class,
    listed first (`class SFTConfig(CausalLMConfig, ChatModelConfig)`), so its keys follow the shared ones."""

    sample_prompts: list[str] = config_field(
        "Prompts the model answers at every evaluation (the one before training too), greedily: the replies go to "
        "the log, metrics.jsonl (key samples), the trackers (tensorboard: text) and the model card. A user turn in "
        "the chat template (sft, dpo, grpo) or plain text (pretrain). Needs eval data. "
        'On the command line a YAML list: --sample_prompts \'["What is 2+2?", "12345"]\'.',
        default_factory=list,
        section="evaluation",
    )
    sample_max_new_tokens: int = config_field(
        "Tokens generated at most per sample prompt.", 64, bounds="[1, 4096]", section="evaluation"
    )
    # --- benchmark evaluation through lm-evaluation-harness (pip install "tunebook[eval]"; docs/evaluation.md)
    eval_harness_tasks: list[str] = config_field(
        "lm-evaluation-harness tasks run on the trained model at the end of training, with the model in memory on "
        "every process: names from lm-eval's registry (arc_easy, hellaswag, ...: their data must be reachable) or "
        "local task YAMLs or directories of them (dataset_path: json with local data_files works offline). Results "
        "go to metrics.jsonl (harness/<task>/<metric>), summary.json (eval_harness), the report and the model card. "
        "On the command line a YAML list: --eval_harness_tasks '[arc_easy, tasks/my_task.yaml]'.",
        default_factory=list,
        section="evaluation",
    )
    eval_harness_limit: int | None = config_field(
        "Evaluate at most this many documents of each harness task (None: all of them).",
        None,
        bounds="[1, inf)",
        section="evaluation",
    )
    eval_harness_num_fewshot: int | None = config_field(
        "Few-shot examples in each harness prompt (None: each task's own default, 0 when it has none).",
        None,
        bounds="[0, inf)",
        section="evaluation",
    )
    eval_harness_at_eval: bool = config_field(
        "Also run the harness tasks at every evaluation (eval_steps or each epoch, and before training with "
        "eval_on_start), not only at the end.",
        False,
        section="evaluation",
    )
    eval_harness_chat_template: bool | None = config_field(
        "Render the harness prompts with the tokenizer's chat template, few-shot examples as turns (None: when the "
        "tokenizer has a chat template; false: plain text, as lm-eval does by default).",
        None,
        section="evaluation",
    )
    eval_harness_batch_size: int | None = config_field(
        "Harness requests per forward pass and process (None: per_device_eval_batch_size).",
        None,
        bounds="[1, inf)",
        section="evaluation",
    )
