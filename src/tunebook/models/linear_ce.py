"""Cross-entropy of a linear layer's outputs, a chunk of rows at a time: the (rows, vocab) logits never exist at once.

With a 128k-150k vocabulary the LM head's logits, their float32 copy and their gradient are the largest tensors of a
training step. `linear_cross_entropy` keeps only a `CHUNK_ELEMENTS`-sized slice of them: the forward saves each
row's loss, and the backward recomputes a chunk's logits, turns them into the gradient (softmax minus one-hot) and
folds that into the gradients of the hidden states, the weight and the bias (the recompute style of Liger and
torchtune; store-the-gradient-in-forward needs the upstream gradient in advance, which per-token losses, as DPO
sums them per sequence, do not give). Rows that fit in one chunk keep that chunk's softmax from the forward instead:
the same memory as the unfused loss's log-softmax, and no recompute (small vocabularies, short batches).

Why not torch's own `F.linear_cross_entropy(..., reduction="none", options=LinearCrossEntropyOptions(...))`
(torch >= 2.13), the same algorithm: on bf16 weights it returns the per-token losses in bf16 (0.3% off, where
Tunebook's losses are float32, as DPO's sequence sums need); Tunebook supports torch >= 2.4; and it is no faster.
On a shared 2-core AMD EPYC, 2048 rows x hidden 256, float32, forward + backward, medians of 3-5 runs in turn,
peak resident-set growth:

    vocab    logits + F.cross_entropy    torch's op (rows per chunk)    this module (rows per chunk)
    32,768   2.42 s, 802 MiB             2.72 s, 197 MiB (1024)         2.65 s, 196 MiB (1024)
    131,072  10.3 s, 3,202 MiB           10.6 s, 392 MiB (256)          10.3 s, 388 MiB (256)

torch's default chunking (float32 on a CPU falls back to chunks whose logits are half the input's size) picks
8-row chunks at 32,768 (25-38 s) and 2-row chunks at 131,072 (stopped after ten minutes).

The backward can also chunk over the vocabulary (`VOCAB_BACKWARD`; by default on CUDA when the vocabulary is larger
than the rows and the head is trained). Row chunks add each chunk's share into the whole weight gradient. On an H100
at the Llama-3.2-1B shape (bf16 autocast, 16,384 rows, vocabulary 128,256, hidden 2,048) that is a 128,256 x 2,048
float32 gradient, 1 GB, read and written by each of 63 chunks, plus a 0.5 GB bf16 product per chunk: an estimated 65
ms (at 3 TB/s) of a 526 ms step whose profile put 188 ms in the LM head, against about 40 ms of matmuls. A slice of
the vocabulary, with all rows, finishes its rows of the weight gradient in one matmul. That lands straight in a
gradient of the weight's dtype, with no float32 accumulator, and rounds once, as the unfused F.linear's backward
does. What accumulates instead is the (rows, hidden) gradient of the hidden states: vocabulary / rows times less
traffic. The forward keeps its row chunks and saves each row's log-sum-exp for this path. Not yet measured on a GPU;
the next GPU lease measures it (benchmarks/packed_attention.py --ce_backward). CPUs keep row chunks: their
accumulation is cheap there, and on 2-core CPUs vocabulary slices gained nothing (a prototype 1-10% slower; this
code level with row chunks at 2048 rows x hidden 256 x vocabulary 131,072, float32, 2.1 s each on a Xeon).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CHUNK_ELEMENTS", "VOCAB_BACKWARD", "HeadCall", "linear_cross_entropy", "linear_losses"]

# Logits per chunk: 128 MiB in float32, 256 rows of a 131,072-token vocabulary. Smaller chunks cost time on CPU
# (128 rows: about 12 s instead of 10 s in the table above), as each re-reads the whole weight for a thinner matmul.
CHUNK_ELEMENTS = 2**25

# How the backward chunks: True over the vocabulary, False over rows, None by the device (see the module's docstring):
# vocabulary slices on CUDA when the vocabulary is larger than the rows and the head is trained. Set by tests and
# benchmarks.
VOCAB_BACKWARD: bool | None = None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="none")`, shape (rows,), float32,
    with the gradients of `hidden`, `weight` and `bias`, computed `CHUNK_ELEMENTS` logits at a time.

    The matmuls run in the dtype `F.linear` would use here (the autocast dtype inside autocast, else the weight's)
    and the softmax in float32, as in that expression.
    """
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
    vocab = _slices_vocabulary(device, hidden.shape[0], weight.shape[0], weight.requires_grad)
    with torch.autocast(device, enabled=False):  # the backward runs without autocast: both must see one dtype
        bias = None if bias is None else bias.to(dtype)
        return _LinearCrossEntropy.apply(hidden.to(dtype), weight.to(dtype), bias, targets, rows, vocab)


