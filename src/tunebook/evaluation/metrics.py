"""Metrics through the `evaluate` library, offline.

`evaluate.load("accuracy")` fetches the metric's script from the Hugging Face Hub, which fails offline. Tunebook
ships the metrics its recipes use as local `evaluate` modules (`metric_modules/<name>/<name>.py`) and resolves a
name to its local module first; any other name goes to `evaluate.load` as usual (the Hub, when online).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, first_line

__all__ = ["LOCAL_METRICS", "averaged_metric", "load_metric", "load_metrics"]

MODULES = Path(__file__).parent / "metric_modules"
LOCAL_METRICS = tuple(sorted(p.name for p in MODULES.iterdir() if (p / f"{p.name}.py").is_file()))
AVERAGED = ("f1", "precision", "recall")  # take `average` as their config name


def load_metric(name: str, average: str | None = None):
    """An `evaluate` metric module by name: Tunebook's local module when there is one, else `evaluate.load(name)`.

    `average` (binary, macro, micro, weighted) configures f1, precision and recall. Metrics keep their state in
    memory (no cache files that several processes would share) and are computed where they are called.
    """
    import evaluate

    local = MODULES / name / f"{name}.py"
    config_name = average if name in AVERAGED and average else None
    if local.is_file():
        return evaluate.load(str(local), config_name=config_name, keep_in_memory=True)
    try:
        return evaluate.load(name, config_name=config_name, keep_in_memory=True)
    except Exception as e:  # evaluate raises FileNotFoundError, ConnectionError or ValueError depending on the case
        raise ConfigError(
            f"metric {name!r} not found: it is not one of Tunebook's offline metrics ({', '.join(LOCAL_METRICS)}) "
            f"and evaluate.load could not load it ({first_line(e)})"
        ) from None


def load_metrics(names: list[str], average: str | None = None):
    """Several metrics as one `evaluate.combine`d module: `add_batch` per batch, `compute` once at the end."""
    import evaluate

    if len(set(names)) != len(names):
        raise ConfigError(f"metrics: {names} lists a metric twice")
    return evaluate.combine([load_metric(name, average) for name in names])


def averaged_metric(name: str):
    """The `evaluate.Metric` class of f1, precision or recall (one module file each, as `evaluate` wants).

    The averaging is the module's config name: `evaluate.load(path, config_name="macro")`; `binary` (the default)
    scores class `pos_label` (1); `macro`, `micro`, `weighted` as in scikit-learn.
    """
    import datasets
    import evaluate

    from .scores import AVERAGES, precision_recall_f1

    class Averaged(evaluate.Metric):
        def _info(self):
            if self.config_name not in ("default", *AVERAGES):
                raise ValueError(f"{name}: config_name must be one of {', '.join(AVERAGES)}, got {self.config_name!r}")
            features = {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            return evaluate.MetricInfo(
                description=f"{name} of class-id predictions (Tunebook's offline evaluate module)",
                citation="",
                inputs_description="predictions, references: class ids (int); pos_label: the positive class (binary)",
                features=datasets.Features(features),
            )

        def _compute(self, predictions, references, pos_label=1):
            average = "binary" if self.config_name == "default" else self.config_name
            return {name: precision_recall_f1(predictions, references, average, pos_label)[name]}

    Averaged.__name__ = Averaged.__qualname__ = name.capitalize()
    return Averaged
