"""Content-addressed embedding cache: each distinct sentence is embedded once per encoder configuration.

Third stage of the data flow (loader -> encoder -> **cache** -> signals -> adapters). Layout:

    <root>/<key>/manifest.json              the encoder manifest the key was computed from
    <root>/<key>/shards/<id>.npy            (m, d) raw pooled vectors
    <root>/<key>/shards/<id>.json           {"n", "dim", "dtype", "checksum", "text_hashes"}

`key` hashes the parts of `FrozenEncoder.manifest()` that determine the vectors (encoder id,
revision, weights fingerprint, pooling, tau_attn, max length, dtype, encoding-path version; the
prompt and a non-torch backend when set), so a changed manifest never reads old vectors. A shard's
JSON is written last and names the checksum of its array: a truncated or corrupt shard is detected
on load, dropped with a warning, and its sentences are re-encoded, never silently used.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from embed_lib.config import EncoderConfig, default_cache_dir
from embed_lib.data.tasks import PairData, distinct_texts

log = logging.getLogger(__name__)

#: manifest fields that decide the vectors (library versions are recorded, not keyed)
KEY_FIELDS = ("encoder", "resolved_path", "revision", "weights_fingerprint", "pooling", "normalize_dropped",
              "tau_attn", "max_seq_length", "dtype", "dim", "encoder_path_version")
#: fields keyed only when present (see EncoderConfig.prompt and EncoderConfig.backend)
OPTIONAL_KEY_FIELDS = ("prompt", "backend", "quantization")


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def cache_key(manifest: Mapping[str, Any]) -> str:
    missing = [f for f in KEY_FIELDS if f not in manifest]
    if missing:
        raise ValueError(f"Encoder manifest lacks {missing}; expected the fields {list(KEY_FIELDS)}.")
    fields = {f: manifest[f] for f in KEY_FIELDS}
    # only when set: caches made without a prompt, or with the torch backend, keep their keys
    fields.update({f: manifest[f] for f in OPTIONAL_KEY_FIELDS if manifest.get(f)})
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def manifest_mismatch(trained: Mapping[str, Any], here: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (trained, here)} where two encoder manifests give different vectors; {} when they agree."""
    if cache_key(trained) == cache_key(here):
        return {}
    return {f: (trained.get(f), here.get(f)) for f in (*KEY_FIELDS, *OPTIONAL_KEY_FIELDS) if trained.get(f) != here.get(f)}


def _checksum(arr: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(arr).data, digest_size=16).hexdigest()


