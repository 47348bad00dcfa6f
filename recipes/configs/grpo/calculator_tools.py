"""The tools default's tool (recipes/configs/grpo/tools_default.yaml): a calculator for arithmetic expressions.

A tool is a plain Python function with type hints and a docstring whose `Args:` lines describe its arguments: GRPO
renders its definition into the prompt with the chat template, runs it when the model calls it, and returns its
result (or its error) to the model as a tool message.
"""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg}  # fmt: skip


def calculator(expression: str):
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression.
    """
    return str(_evaluate(ast.parse(expression, mode="eval").body))


def _evaluate(node: ast.AST):
    # Only numbers and arithmetic: the model's text is never run as Python.
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")
