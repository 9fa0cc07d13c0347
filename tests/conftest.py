from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("EMBED_DATA_DIR", REPO.parent / "shared" / "data")).absolute()
os.environ["EMBED_DATA_DIR"] = str(DATA_DIR)
# tests share one embedding cache (the encodes are the slow part); Makefile sets the same default
CACHE_DIR = Path(os.environ.setdefault("EMBED_CACHE_DIR", str(REPO / ".cache" / "embed_lib")))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA_DIR / "stsb" / "train.parquet").is_file():
        pytest.fail(f"data mirror not found at {DATA_DIR}; set EMBED_DATA_DIR")
    return DATA_DIR


@pytest.fixture(scope="session")
def encoder():
    from embed_lib.encoders import FrozenEncoder

    return FrozenEncoder()


@pytest.fixture(scope="session")
def stsb_embedded(data_dir):
    """STS-B, all splits, through the shared cache (encodes once per machine)."""
    from embed_lib.cache import EmbeddingCache, embed_task
    from embed_lib.study import LazyEncoder
    from embed_lib.config import EncoderConfig
    from embed_lib.tasks import load_splits

    lazy = LazyEncoder(EncoderConfig())
    cache = EmbeddingCache(lazy.manifest(CACHE_DIR), CACHE_DIR)
    return embed_task(load_splits("stsb", data_dir=data_dir), cache, lazy)