def atomic_write(path: Path, write) -> None:
    """write(fh) into a file of this call's own beside `path`, then renamed over it: a reader sees the old file or
    the new one whole, and two processes writing the same path at once never write into one file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def one_at_a_time(path: Path, what: str, progress: Callable[[str], None]) -> Iterator[None]:
    """Held while this process makes what `path` caches (a teacher: minutes of training), through `<path>.lock`: a
    second process making the same waits for the first, then finds its cache (two sweeps of one task started together
    each trained the teacher, at half speed on a machine's shared cores). A process that dies releases its lock."""
    from filelock import FileLock, Timeout  # lazy: only a cache miss needs it

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(f"{path}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        progress(f"{what}: another process is making it (lock {path}.lock); waiting for it, then reading its result")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def encoder_for(manifest: Mapping[str, Any], **overrides: Any):
    """The FrozenEncoder that reproduces a trained model's vectors (`EncoderConfig.from_manifest`; overrides:
    batch_size, device), loaded and checked against `manifest`: a ValueError naming each field that differs."""
    from embed_lib.encoding.encoders import FrozenEncoder  # lazy: reading the cache never loads torch's model code

    enc = FrozenEncoder(EncoderConfig.from_manifest(dict(manifest), **overrides))
    diff = manifest_mismatch(manifest, enc.manifest())
    if diff:
        raise ValueError("The encoder available here differs from the one this adapter was trained on "
                         f"(field: (trained, here) = {diff}).")
    return enc

@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupt_shards: list[str] = field(default_factory=list)


class EmbeddingCache:
    """Vectors of sentences for one encoder manifest (see module docstring)."""

    def __init__(self, manifest: Mapping[str, Any], root: str | Path | None = None) -> None:
        if not isinstance(manifest, Mapping):
            raise TypeError(f"EmbeddingCache(manifest) takes an encoder manifest (a mapping: FrozenEncoder.manifest(), "
                            f"or a saved adapter's encoder_manifest.json); got {type(manifest).__name__}.")
        self.manifest = dict(manifest)
        self.key = cache_key(self.manifest)
        self.root = Path(root).absolute() if root is not None else default_cache_dir()
        self.dir = self.root / self.key
        self.shard_dir = self.dir / "shards"
        self.dim = int(self.manifest["dim"])
        self.stats = CacheStats()

    def _write_manifest(self) -> None:
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "manifest.json"
        if path.exists():
            stored = json.loads(path.read_text())
            if cache_key(stored) != self.key:  # a hand-edited or foreign directory: never mix
                raise ValueError(f"{path} describes another encoder (key {cache_key(stored)} != {self.key}); "
                                 "remove that directory or use another cache root.")
            return
        atomic_write(path, lambda fh: fh.write(json.dumps(self.manifest, indent=2, sort_keys=True).encode()))

    def _load_shards(self) -> tuple[dict[str, tuple[int, int]], list[np.ndarray]]:
        """Index text hash -> (shard number, row) over every valid shard."""
        index: dict[str, tuple[int, int]] = {}
        arrays: list[np.ndarray] = []
        if not self.shard_dir.is_dir():
            return index, arrays
        for meta_path in sorted(self.shard_dir.glob("*.json")):
            data_path = meta_path.with_suffix(".npy")
            try:
                meta = json.loads(meta_path.read_text())
                arr = np.load(data_path, allow_pickle=False)
                ok = (arr.shape == (meta["n"], self.dim) and arr.dtype == np.float32
                      and len(meta["text_hashes"]) == meta["n"] and _checksum(arr) == meta["checksum"])
            except (OSError, ValueError, KeyError, EOFError) as exc:
                ok, meta = False, {"error": str(exc)}
            if not ok:
                log.warning("Embedding cache shard %s is corrupt or truncated; dropping it and re-encoding "
                            "its sentences.", data_path)
                self.stats.corrupt_shards.append(data_path.name)
                for p in (meta_path, data_path):
                    p.unlink(missing_ok=True)
                continue
            s = len(arrays)
            arrays.append(arr)
            for row, h in enumerate(meta["text_hashes"]):
                index.setdefault(h, (s, row))
        return index, arrays

    def _write_shard(self, hashes: list[str], vectors: np.ndarray) -> None:
        self._write_manifest()
        sid = uuid.uuid4().hex[:16]
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        atomic_write(self.shard_dir / f"{sid}.npy", lambda fh: np.save(fh, vectors, allow_pickle=False))
        meta = {"n": len(hashes), "dim": self.dim, "dtype": "float32", "checksum": _checksum(vectors),
                "text_hashes": hashes}
        # the JSON is the commit marker: a shard without it is never read
        atomic_write(self.shard_dir / f"{sid}.json", lambda fh: fh.write(json.dumps(meta).encode()))

    def get(self, texts: Sequence[str], encoder=None) -> np.ndarray:
        """Vectors (n, d) float32 for `texts`; missing sentences are encoded with `encoder` and stored.

        encoder: a FrozenEncoder with this cache's manifest, or a zero-argument callable returning one
        (so a full cache hit never loads the model). None: every sentence must be cached already.
        """
        hashes = [text_hash(t) for t in texts]
        index, arrays = self._load_shards()
        missing = list(dict.fromkeys(h for h in hashes if h not in index))
        self.stats.hits += len(hashes) - sum(h not in index for h in hashes)
        self.stats.misses += len(missing)
        if missing:
            if encoder is None:
                raise KeyError(f"{len(missing)} sentence(s) are not in the embedding cache {self.dir} and no "
                               "encoder was given to embed them.")
            enc = encoder() if callable(encoder) and not hasattr(encoder, "encode") else encoder
            if cache_key(enc.manifest()) != self.key:
                raise ValueError("The encoder given does not match this cache's manifest (different weights, "
                                 "tau_attn, max length or dtype); build the cache from that encoder's manifest.")
            first = {h: t for h, t in zip(hashes, texts)}
            new = enc.encode([first[h] for h in missing])
            self._write_shard(missing, new)
            s = len(arrays)
            arrays.append(new)
            index.update({h: (s, row) for row, h in enumerate(missing)})
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        loc = np.array([index[h] for h in hashes])  # (n, 2): shard, row
        for s, arr in enumerate(arrays):
            sel = np.nonzero(loc[:, 0] == s)[0]
            if len(sel):
                out[sel] = arr[loc[sel, 1]]
        return out


@dataclass(frozen=True)
class EmbeddedSplit:
    """A split as row indices into a shared matrix of sentence vectors."""

    data: PairData
    ia: np.ndarray  # (n,) rows of sentence1
    ib: np.ndarray  # (n,) rows of sentence2


@dataclass(frozen=True)
class EmbeddedTask:
    """All splits of a task over one matrix of distinct sentences (what trials and diagnostics read)."""

    task: str
    vectors: np.ndarray  # (m, d) raw pooled vectors of the distinct sentences
    texts: list[str]
    splits: dict[str, EmbeddedSplit]
    manifest: dict[str, Any]

    def pair_vectors(self, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s = self.splits[split]
        return self.vectors[s.ia], self.vectors[s.ib], s.data.label


def embed_task(splits: Mapping[str, PairData], cache: EmbeddingCache, encoder=None) -> EmbeddedTask:
    """Embed every distinct sentence of the given splits once (through the cache)."""
    if not isinstance(splits, Mapping) or not isinstance(cache, EmbeddingCache):
        raise TypeError(f"embed_task(splits, cache) takes {{split name: PairData}} (load_splits) and an EmbeddingCache "
                        f"(EmbeddingCache(encoder.manifest())); got {type(splits).__name__} and "
                        f"{type(cache).__name__}.")
    texts = distinct_texts(splits)
    row = {t: i for i, t in enumerate(texts)}
    vectors = cache.get(texts, encoder)
    out = {name: EmbeddedSplit(d, np.array([row[t] for t in d.sentence1], dtype=np.int64),
                               np.array([row[t] for t in d.sentence2], dtype=np.int64))
           for name, d in splits.items()}
    task = next(iter(splits.values())).task if splits else ""
    return EmbeddedTask(task, vectors, texts, out, dict(cache.manifest))
