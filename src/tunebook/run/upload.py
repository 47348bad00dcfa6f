"""The upload to the Hub and what makes a run shareable.

`check_hub_access` runs at start-up (from `recipe_accelerator`), so a run whose upload could not happen stops before
its data is prepared, not after hours of training; `push_output_dir` uploads the final model directory to `hub_model_id`
in one commit; `shareable_config`/`shareable_path` take this machine's absolute paths out of what is shared.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub.errors import HfHubHTTPError

from ..errors import ConfigError, first_line, same_on_every_rank
from ..locations import hub_name_of_snapshot

__all__ = ["UPLOAD_IGNORE_PATTERNS", "check_hub_access", "push_output_dir", "shareable_config", "shareable_path"]

logger = logging.getLogger("tunebook")

# What push_to_hub leaves out of output_dir: everything but the model, tokenizer, card, config.yaml, summary.json,
# metrics.jsonl and report.png, and a LoRA run's base_model/ (a base built from a config, which the adapters need)
# and merged/ (asked for with merge_adapter).
UPLOAD_IGNORE_PATTERNS = [
    "checkpoints/*",  # resumable training states: optimizer, RNG and a model copy each, many times the model's size
    "runs/*",  # tracker files: tensorboard events, an mlflow store
    "*.tmp*",  # half-written files and checkpoints (summary.tmp, step-N.tmp/) of this or an interrupted run
    ".*",  # hidden files and folders: caches (.cache/), .git, an .env with secrets when output_dir is a project root
    "*/.*",
    "__pycache__/*",
    "*/__pycache__/*",
    "wandb/*",  # wandb's local run folder when output_dir is the working directory
    "*.lock",
    "*.log",  # redirected console logs: machine paths and environment, not part of the model
]

_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spellings of a true environment variable

# --------------------------------------------------------------------------------------------------------------
# Start-up check and upload


def check_hub_access(config) -> None:
    """With `push_to_hub`, stop now with one line if the upload at the end could not happen: offline mode, no
    token, a token the Hub refuses (or read-only, or for another namespace), or no network. Cheap, so every process
    runs it and all of them stop together."""
    if not getattr(config, "push_to_hub", False):
        return
    repo_id = config.hub_model_id
    offline = huggingface_hub.constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE
    if offline:
        raise same_on_every_rank(ConfigError(
            f"push_to_hub: offline mode is on (HF_HUB_OFFLINE), so {repo_id} could not be uploaded at the end: unset "
            "HF_HUB_OFFLINE or set push_to_hub: false"
        ))  # fmt: skip
    token = huggingface_hub.get_token()
    if token is None:
        raise same_on_every_rank(ConfigError(
            f"push_to_hub: no Hugging Face token to upload {repo_id} with: run `hf auth login` or set HF_TOKEN "
            "(a token with write access)"
        ))  # fmt: skip
    try:
        me = huggingface_hub.HfApi().whoami(token=token)
    except HfHubHTTPError as error:
        status = getattr(error.response, "status_code", None)
        if status == 401:
            raise ConfigError("push_to_hub: the Hub refused the token (invalid or expired): run `hf auth login` "
                              "or set HF_TOKEN") from None  # fmt: skip
        raise ConfigError(f"push_to_hub: the Hub's token check failed: {first_line(error)}") from None
    except Exception as error:  # no network, DNS, proxy, timeout: each library words it differently
        raise ConfigError(f"push_to_hub: cannot reach the Hugging Face Hub ({first_line(error)}); check the "
                          "network or set push_to_hub: false") from None  # fmt: skip
    _check_token_can_write(me, repo_id)


def _check_token_can_write(me: dict[str, Any], repo_id: str) -> None:
    # What whoami tells for sure; fine-grained tokens' scopes are left to the Hub at upload time.
    role = (me.get("auth") or {}).get("accessToken", {}).get("role")
    if role == "read":
        raise ConfigError(f"push_to_hub: the Hugging Face token is read-only; {repo_id} needs a token with write "
                          "access (hf auth login, or HF_TOKEN)")  # fmt: skip
    user = me.get("name")
    names = sorted(n for n in {user} | {org.get("name") for org in me.get("orgs") or []} if n)
    namespace = repo_id.split("/")[0] if "/" in repo_id else user
    if user and namespace not in names:
        raise ConfigError(f"push_to_hub: {user} cannot create {repo_id}: '{namespace}' is neither the token's user "
                          f"nor one of its organisations ({', '.join(names)})")  # fmt: skip


def push_output_dir(
    output_dir: str | Path, config: dict[str, Any], recipe: str = "training", log: logging.Logger = logger
) -> str | None:
    """Upload the final model directory to `hub_model_id` (created if missing) without checkpoints, tracker files
    and leftovers (`UPLOAD_IGNORE_PATTERNS`); returns the repository's URL, or None when nothing was uploaded.

    A failed upload is logged with the command that retries it, not raised: the run's outputs are complete on disk.
    """
    output_dir = Path(output_dir)
    repo_id = config["hub_model_id"]
    if not has_model(output_dir):
        log.warning("push_to_hub: no model in %s (max_steps 0 only evaluates): nothing pushed", output_dir)
        return None
    try:
        api = huggingface_hub.HfApi()
        url = api.create_repo(repo_id, private=config.get("hub_private_repo"), exist_ok=True, repo_type="model")
        api.create_commit(
            repo_id=url.repo_id,  # "name" alone becomes "user/name"
            repo_type="model",
            operations=_upload_operations(output_dir, config),
            commit_message=f"Upload the outputs of a Tunebook {recipe} run",
        )
    except Exception as error:
        excludes = " ".join(f"--exclude '{p}'" for p in UPLOAD_IGNORE_PATTERNS)
        log.error("push_to_hub failed (%s); the outputs are complete in %s. Upload them with: hf upload %s %s . %s",
                  first_line(error), output_dir, repo_id, output_dir, excludes)  # fmt: skip
        return None
    log.info("Pushed to the Hub: %s", url)
    return str(url)


def _upload_operations(output_dir: Path, config: dict[str, Any]) -> list:
    """What `upload_folder(output_dir, ignore_patterns=UPLOAD_IGNORE_PATTERNS)` would send, in one commit, except
    that `config.yaml` and `summary.json` go as `shareable_config`: the local ones keep this machine's paths, which
    reproduce and resume the run here, but are nobody else's business."""
    import yaml
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    files = sorted(p.relative_to(output_dir).as_posix() for p in output_dir.rglob("*") if p.is_file())
    patterns = [*UPLOAD_IGNORE_PATTERNS, *DEFAULT_IGNORE_PATTERNS]
    operations = []
    for name in filter_repo_objects(files, ignore_patterns=patterns):
        if name == "config.yaml":
            text = yaml.safe_dump(shareable_config(config, output_dir), sort_keys=False)
            operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=text.encode()))
        elif name == "summary.json":
            summary = shareable_config(json.loads((output_dir / name).read_text()), output_dir)
            text = json.dumps(summary, indent=2)
            operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=text.encode()))
        else:
            operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(output_dir / name)))
    return operations


