"""Perplexity from a model's losses (Tunebook's offline `evaluate` module).

Unlike the Hub's `perplexity` module, which downloads a model to score texts, this one takes what the evaluation
loop already has: `predictions` are per-example summed next-token losses (nats) and `references` the number of
loss-bearing tokens of each example. It returns the token-weighted mean `loss` and `perplexity` = exp(loss).
"""

import datasets
import evaluate

from tunebook.evaluation.scores import perplexity


class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions: summed loss per example (float); references: its token count (int)",
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        return perplexity(predictions, references)
