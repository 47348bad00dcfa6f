"""Know before you launch: a run's memory per device and its speed, planned from its config (`tunebook plan`).

`memory.plan` is the plan; `architecture` builds the model from its config.json as fake tensors, `trace` counts
the bytes of its step, `layout` reads the accelerate config, `hardware` knows the GPUs, `workloads` what each
recipe's micro-batch is, `recommend` what to change when it does not fit, `flops` the model FLOPs and MFU.
"""

from .hardware import GPUS, Hardware, hardware, parse_memory
from .layout import Layout, read_layout
from .memory import PARTS, Plan, plan

__all__ = ["GPUS", "PARTS", "Hardware", "Layout", "Plan", "hardware", "parse_memory", "plan", "read_layout"]
