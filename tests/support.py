"""Plain helpers the tests share (paths, the tiny model, launching recipes, tokenizers): imported by name, so
that no test module imports another and conftest.py holds only fixtures and guards."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = Path(__file__).parent / "assets"


TINY_TEST_MODEL = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_png(path) -> None:
    """`path` is a PNG image that matplotlib reads back, of a plausible size."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    height, width, _ = imread(path).shape
    assert width >= 600 and height >= 400, (width, height)


def launch_command(
    script: str,
    args: list[str],
    accelerate_config: str = "cpu.yaml",
    launcher_args: tuple[str, ...] = (),
    launcher: str = "tunebook",
) -> list[str]:
    """`tunebook train` (or, with `launcher="accelerate"`, `accelerate launch`) `--config_file
    accelerate_configs/<cfg> <script> <args>` as an argument list.

    `tunebook train` is what the README shows: `accelerate launch` with one process run in the launcher's own
    interpreter, which saves every single-process test launch a second interpreter and its imports (~2.5 s) and the
    interpreter's teardown (~1 s). Each recipe's default-run test keeps `accelerate launch`, so that stays tested."""
    entry = {"tunebook": ["tunebook.cli", "train"], "accelerate": ["accelerate.commands.launch"]}[launcher]
    return [
        sys.executable,
        "-m",
        *entry,
        "--quiet",
        "--config_file",
        str(ROOT / "accelerate_configs" / accelerate_config),
        "--main_process_port",
        str(free_port()),
        *launcher_args,
        str(ROOT / script),
        *args,
    ]


