"""The ingress replica's near cache warmed with the app's `warm_corpus`: from the embedding cache embed_lib built
when the corpus is there whole, else (a cold start: the encoder replica is still encoding it) from the encoder
deployment, in the background, once Serve's first health check runs. A mixin of `serving.app.Ingress`, whose
`scorer`, `encoder`, `manifest` and `args` it reads.
"""
from __future__ import annotations

import asyncio
import logging

from embed_lib.encoding.cache import EmbeddingCache
from serving.deployments import corpus_texts

log = logging.getLogger("ray.serve")


class NearCacheWarming:
    _pending_warm: list[str] | None = None  # corpus to fetch from the encoder (see check_health)
    _warm_task: asyncio.Task | None = None

    def _warm_near(self, corpus: str) -> None:
        texts = corpus_texts(corpus, self.args.warm_corpus_columns)
        try:
            vectors = EmbeddingCache(self.manifest).get(texts)  # no encoder here: only what is cached
        except KeyError:
            # a cold start: the encoder replica is still encoding the corpus; fetch it from there later
            log.info("%s is not fully in the embedding cache yet: the near cache warms from the encoder", corpus)
            self._pending_warm = texts
            return
        self.scorer.add_vectors(texts, vectors)

    async def check_health(self) -> None:
        """Serve's periodic health check; after a cold start it also begins warming the near cache from the
        encoder deployment, in the background."""
        if self._pending_warm:
            texts, self._pending_warm = self._pending_warm, None
            self._warm_task = asyncio.create_task(self._warm_near_from_encoder(texts))

    async def _warm_near_from_encoder(self, texts: list[str], chunk: int = 1024) -> None:
        try:
            for i in range(0, len(texts), chunk):
                part = [t for t in texts[i: i + chunk] if t not in self.scorer.near]
                if part:
                    self.scorer.add_vectors(part, await self.encoder.embed.remote(part))
            log.info("near cache warmed from the encoder: %d sentences", len(texts))
        except Exception:  # the service works without it: warm requests then make one hop more
            log.exception("warming the near cache from the encoder failed")

    def near_cache_warming(self) -> bool:
        """Whether the warm corpus is still on its way from the encoder into this replica (after a cold start)."""
        return bool(self._pending_warm) or bool(self._warm_task and not self._warm_task.done())