# --------------------------------------------------------------------------------------------------------------
# Paths as others may see them


# An absolute path that need not exist any more (a deleted checkpoint): no newline, braces, brackets, $, ^, * or \\.
_PATH_LIKE = re.compile(r"[\w .,+=@%~/-]+")


def shareable_path(value: str, output_dir: str | Path) -> str:
    """An absolute local path (or `path.py:function`) as a card or an uploaded config shows it: the Hub name of a
    folder in the Hugging Face cache, else the path relative to the run's `output_dir` ("." for the run itself),
    which says where it was beside the run without naming this machine's folders, users or mounts. Any other string
    (a Hub name, a relative path as the user wrote it, Jinja, a regular expression) comes back unchanged."""
    path, function = value, ""
    if re.fullmatch(r".+\.py:\w+", value):  # a reward function's spec: the file's path, then its function
        path, _, name = value.rpartition(":")
        function = f":{name}"
    if not path.startswith(("/", "~")) or not (_PATH_LIKE.fullmatch(path) or Path(path).expanduser().exists()):
        return value
    if snapshot := hub_name_of_snapshot(path):
        return snapshot[0]
    return os.path.relpath(Path(path).expanduser().resolve(), Path(output_dir).resolve()) + function


def shareable_config(config: Any, output_dir: str | Path) -> Any:
    """`config` (a dict, list or value from `config.yaml`) with every string passed through `shareable_path`."""
    if isinstance(config, dict):
        return {key: shareable_config(value, output_dir) for key, value in config.items()}
    if isinstance(config, list):
        return [shareable_config(value, output_dir) for value in config]
    return shareable_path(config, output_dir) if isinstance(config, str) else config


def has_model(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() or (model_dir / "adapter_config.json").is_file()
