"""A small pair data set the tests make when neither the mirror nor the Hugging Face Hub is there.

It has the mirror's layout and columns (`stsb/{train,validation,test}.parquet` with 0..5 scores;
`mrpc/...` with 0/1 labels; `paws/validation.parquet`; `qqp/train_subset.parquet` with question
columns), so every loader, cache and job reads it the way it reads the real data. Sentences are
"<subject> <action><place>." with two wordings of each subject and action; a pair's graded score
says how much of the scene the two sentences share (same subject and action, worded differently: ~5;
same action only: ~3; same subject only: ~1.5; nothing: ~0.3), plus seeded noise. Binary tasks
label a pair 1 when its score is >= 3.5. Everything is a pure function of the seed: the same files
(and so the same embedding-cache entries) every run.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

SUBJECTS = [("A man", "A guy"), ("A woman", "A lady"), ("A child", "A kid"), ("A dog", "A puppy"),
            ("Two men", "A pair of men"), ("A cat", "A kitten"), ("A girl", "A young girl"),
            ("An old man", "An elderly man"), ("A chef", "A cook"), ("A teenager", "A teen")]
ACTIONS = [("is playing a guitar", "plays the guitar"), ("is riding a horse", "rides a horse"),
           ("is cutting an onion", "slices an onion"), ("is swimming in a pool", "swims in a pool"),
           ("is reading a book", "reads a book"), ("is running on a beach", "runs along the beach"),
           ("is cooking pasta", "makes pasta"), ("is climbing a wall", "climbs a wall"),
           ("is painting a fence", "paints a fence"), ("is eating an apple", "eats an apple"),
           ("is singing on stage", "sings on a stage"), ("is driving a car", "drives a car"),
           ("is dancing in the rain", "dances in the rain"), ("is writing a letter", "writes a letter"),
           ("is fixing a bike", "repairs a bicycle"), ("is walking a dog", "walks a dog")]
PLACES = ["", " in the park", " at home", " near the river", " in the city", " at night"]
#: (same subject, same action) -> mean score on the 0..5 scale
SCORES = {(True, True): 4.6, (False, True): 3.0, (True, False): 1.5, (False, False): 0.3}
#: rows per file; the derived PAWS / QQP files are split 70/15/15 by the loader
SIZES = {("stsb", "train"): 600, ("stsb", "validation"): 200, ("stsb", "test"): 200,
         ("mrpc", "train"): 300, ("mrpc", "validation"): 100, ("mrpc", "test"): 100,
         ("paws", "validation"): 400, ("qqp", "train_subset"): 400}
BINARY_THRESHOLD = 3.5


def _sentence(rng: np.random.Generator, subject: int, action: int, place: int) -> str:
    return f"{SUBJECTS[subject][rng.integers(2)]} {ACTIONS[action][rng.integers(2)]}{PLACES[place]}."


def make_pairs(n: int, seed: int) -> pd.DataFrame:
    """n pairs with graded scores in [0, 5] (columns sentence1, sentence2, score)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        s, a, p = rng.integers(len(SUBJECTS)), rng.integers(len(ACTIONS)), rng.integers(len(PLACES))
        same_s, same_a = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
        s2 = s if same_s else (s + 1 + rng.integers(len(SUBJECTS) - 1)) % len(SUBJECTS)
        a2 = a if same_a else (a + 1 + rng.integers(len(ACTIONS) - 1)) % len(ACTIONS)
        p2 = p if rng.random() < 0.5 else rng.integers(len(PLACES))
        score = SCORES[(same_s, same_a)] - 0.4 * (p2 != p) + rng.normal(0, 0.3)
        rows.append((_sentence(rng, s, a, p), _sentence(rng, s2, a2, p2), float(np.clip(score, 0, 5))))
    return pd.DataFrame(rows, columns=["sentence1", "sentence2", "score"])


def write_mirror(root: Path, seed: int = 0) -> Path:
    """Write the made data set under root in the mirror's layout; returns root."""
    for i, ((task, stem), n) in enumerate(sorted(SIZES.items())):
        pairs = make_pairs(n, seed * 1000 + i)
        if task == "stsb":
            table = pairs.rename(columns={"score": "label"})
        else:
            table = pairs.assign(label=(pairs.score >= BINARY_THRESHOLD).astype("int64")).drop(columns="score")
            if task == "qqp":
                table = table.rename(columns={"sentence1": "question1", "sentence2": "question2"})
        table.insert(0, "idx", np.arange(len(table)))
        (root / task).mkdir(parents=True, exist_ok=True)
        table.to_parquet(root / task / f"{stem}.parquet", index=False)
    return root
