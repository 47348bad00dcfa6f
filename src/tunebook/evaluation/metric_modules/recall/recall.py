"""Recall of class-id predictions (Tunebook's offline `evaluate` module).

The averaging is the module's config name: `evaluate.load(path, config_name="macro")`; `binary` (the default)
scores class `pos_label` (1), `macro`/`micro`/`weighted` as in scikit-learn.
"""

import datasets
import evaluate

from tunebook.evaluation.scores import AVERAGES, precision_recall_f1


class Recall(evaluate.Metric):
    def _info(self):
        if self.config_name not in ("default", *AVERAGES):
            raise ValueError(f"recall: config_name must be one of {', '.join(AVERAGES)}, got {self.config_name!r}")
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions, references: class ids (int); pos_label: the positive class (binary)",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, pos_label=1):
        average = "binary" if self.config_name == "default" else self.config_name
        return {"recall": precision_recall_f1(predictions, references, average, pos_label)["recall"]}
