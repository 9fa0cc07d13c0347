"""Side-by-side measurements (speed, memory, quality-cost): each script prints its figures and writes them to
results/benchmarks/<name>.json. Run as `python benchmarks/<name>.py` or `python -m benchmarks.<name>`."""