def _slices_vocabulary(device: str, rows: int, vocab: int, weight_grad: bool = True) -> bool:
    if VOCAB_BACKWARD is not None:
        return VOCAB_BACKWARD
    # A frozen head (LoRA) has no weight gradient to write per row chunk; its row chunks accumulate nothing.
    return device == "cuda" and vocab > rows and weight_grad


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, vocab):
        one_chunk = 0 < hidden.shape[0] <= rows
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        # Vocabulary slices never see a row's whole logits, so they need its log-sum-exp from here. Only then: the
        # row chunks get it back as loss + target logit, which they recompute anyway.
        lse = torch.empty_like(losses) if vocab and not one_chunk else None
        buffer = _logits_buffer(hidden, weight, rows)
        for start in range(0, hidden.shape[0], rows):
            logits = _chunk_logits(hidden[start : start + rows], weight, bias, buffer)
            maxes = logits.amax(dim=1, keepdim=True)
            logits.sub_(maxes)  # exp cannot overflow
            target_logits = logits.gather(1, targets[start : start + rows, None]).squeeze(1)
            sums = logits.exp_().sum(dim=1)
            log_sums = sums.log()
            torch.sub(log_sums, target_logits, out=losses[start : start + rows])
            if lse is not None:
                torch.add(maxes.squeeze(1), log_sums, out=lse[start : start + rows])
        # One chunk: its softmax is kept for the backward, which then has no logits to recompute (the memory of the
        # unfused loss's log-softmax, at most one chunk; 1.2-1.5x faster than F.cross_entropy's forward and backward
        # on the vs_peers model's 2048-token vocabulary, with no (rows, vocab) zero tensor for nll_loss's gradient).
        softmax = buffer.div_(sums[:, None]) if one_chunk else None
        ctx.save_for_backward(hidden, weight, bias, targets, losses, softmax, lse)
        ctx.rows = rows
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, bias, targets, losses, softmax, lse = ctx.saved_tensors
        rows = ctx.rows
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if lse is not None:
            grads = _vocab_backward(
                hidden, weight, bias, targets, lse, grad_losses, need_hidden, need_weight, need_bias
            )
            return *grads, None, None, None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Summed over chunks in float32, whatever the weight's dtype: bf16 partial sums would round once per chunk.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        buffer = _logits_buffer(hidden, weight, rows) if softmax is None else None
        for start in range(0, hidden.shape[0], rows):
            chunk, chunk_targets = hidden[start : start + rows], targets[start : start + rows, None]
            if softmax is not None:
                grad_logits = softmax  # ... (changed in place: a second backward through it stops at autograd's check)
            else:
                logits = _chunk_logits(chunk, weight, bias, buffer)
                # log-sum-exp = loss + target logit, so the saved loss gives the softmax without another reduction.
                log_norm = losses[start : start + rows] + logits.gather(1, chunk_targets).squeeze(1)
                grad_logits = logits.sub_(log_norm[:, None]).exp_()  # softmax ...
            grad_logits.scatter_add_(1, chunk_targets, torch.full_like(grad_logits[:, :1], -1.0))  # ... - one-hot
            grad_logits.mul_(grad_losses[start : start + rows, None])
            if need_bias:
                grad_bias += grad_logits.sum(dim=0)
            grad_logits = grad_logits.to(weight.dtype)
            if need_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start : start + rows])
            if need_weight and grad_weight.dtype == chunk.dtype:
                grad_weight.addmm_(grad_logits.t(), chunk)
            elif need_weight:
                grad_weight += grad_logits.t() @ chunk
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _vocab_backward(hidden, weight, bias, targets, lse, grad_losses, need_hidden, need_weight, need_bias):
    """The backward a slice of the vocabulary at a time, all rows at once (see the module's docstring)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cols = min(vocab, max(1, CHUNK_ELEMENTS // max(1, n)))
    # Every slice is finished by one matmul over all rows: no float32 copy of the weight's or the bias's gradient.
    grad_weight = torch.empty_like(weight) if need_weight else None
    grad_bias = torch.empty_like(bias) if need_bias else None
    # What accumulates here is the hidden states' gradient, in float32: a bf16 sum would round once per slice.
    grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if need_hidden else None
    buffer = torch.empty(n * cols, dtype=torch.float32, device=hidden.device)  # reused, as `_logits_buffer`
    for v0 in range(0, vocab, cols):
        v1 = min(v0 + cols, vocab)
        slice_weight, slice_bias = weight[v0:v1], None if bias is None else bias[v0:v1]
        logits = _chunk_logits(hidden, slice_weight, slice_bias, buffer[: n * (v1 - v0)].view(n, v1 - v0))
        grad_logits = logits.sub_(lse[:, None]).exp_()  # softmax ...
        # ... - one-hot, for the rows whose target is in this slice; the others add 0 (no mask to count: no sync).
        local = targets - v0
        inside = (local >= 0) & (local < v1 - v0)
        grad_logits.scatter_add_(1, local.clamp(0, v1 - v0 - 1)[:, None], inside[:, None].to(torch.float32).neg())
        grad_logits.mul_(grad_losses[:, None])
        if need_bias:
            grad_bias[v0:v1] = grad_logits.sum(dim=0)
        grad_logits = grad_logits.to(weight.dtype)
        if need_hidden and grad_hidden.dtype == weight.dtype:
            grad_hidden.addmm_(grad_logits, slice_weight)
        elif need_hidden:
            grad_hidden += grad_logits @ slice_weight
        if need_weight:  # hidden and weight share one dtype (`linear_cross_entropy` casts both)
            torch.mm(grad_logits.t(), hidden, out=grad_weight[v0:v1])
    grad_hidden = grad_hidden.to(hidden.dtype) if need_hidden else None
    return grad_hidden, grad_weight, grad_bias


def _logits_buffer(hidden: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    # One float32 buffer for every chunk: a fresh (rows, vocab) tensor per chunk made the loop about 10% slower on
    # the CPU above (page faults).
    return torch.empty(min(rows, hidden.shape[0]), weight.shape[0], dtype=torch.float32, device=hidden.device)


def _chunk_logits(hidden, weight, bias, buffer) -> torch.Tensor:
    out = buffer[: hidden.shape[0]]
    if weight.dtype != torch.float32:  # the matmul in bf16/fp16, as F.linear's; the softmax in float32
        return out.copy_(F.linear(hidden, weight, bias))
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)


class HeadCall(TorchFunctionMode):
    """While started (`start(hidden)`, by `training.loss.output_layer_at`), `F.linear` applied to the very tensor
    `hidden` (the output layer's input at the loss positions) returns `on_call(hidden, weight, bias)` instead of
    logits (kept as `result`); every other call runs as usual. `linear_losses` is the SFT loss's; distillation's
    heads (`tunebook.distillation.losses`) are others.

    transformers models apply the LM head to every position; in SFT the prompt tokens (a third of Code Alpaca's)
    and the padding carry no loss, yet their logits cost a vocabulary-wide matmul, softmax and backward each. The
    hook sits on the head inside the (DDP/FSDP-wrapped) model, so distributed wrappers see an ordinary forward,
    and the head's weight is the gathered one.
    """

    def __init__(self, on_call):
        super().__init__()
        self.on_call = on_call
        self.hidden = self.result = None
        self.started = False

    def start(self, hidden: torch.Tensor) -> None:
        self.hidden, self.started = hidden, True
        self.__enter__()

    def stop(self) -> None:
        if self.started:
            self.started = False
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self.result is None:
            call = dict(zip(("input", "weight", "bias"), args), **kwargs)
            if call["input"] is self.hidden:
                self.result = self.on_call(self.hidden, call["weight"], call.get("bias"))
                return self.result
        return func(*args, **kwargs)


def linear_losses(targets: torch.Tensor, temperature: float = 1.0) -> HeadCall:
    """The `HeadCall` whose output layer returns `linear_cross_entropy` of `hidden` against `targets` (its
    `result`: each position's float32 cross-entropy) instead of logits, of the logits divided by `temperature`
    if that is not 1."""

    def losses(hidden, weight, bias):
        if temperature != 1.0:  # logits / T is F.linear(hidden / T, weight, bias / T)
            hidden = hidden / temperature
            bias = None if bias is None else bias / temperature
        return linear_cross_entropy(hidden, weight, bias, targets)

    return HeadCall(losses)
