"""Recall of class-id predictions (Tunebook's offline `evaluate` module); see `tunebook.evaluation.averaged_metric`.

The averaging is the config name: `evaluate.load(path, config_name="macro")` (default `binary`).
"""

from tunebook.evaluation.metrics import averaged_metric

Recall = averaged_metric("recall")
