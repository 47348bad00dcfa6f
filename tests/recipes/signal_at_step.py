"""recipes/sft.py (or $SIGNAL_RECIPE), with a real SIGTERM delivered to the main process right after optimizer step $SIGNAL_AT_STEP (the
other processes learn of it through the loop's agreement on stop requests). Test scaffolding: it wraps the recipe
from outside, as `tunebook train tests/recipes/signal_at_step.py ...`."""

import os
import signal

from tunebook import load_recipe
from tunebook.config import load_config

if __name__ == "__main__":
    sft = load_recipe(os.environ.get("SIGNAL_RECIPE", "sft"))
    after_step, step = sft.module.after_step, int(os.environ["SIGNAL_AT_STEP"])

    def signal_then_after_step(run, loop, *args, **kwargs):
        if loop.state.global_step + 1 == step and run.accelerator.is_main_process:  # taken, not yet counted
            signal.raise_signal(signal.SIGTERM)
        return after_step(run, loop, *args, **kwargs)

    sft.module.after_step = signal_then_after_step
    sft.main(load_config(sft.config_class))
