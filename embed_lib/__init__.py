"""embed_lib: pair-level adapters over frozen sentence embeddings.

Everything scientific lives here and runs without Ray: task loaders (`tasks`), the frozen
encoder (`encoders`), the content-addressed embedding cache (`cache`), metrics (`metrics`) and
the experiment configuration (`config`). `sweeps/` and `serving/` import this package, never
the reverse.
"""
from __future__ import annotations

__version__ = "0.1.0"
