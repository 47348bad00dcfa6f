"""`torch_compile`: regional compilation of the transformer blocks, where it pays back, and a watch on recompiles.

Compiling the whole model takes minutes and recompiles on every change of the loss code around it; compiling one
block class lets every block reuse its graph (torchtune and torchtitan do the same: the compile time is that of one
block). Each block's `forward` is replaced by its compiled version, so parameter names, checkpoints and the saved
model do not change, and what runs around a forward stays eager and outside the graph: FSDP2's all-gather hooks,
gradient checkpointing, DDP. Compilation is lazy: the first training step traces a block with whatever LoRA layers
it has by then.

Evaluation and generation run eagerly (`torch.compiler.set_stance("force_eager")`): their shapes (a KV cache that
grows by one token per step, padded evaluation batches) would each compile graphs of their own, for a few calls.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

import torch

from .. import compat
from ..models.fused_cpu import set_fused_cpu_layers
from ..models.wrappers import unwrap

__all__ = ["AUTO_MIN_MICRO_BATCHES", "CompiledBlocks", "compile_blocks", "compile_model", "eager", "should_compile"]

logger = logging.getLogger("tunebook")


def _frames_compiled() -> int:
    return compat.compiled_frames()[0]


def _frames_failed() -> int:
    ok, total = compat.compiled_frames()  # frames dynamo started but did not convert (errors, under fallback)
    return total - ok


class CompiledBlocks:
    """What `compile_blocks` compiled, and the recompiles it has seen since the first step."""

    def __init__(self, blocks: int, block_class: str, static: bool = False, fallback: bool = False):
        self.blocks, self.block_class, self.static, self.fallback = blocks, block_class, static, fallback
        self._start, self._failed_at_start = _frames_compiled(), _frames_failed()
        self._after_first_step: int | None = None
        self._warned = 0

    def step_done(self) -> None:
        """Call after each optimizer step: the first one's compiles are expected, later ones are recompiles."""
        if self._after_first_step is None:
            self._after_first_step = _frames_compiled()
            if self.fallback and self.failures:
                logger.warning("torch_compile auto: %s code failed to compile %d time(s) (the errors are logged "
                               "above) and runs eagerly there", self.block_class, self.failures)  # fmt: skip
            else:
                logger.info("torch.compile: %d graph(s) for %d %s blocks in the first step", self.graphs,
                            self.blocks, self.block_class)  # fmt: skip
        elif self.recompiles > self._warned:
            self._warned = self.recompiles
            logger.warning("torch.compile recompiled (%d so far): shapes or guards changed between steps; "
                           "TORCH_LOGS=recompiles says why", self.recompiles)  # fmt: skip

    @property
    def shapes(self) -> str:
        return "static" if self.static else "dynamic"

    @property
    def graphs(self) -> int:
        return _frames_compiled() - self._start

    @property
    def failures(self) -> int:
        return _frames_failed() - self._failed_at_start

    @property
    def recompiles(self) -> int:
        return 0 if self._after_first_step is None else _frames_compiled() - self._after_first_step

    def summary(self) -> dict:
        return {"torch_compile_blocks": self.blocks, "torch_compile_shapes": self.shapes,
                "torch_compile_graphs": self.graphs, "torch_compile_recompiles": self.recompiles,
                "torch_compile_failures": self.failures}  # fmt: skip


# `torch_compile: auto` compiles where it was measured to pay back. On an H100 the Llama-3.2-1B shape with packed rows
# of 2048 (static graphs) ran 1.27x eager's tokens/s, for ~10 s more before the first step: even after ~100 optimizer
# steps of 2 micro-batches (benchmarks/RESULTS.md, gpu_vs_peers). A smaller model saves less per step for about the
# same compile, hence the margin. Where batches change shape the blocks need dynamic graphs, which ran 16% slower than
# eager there; on a 2-core CPU the first compile costs ~15 s for 6-10% per step (section compile_cpu).
AUTO_MIN_MICRO_BATCHES = 1000


def should_compile(config, accelerator, static: bool, micro_batches: int) -> tuple[bool, str]:
    """Whether this run compiles its blocks, and why (for the log). `torch_compile: true`/`false` are followed as
    given; `auto` compiles only on CUDA, with batches of one shape (`static`), for at least
    `AUTO_MIN_MICRO_BATCHES` micro-batches per process, and not with what compiled blocks were not tested with on a
    GPU (DeepSpeed's hooks, Liger's Triton kernels, bitsandbytes' 4-bit layers)."""
    if config.torch_compile != "auto":
        return bool(config.torch_compile), f"torch_compile: {str(config.torch_compile).lower()}"
    from accelerate.utils import DistributedType

    device = accelerator.device.type
    if device != "cuda":
        why = f"on {device}, where the first compile pays back only on long runs: set torch_compile: true for those"
    elif not static:
        why = "batches change shape (padding), where dynamic graphs ran slower than eager"
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        why = "compiled blocks are not tested under DeepSpeed"
    elif getattr(config, "use_liger_kernel", False):
        why = "Liger's kernels already fuse the blocks' layers"
    elif getattr(config, "load_in_4bit", False):
        why = "bitsandbytes' 4-bit layers"
    elif not has_triton():
        why = "no Triton for inductor's CUDA kernels"
    elif micro_batches < AUTO_MIN_MICRO_BATCHES:
        why = f"{micro_batches:,} micro-batches, fewer than the {AUTO_MIN_MICRO_BATCHES:,} that pay the first compile back"
    else:
        return True, f"torch_compile auto: on (CUDA, batches of one shape, {micro_batches:,} micro-batches)"
    return False, f"torch_compile auto: off ({why})"


