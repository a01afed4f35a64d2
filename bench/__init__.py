"""Side-by-side and profiling scripts, each run from the repository root as `python -m bench.<name>`."""
