"""Exact match: the share of predicted strings equal to their references after stripping surrounding whitespace
(Tunebook's offline `evaluate` module). `ignore_case=True` also ignores case."""

import datasets
import evaluate

from tunebook.evaluation.scores import exact_match


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions, references: strings",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, ignore_case=False):
        return {"exact_match": exact_match(predictions, references, ignore_case)}
