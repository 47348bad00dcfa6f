"""`fused_cpu_layers: true` (the default): RMSNorm and rotary embeddings as fused autograd functions on a CPU.

transformers writes both as chains of elementwise ops (RMSNorm: pow, mean, add, rsqrt, two muls; rotary: a
negation, a `cat` and three more ops per tensor). In eager mode every op is a pass over memory and a node whose
backward is another pass or two (the `cat`'s backward fills a zero tensor per half). On the vs_peers model (4 x 128
Llama, packed rows of 8 x 512, 2 cores) they take ~13% of a training step. The functions here compute the same
forward (equal to float32 rounding: the rotary's multiply-adds are fused) and a hand-written backward, with about half
the passes and temporaries: ~5% of that step (tests/equivalence/test_fused_cpu_layers.py keeps them equal).
On a GPU, `torch_compile` or `use_liger_kernel` fuse the same layers for real, so only CPU tensors take this path.

Only code that is Llama's is replaced, and only in the model given: each of its RMSNorm modules whose class's
`forward` parses to the same statements as the reference below gets the fused `forward` as an instance attribute, and
each attention module whose `forward` calls a Llama-identical `apply_rotary_pos_emb` (with `rotate_half`) gets a copy
of that `forward` reading the fused function instead (transformers copies Llama's code into Mistral, Qwen2/3,
SmolLM3, OLMoE, ... and these match). Gemma's `1 + weight`, partial rotary dimensions, or a transformers release that
changes the code keep transformers' own. Nothing outside the model changes: transformers' classes and modules, and any
other model in the process, run as before, and `set_fused_cpu_layers(model, False)` puts the model's own code back.
The fused functions fall back to the original for anything but plain float32 CPU tensors (CUDA, bf16 autocast, FSDP's
DTensors) and while torch.compile traces (inductor fuses these itself).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types

import torch

__all__ = ["fused_cpu_layers_of", "set_fused_cpu_layers"]

# The bodies the fused functions reproduce (transformers 5.x, models/llama/modeling_llama.py), docstrings aside.
_REFERENCE = {
    "rms_norm": """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
""",
    "rotate_half": """
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
""",
    "apply_rotary_pos_emb": """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
""",
}


class _RMSNorm(torch.autograd.Function):
    """`weight * (x * rsqrt(mean(x^2) + eps))` over the last dimension."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        normed = x * rstd
        ctx.save_for_backward(normed, weight, rstd)
        return weight * normed

    @staticmethod
    def backward(ctx, grad):
        normed, weight, rstd = ctx.saved_tensors
        grad_weight = (grad * normed).reshape(-1, normed.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        grad_normed = grad * weight
        # d(x * rstd)/dx applied to grad_normed: rstd * (grad_normed - normed * mean(grad_normed * normed))
        dot = (grad_normed * normed).mean(-1, keepdim=True)
        grad_x = grad_normed.addcmul_(normed, dot, value=-1).mul_(rstd) if ctx.needs_input_grad[0] else None
        return grad_x, grad_weight, None


class _Rotary(torch.autograd.Function):
    """`x * cos + rotate_half(x) * sin`, rotate_half(x) = (-x2, x1): each half updated in place, no `cat`."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        grad_x = grad * cos
        grad_x[..., :half].addcmul_(grad[..., half:], sin[..., half:])
        grad_x[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1)
        return grad_x, None, None


def _takes_fused_path(*tensors: torch.Tensor) -> bool:
    """Plain float32 CPU tensors (not DTensors or other subclasses), outside torch.compile's tracing."""
    return not torch.compiler.is_compiling() and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32
        for t in tensors
    )


def _fused_rms_norm_forward(original):
    def forward(self, hidden_states):
        if _takes_fused_path(hidden_states, self.weight):
            return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)
        return original(self, hidden_states)

    forward.tunebook_original = original
    return forward