def launch(
    script: str,
    args: list[str],
    accelerate_config: str = "cpu.yaml",
    timeout: int = 300,
    env=None,
    launcher_args: tuple[str, ...] = (),
    launcher: str = "tunebook",
    in_process: bool | None = None,
):
    """Run `launch_command(...)` and return the CompletedProcess.

    A single-process `tunebook train` on `cpu.yaml` runs in this interpreter (`in_process`, the default where it
    can): `tunebook train` runs one process in its own interpreter anyway, and this one has imported torch,
    transformers and datasets already, which a new process pays ~5 s for at every launch. Its errors propagate as
    exceptions, and its time limit is the suite's (pytest-timeout), not `timeout`; a test of how a failure looks
    from outside (exit code, the one-line error, no traceback), of signals or of the launcher passes
    `in_process=False`."""
    cmd = launch_command(script, args, accelerate_config, launcher_args, launcher)
    if in_process is None:
        in_process = launcher == "tunebook" and accelerate_config == "cpu.yaml" and not launcher_args
    if in_process:
        return _train_in_process(cmd, env or {})
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # Its own process group, killed whole if the test ends early (its timeout, pytest-timeout, ^C): `subprocess.run`
    # kills only the launcher, and the recipe process it started would go on using the CPU the next tests need.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=ROOT,
                          start_new_session=True) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except BaseException:
            kill_group(process)
            process.communicate()
            raise
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process group of `process`, started with `start_new_session=True`: the launcher and the
    recipe processes it started, which a kill of the launcher alone would leave running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _train_in_process(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`tunebook.cli.main` with `cmd`'s arguments in this interpreter, its output captured, and what a run leaves in
    the process undone after it: environment (accelerate's launch variables), torch's thread count, argv, sys.path,
    signal handlers and Accelerate's process-wide state."""
    import contextlib
    import io
    import signal

    import torch
    from accelerate.state import AcceleratorState, GradientState

    from tunebook import cli

    saved_env, saved_argv, saved_path, threads = dict(os.environ), sys.argv[:], sys.path[:], torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    cwd = os.getcwd()
    try:
        os.environ.update(env)
        os.chdir(ROOT)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                cli.main(cmd[cmd.index("tunebook.cli") + 1 :])
            except SystemExit as ended:
                code = ended.code if isinstance(ended.code, int) else (0 if ended.code is None else 1)
    except BaseException:
        print(f"{stdout.getvalue()[-4000:]}{stderr.getvalue()[-4000:]}")  # the run's log, in pytest's report
        raise
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        torch.set_num_threads(threads)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return subprocess.CompletedProcess(cmd, code, stdout.getvalue(), stderr.getvalue())


def base_tokenizer(eos: str = "<|endoftext|>", extra: tuple[str, ...] = ()):
    """A base model's tokenizer: byte-level BPE, an EOS token, no chat template, no ChatML markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["user assistant question answer 0123456789 Reverse the digits. Sort the digits."] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[eos, *extra], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)


_HOLD_LOCK = (
    "import sys, time\nfrom tunebook.run.output_lock import lock_output_dir\n"
    "lock = lock_output_dir(sys.argv[1], 'sft')\nprint('locked', flush=True)\ntime.sleep(600)\n"
)


def hold_lock(directory: Path) -> subprocess.Popen:
    """Another process that holds `directory`'s output-dir lock, as a live sft run would, until it is killed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(directory)], stdout=subprocess.PIPE, text=True,
                              env=env)  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    return holder


CHAT_REPLY = "the answer is 42"


def save_tiny_chat_model(directory: Path, steps: int = 120) -> Path:
    """A tiny Llama and a locally trained ChatML tokenizer saved in `directory`, trained until it answers "hi" (or
    "what is it?") with `CHAT_REPLY` and ends its turn with `<|im_end|>`. It learnt whole two-turn conversations, so
    after its turn the text goes on (`<|im_start|>user ...`): a chat that missed the end of turn would print that.
    Its generation config's EOS is `<|endoftext|>` (as a base model's is), the tokenizer's `<|im_end|>`: only a stop
    rule that takes the tokenizer's end of turn stops it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunebook.models.tokenizer import train_chat_tokenizer

    questions = ["hi", "what is it?"]
    tokenizer = train_chat_tokenizer([CHAT_REPLY, *questions, "user assistant system"] * 5, vocab_size=300)

    def turn(question):
        return [{"role": "user", "content": question}, {"role": "assistant", "content": CHAT_REPLY}]

    texts = [tokenizer.apply_chat_template(turn(a) + turn(b), tokenize=False) for a in questions for b in questions]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    config = {k: v for k, v in TINY_TEST_MODEL.items() if k != "model_type"}
    config.update(hidden_size=64, intermediate_size=128, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, pad_token_id=tokenizer.pad_token_id,
                                         eos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>")))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_harness_tasks(directory: Path, rows: int = 50) -> dict[str, Path]:
    """Local lm-evaluation-harness tasks of `rows` documents each, readable offline (`dataset_path: json`): `choice`
    (multiple choice, `acc`), `reply` (generation, `exact_match` against `CHAT_REPLY` or "nope") and `rolling` (a
    text's log-likelihood, `word_perplexity`). Their questions are the ones `save_tiny_chat_model`'s model answers
    with `CHAT_REPLY`, and others."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    questions = ["hi", "what is it?", "hello", "two plus two", "hi there"]
    choice = [{"question": questions[i % 5], "choices": [CHAT_REPLY, "no", "the answer is 4"], "answer": i % 3}
              for i in range(rows)]  # fmt: skip
    reply = [{"question": questions[i % 5], "answer": CHAT_REPLY if i % 2 == 0 else "nope"} for i in range(rows)]
    common = "dataset_path: json\ntest_split: test\n"
    asked = "doc_to_text: question\ndoc_to_target: answer\n"
    metric = "metric_list:\n  - {{metric: {}, aggregation: mean, higher_is_better: true}}\n"
    tasks = {
        "choice": asked + "output_type: multiple_choice\ndoc_to_choice: choices\n" + metric.format("acc"),
        "reply": asked
        + 'output_type: generate_until\ngeneration_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 8\n'
        + metric.format("exact_match"),
    }
    # A whole text's log-likelihood (perplexity tasks such as wikitext): lm-eval scores it in windows of max_length.
    tasks["rolling"] = (
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: answer\nmetric_list:\n'
        "  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n"
    )
    rolling = [{"question": "", "answer": f"{CHAT_REPLY} " * (1 + i % 4) + questions[i % 5]} for i in range(rows)]
    paths = {}
    for name, data in (("choice", choice), ("reply", reply), ("rolling", rolling)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        paths[name] = directory / f"{name}.yaml"
        paths[name].write_text(f"task: tiny_{name}\n{common}dataset_kwargs:\n  data_files:\n"
                               f"    test: {directory / f'{name}.jsonl'}\n{tasks[name]}")  # fmt: skip
    return paths