def has_triton() -> bool:
    """Whether inductor can build CUDA kernels here (Triton ships with torch's Linux CUDA wheels, not elsewhere)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: instances of the most numerous class transformers names in `_no_split_modules`
    (what FSDP wraps one by one: LlamaDecoderLayer, BertLayer, ...)."""
    inner = unwrap(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft
    names = set(compat.no_split_modules(base))
    # By class lineage: FSDP2 swaps a sharded block's class for a subclass (FSDPLlamaDecoderLayer).
    found: dict[str, list[torch.nn.Module]] = {}
    for module in base.modules():
        name = next((c.__name__ for c in type(module).__mro__ if c.__name__ in names), None)
        if name is not None:
            found.setdefault(name, []).append(module)
    # The repeated class only (BertEmbeddings is also in BERT's list, once).
    return max(found.values(), key=len) if found else []


BACKEND = "inductor"  # torch.compile's backend (tests put a failing one here)


def compile_blocks(model: torch.nn.Module, static: bool = False, fallback: bool = False) -> CompiledBlocks:
    """Compile every transformer block of `model` in place: its `forward` becomes the compiled one.

    `static`: every batch has one shape (packed rows under torch_compile: `PackedCollator`'s `row_length` and
    `rows`), so the first step compiles graphs specialised to it, as torchtune and torchtitan do. Otherwise (padded
    batches, whose length changes every step) the shapes are dynamic from the start (`dynamic=True`): with torch's
    default a static graph would be compiled first and then recompiled for the second length. A static graph also
    compiles faster (a 4-layer 256-wide Llama on 2 CPU cores: 12 s against 18 s).

    `fallback` (torch_compile: auto): a block that fails to compile runs eagerly, with a warning, instead of stopping
    the run; a run the user did not ask to compile should not end where eager would have trained (dynamo's
    `suppress_errors`, set only while a block runs: the process's setting stays as it was).
    """
    blocks = transformer_blocks(model)
    if not blocks:
        from ..errors import ConfigError

        raise ConfigError(
            f"torch_compile: no transformer blocks found in {type(unwrap(model)).__name__} "
            "(its _no_split_modules names none); set torch_compile: false"
        )
    # As in a fresh process: dynamo keeps the graphs of every earlier compile of this block class's code in the process
    # (a notebook's earlier runs, other models) and past its recompile limit (8) runs the code eagerly, saying so only
    # in a warning, so a run would report 0 graphs and train at eager speed. Only this code's graphs are dropped: the
    # caller's other compiled code keeps its own (`torch.compiler.reset()` would drop them all).
    compat.forget_compiled_code(blocks[0].forward)
    for block in blocks:
        # transformers' own code, which inductor fuses: the fused CPU layers step aside under compilation anyway, and
        # their attention `forward` (a copy with other globals) is not one dynamo can guard.
        set_fused_cpu_layers(block, False)
        compiled = torch.compile(block.forward, dynamic=None if static else True, backend=BACKEND)
        block.forward = _falling_back(compiled) if fallback else compiled
    name = next(c.__name__ for c in type(blocks[0]).__mro__ if not c.__name__.startswith("FSDP"))
    return CompiledBlocks(len(blocks), name, static, fallback)


def _falling_back(compiled):
    """`compiled`, run with dynamo's `suppress_errors` on: code that fails to compile runs eagerly, with a warning."""

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        with compat.suppress_compile_errors():
            return compiled(*args, **kwargs)

    return forward


def compile_model(config, accelerator, model, train_loader, micro_batches: int, log) -> CompiledBlocks | None:
    """`torch_compile` (true, or auto where it pays back): compile the prepared model's transformer blocks in place,
    after the model is wrapped and any frozen reference copied from it; `micro_batches` is the run's forward passes
    per process (`auto` weighs the first compile against them). Returns what was compiled, or None (eager)."""
    if not config.torch_compile:
        return None
    from ..data.loaders import fixed_batch_shape

    static = fixed_batch_shape(train_loader) is not None
    compile_it, why = should_compile(config, accelerator, static, micro_batches)
    if config.torch_compile == "auto":
        log.info(why)
    if not compile_it:
        return None
    compiled = compile_blocks(model, static=static, fallback=config.torch_compile == "auto")
    log.info("torch_compile: %d %s blocks, compiled in the first step (%s shapes)", compiled.blocks,
             compiled.block_class, compiled.shapes)  # fmt: skip
    return compiled


_eager_lock = threading.Lock()
_eager_users: list = []  # the one set_stance context while any thread is inside `eager()`, and how many are


@contextlib.contextmanager
def eager():
    """A context in which compiled blocks run their plain Python code (evaluation, generation).

    Counted across threads: torch's stance is process-wide, so GRPO's async generation (a thread) and an evaluation
    on the main thread would otherwise each restore the stance the other set, and could leave the whole process
    forced eager for good. The stance goes back when the last user leaves (meanwhile compiled training runs eagerly
    too: async generation and torch_compile overlap less)."""
    if not hasattr(torch.compiler, "set_stance"):
        yield
        return
    with _eager_lock:
        if not _eager_users:
            stance = torch.compiler.set_stance("force_eager")
            stance.__enter__()
            _eager_users.append(stance)
        _eager_users.append(None)
    try:
        yield
    finally:
        with _eager_lock:
            _eager_users.pop()
            if len(_eager_users) == 1:
                _eager_users.pop().__exit__(None, None, None)
