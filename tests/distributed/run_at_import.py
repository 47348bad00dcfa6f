"""recipes/sft.py's run started when this script is imported, not under `if __name__ == "__main__":`
(test_launch.py): each DataLoader worker of a multi-process run imports the launched script."""

from tunebook import load_recipe
from tunebook.config import load_config

sft = load_recipe("sft")
sft.main(load_config(sft.config_class))
