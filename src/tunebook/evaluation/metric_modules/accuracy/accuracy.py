"""Accuracy: the share of predicted class ids equal to the reference ids (Tunebook's offline `evaluate` module)."""

import datasets
import evaluate

from tunebook.evaluation.scores import accuracy


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions, references: class ids (int)",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        return {"accuracy": accuracy(predictions, references)}
