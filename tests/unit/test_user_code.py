"""A user's `path/to/file.py:function`: loaded once per process and version of the file."""

from __future__ import annotations

import os

from tunebook.user_code import load_function


def test_a_file_runs_once_per_process_until_it_changes(tmp_path):
    """The config check, the recipe's config load and the run each ask for a reward file: its import-time code
    (a download, a print) runs once; an edited file runs again."""
    runs = tmp_path / "runs.txt"
    reward = tmp_path / "rewards.py"
    reward.write_text(f"open({str(runs)!r}, 'a').write('ran\\n')\ndef score(prompts, completions, **kw):\n"
                      "    return [1.0] * len(completions)\n")  # fmt: skip
    first = load_function(f"{reward}:score", "reward function")
    assert load_function(f"{reward}:score", "reward function") is first
    assert runs.read_text() == "ran\n"
    reward.write_text(reward.read_text().replace("1.0", "2.0"))
    os.utime(reward, ns=(0, reward.stat().st_mtime_ns + 1_000_000))  # a new version, however fast the edit
    assert load_function(f"{reward}:score", "reward function")(["p"], ["c"]) == [2.0]
    assert runs.read_text() == "ran\nran\n"