def _fused_apply_rotary_pos_emb(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _takes_fused_path(q, k, cos, sin) and not (cos.requires_grad or sin.requires_grad):
            c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            # The backward returns a gradient of the output's shape: the tables may broadcast to q and k, not widen them.
            if (
                torch.broadcast_shapes(q.shape, c.shape) == q.shape
                and torch.broadcast_shapes(k.shape, c.shape) == k.shape
            ):
                return _Rotary.apply(q, c, s), _Rotary.apply(k, c, s)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.tunebook_original = original
    return apply_rotary_pos_emb


def _body(source: str) -> str:
    """The function's argument names, defaults and statements (no docstring, annotations, decorators, comments)."""
    function = ast.parse(textwrap.dedent(source)).body[0]
    statements = function.body
    if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
        statements = statements[1:]  # the docstring
    args = [a.arg for a in function.args.args] + [ast.dump(d) for d in function.args.defaults]
    return repr(args) + "".join(ast.dump(s) for s in statements)


@functools.cache
def _reference_body(reference: str) -> str:
    return _body(_REFERENCE[reference])


def _same_code(function, reference: str) -> bool:
    function = getattr(function, "tunebook_original", function)
    try:
        return _body(inspect.getsource(function)) == _reference_body(reference)
    except (OSError, TypeError, SyntaxError, IndexError):  # no source (a compiled or built-in function)
        return False


def _attention_with_fused_rotary(forward):
    """A copy of an attention class's `forward` (the same code, defaults and closure) whose global
    `apply_rotary_pos_emb` is the fused one. Its globals are a snapshot of the modeling module's, taken now."""
    names = dict(forward.__globals__)
    names["apply_rotary_pos_emb"] = _fused_apply_rotary_pos_emb(forward.__globals__["apply_rotary_pos_emb"])
    copy = types.FunctionType(forward.__code__, names, forward.__name__, forward.__defaults__, forward.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = forward.__kwdefaults__, forward.__qualname__
    copy.tunebook_original = forward
    return copy


def _rotary_is_llamas(forward) -> bool:
    """Whether an attention `forward` calls its module's `apply_rotary_pos_emb`, and that (with `rotate_half`) is
    Llama's code."""
    names = getattr(forward, "__globals__", {})
    return (
        "apply_rotary_pos_emb" in getattr(getattr(forward, "__code__", None), "co_names", ())
        and _same_code(names.get("apply_rotary_pos_emb"), "apply_rotary_pos_emb")
        and _same_code(names.get("rotate_half"), "rotate_half")
    )


def _unfuse(module: torch.nn.Module) -> None:
    forward = vars(module).get("forward")
    if forward is not None and hasattr(getattr(forward, "__func__", None), "tunebook_original"):
        del module.forward  # the class's own again


def set_fused_cpu_layers(model: torch.nn.Module, enabled: bool = True) -> list[str]:
    """Give the Llama-identical RMSNorm and attention modules of `model` the fused functions (see the module
    docstring), or with `enabled=False` their own code back. Only this model changes. Returns what takes the fused
    path, for the log."""
    fused = set()
    for module in model.modules():
        _unfuse(module)
        if not enabled:
            continue
        cls = type(module)
        forward = vars(cls).get("forward")
        if forward is None:
            continue
        # Bound to the module: a deep copy of the model (DPO's reference) rebinds it to the copy.
        if cls.__name__.endswith("RMSNorm") and _same_code(forward, "rms_norm"):
            module.forward = types.MethodType(_fused_rms_norm_forward(forward), module)
            fused.add(cls.__name__)
        elif _rotary_is_llamas(forward):
            module.forward = types.MethodType(_attention_with_fused_rotary(forward), module)
            fused.add(f"{forward.__globals__['__name__'].rsplit('.', 1)[-1]}.apply_rotary_pos_emb")
    return sorted(fused)


def fused_cpu_layers_of(model: torch.nn.Module) -> bool:
    """Whether `set_fused_cpu_layers` fused any module of `model` (a copy built anew is fused alike)."""
    return any(
        hasattr(getattr(vars(m).get("forward"), "__func__", None), "tunebook_original") for m in model.modules()
    )
