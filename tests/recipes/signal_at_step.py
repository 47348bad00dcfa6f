"""recipes/sft.py (or $SIGNAL_RECIPE), with a real SIGTERM delivered to the main process right after optimizer step $SIGNAL_AT_STEP (the
other processes learn of it through the loop's agreement on stop requests). Test scaffolding: it wraps the recipe
from outside, as `tunebook train tests/recipes/signal_at_step.py ...`."""

import os
import signal

from tunebook import load_recipe
from tunebook.config import load_config

if __name__ == "__main__":
    sft = load_recipe(os.environ.get("SIGNAL_RECIPE", "sft"))
    apply_update, step = sft.module.apply_update, int(os.environ["SIGNAL_AT_STEP"])

    def apply_then_signal(run, step_loss, window):
        updated = apply_update(run, step_loss, window)
        if run.state.global_step == step and run.accelerator.is_main_process:
            signal.raise_signal(signal.SIGTERM)
        return updated

    sft.module.apply_update = apply_then_signal
    sft.main(load_config(sft.config_class))
