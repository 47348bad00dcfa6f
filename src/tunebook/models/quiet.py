"""Known-harmless library notices, filtered locally (on their own logger, while a call runs) and only where harmless.

DeepSpeed, when installed, is imported by whatever first calls accelerate's `extract_model_from_parallel` (every
`save_pretrained` does, through transformers' `unwrap_model`), and its import logs `[WARNING] [real_accelerator.py]
Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.` on stdout, once per
process. On a machine without CUDA that is simply true, and it is noise in `tunebook export` or `convert-gguf`, which
never use DeepSpeed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["deepspeed_cpu_notice_filtered"]

DEEPSPEED_LOGGER = "DeepSpeed"  # deepspeed.utils.logging's logger (its own stdout handler, not propagated)


class _CpuAcceleratorNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Setting accelerator to CPU"):
            return True
        import torch

        return torch.cuda.is_available()  # with a GPU deepspeed failed to see, the warning stays


@contextlib.contextmanager
def deepspeed_cpu_notice_filtered() -> Iterator[None]:
    """While inside, DeepSpeed's "Setting accelerator to CPU" warning is dropped on a machine without CUDA; its
    logger is left as it was on leaving."""
    notice = _CpuAcceleratorNotice()
    logger = logging.getLogger(DEEPSPEED_LOGGER)  # the object deepspeed's LoggerFactory configures when imported
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)
