"""The GSM8K reward that recipes/configs/grpo/qwen25_1p5b_gsm8k.yaml names: the final number against GSM8K's."""

from __future__ import annotations

from support import ROOT

from tunebook.user_code import load_function

SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def test_final_number_is_compared_not_the_text():
    reward = load_function(f"{ROOT}/recipes/configs/grpo/gsm8k_rewards.py:gsm8k_exact_match", "reward function")
    completions = [
        "48 / 2 = 24 in May, so 48 + 24 = 72 in all. The answer is $\\boxed{72}$.",  # boxed
        "She sold 24 in May and 72 altogether.\n#### 72",  # GSM8K's own form
        "In April 48 and in May 24, so 72.0 clips.",  # the last number, written as a decimal
        "The answer is \\boxed{72} clips, which is 3 times 24.",  # boxed wins over a later number
        "48 + 24 = 96 - 24, so \\boxed{96}.",  # wrong
        "She sold 72 clips in April and 24 in May.",  # the last number is not the answer
        "I cannot tell.",  # no number at all
    ]
    assert reward(["q"] * 7, completions, answer=[SOLUTION] * 7) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_thousands_separators_and_negative_numbers():
    reward = load_function(f"{ROOT}/recipes/configs/grpo/gsm8k_rewards.py:gsm8k_exact_match", "reward function")
    assert reward(["q", "q", "q"], ["\\boxed{1,200}", "So $1200.", "\\boxed{-5}"],
                  answer=["... #### 1200", "#### 1,200", "#### 5"]) == [1.0, 1.0, 0.0]  # fmt: skip
