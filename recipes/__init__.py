"""The recipes, importable as `tunebook.recipes.<name>` (src/tunebook/recipes links here); see `tunebook.load_recipe`."""
