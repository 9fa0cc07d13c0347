"""The serving ingress's caches, without Ray: LRU bounds, projection cache, warming the near cache from the
encoder after a cold start."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest


def _ingress(**args):
    """The Ingress class itself (under Serve's ASGI wrapper, whose async __init__ starts the FastAPI app)."""
    from serving.app import Ingress

    cls = Ingress.func_or_class.__mro__[1]
    assert cls.__name__ == "Ingress" and "ASGI" not in cls.__init__.__qualname__
    return cls(_FakeEncoder(), None, args, None)


class _FakeEncoder:
    """Stands in for the Encoder deployment's handle: `embed.remote(texts)` -> (n, 4) vectors."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        outer = self

        class _Embed:
            def remote(self, texts):
                outer.calls.append(list(texts))

                async def result():
                    return np.stack([np.full(4, len(t), np.float32) for t in texts])
                return result()
        self.embed = _Embed()


def test_lru_is_bounded_and_counts_hits_and_misses():
    from serving.app import LRU

    cache = LRU(2)
    for t in ("a", "b", "c"):
        cache.put(t, np.zeros(1))
    found, missing = cache.get_many(["a", "b", "c", "c"])
    assert set(found) == {"b", "c"} and missing == ["a"]  # "a" evicted first; duplicates counted once
    assert cache.stats() == {"size": 2, "capacity": 2, "hits": 2, "misses": 1, "hit_rate": 2 / 3}
    cache.get_many(["b"])
    cache.put("d", np.zeros(1))  # "c" is now the least recently used
    assert "c" not in cache and "b" in cache
    off = LRU(0)
    off.put("a", np.zeros(1))
    assert off.stats()["size"] == 0


def test_projection_cache_reuses_projections_and_matches_the_plain_path():
    import torch

    from embed_lib.adapters import PairAdapter
    from embed_lib.export import ensemble_scores
    from serving.app import LRU, Ingress

    model = PairAdapter("pair_gated", 8, [0, 1]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    texts = [f"t{i}" for i in range(6)]
    vectors = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    cache = LRU(100)
    ia, ib = [0, 1, 2], [3, 4, 5]
    plain = ensemble_scores(model, vectors[ia], vectors[ib])["score"]
    for expected_misses in (6, 6):  # the second request computes nothing new
        h = Ingress.func_or_class._projections(model, cache, texts, vectors)
        assert h.shape == (2, 6, model.norm.weight.shape[-1])
        assert cache.stats()["misses"] == expected_misses
        np.testing.assert_allclose(ensemble_scores(model, vectors[ia], vectors[ib], h[:, ia], h[:, ib])["score"],
                                   plain, rtol=0, atol=1e-6)
    assert cache.stats()["hits"] == 6


def test_a_cold_start_warms_the_near_cache_from_the_encoder(tmp_path, encoder):
    corpus = tmp_path / "corpus.txt"
    texts = [f"never embedded before, sentence {i} of the cold corpus" for i in range(5)]
    corpus.write_text("\n".join(texts) + "\n")
    ingress = _ingress(warm_corpus=str(corpus))
    ingress.manifest = encoder.manifest()
    ingress._warm_near(str(corpus))  # not in the embedding cache: nothing read, the corpus kept for later
    assert ingress.near.stats()["size"] == 0 and ingress._pending_warm == texts

    async def health_check_then_wait():
        await ingress.check_health()
        await ingress._warm_task
        await ingress.check_health()  # nothing pending any more: no second fetch

    asyncio.run(health_check_then_wait())
    assert ingress.encoder.calls == [texts]
    found, missing = ingress.near.get_many(texts)
    assert not missing and found[texts[0]][0] == len(texts[0])


@pytest.mark.parametrize("bad", [{"projection_cache_size": -1}, {"cache_size": "many"}])
def test_app_args_reject_bad_cache_sizes(bad):
    from pydantic import ValidationError

    from serving.app import AppArgs

    with pytest.raises(ValidationError, match=next(iter(bad))):
        AppArgs.model_validate(bad)
