"""The intermediate stage as shards averaged every few steps (embed_lib.teacher.shards), in real spawned processes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from embed_lib.data.tasks import load_splits
from embed_lib.teacher import intermediate as I
from embed_lib.teacher import recipe, shards
from embed_lib.teacher.config import TeacherConfig, teacher_preset
from embed_lib.teacher.scores import teacher_key

CFG = TeacherConfig(max_length=32, intermediate="mrpc", intermediate_pairs=100, stage_shards=2, seed=3)
STAGE = dataclasses.replace(I.stage_config(CFG), batch_size=8)  # 4 pairs a step in each shard: 3 steps each


@pytest.fixture(scope="module")
def stage_pairs(data_dir):
    d = load_splits("mrpc", ("train",), data_dir=data_dir)["train"].subset(24)
    return [[a, b] for a, b in zip(d.sentence1, d.sentence2)], d.label.astype(np.float32)


def _trained(ce) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in ce.model.named_parameters() if p.requires_grad}


def test_shard_rows_deal_every_pair_to_exactly_one_shard():
    rows = shards.shard_rows(11, 3, seed=5)
    assert sorted(np.concatenate(rows).tolist()) == list(range(11))
    assert sorted(len(r) for r in rows) == [3, 4, 4]
    assert all((a == b).all() for a, b in zip(rows, shards.shard_rows(11, 3, seed=5)))  # seeded
    assert any((a != b).any() for a, b in zip(rows, shards.shard_rows(11, 3, seed=6)))


def test_the_stage_is_the_mean_of_its_shards_and_averaging_mid_run_keeps_them_together(stage_pairs, tmp_path):
    """No average inside the run (sync_every beyond its steps): the saved model is, weight for weight, the mean of the
    two shards each trained alone from the same start, here in this process. Averaging after every step takes
    another path."""
    pairs, y = stage_pairs
    curve, never = shards.fit_shards(CFG, STAGE, pairs, y, "cpu", tmp_path / "never", lambda m: None,
                                     sync_every=10**6)
    assert never["shards"] == 2 and [r["averages"] for r in never["shard_records"]] == [1, 1]
    assert [r["pairs"] for r in never["shard_records"]] == [12, 12] and curve[0]["epoch"] == 1
    alone, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # as each shard's process has it on 2 cores (rounding)
    try:
        for k, rows in enumerate(shards.shard_rows(len(pairs), 2, CFG.seed)):
            ce = recipe.load(CFG, "cpu", seed=CFG.seed)
            recipe.fit(ce, [pairs[i] for i in rows], y[rows], dataclasses.replace(STAGE, batch_size=4),
                       CFG.seed * 1000 + k)
            alone.append(_trained(ce))
    finally:
        torch.set_num_threads(threads)
    saved = _trained(recipe.load(CFG, "cpu", start=str(tmp_path / "never")))
    assert alone[0].keys() == saved.keys()
    moved = 0
    for name, weight in saved.items():
        torch.testing.assert_close(weight, (alone[0][name] + alone[1][name]) / 2, atol=2e-6, rtol=1e-5)
        moved += not torch.allclose(alone[0][name], alone[1][name])
    assert moved > 10  # the two shards did train apart: the mean is not either of them

    _, every = shards.fit_shards(CFG, STAGE, pairs, y, "cpu", tmp_path / "every", lambda m: None, sync_every=1)
    assert [r["averages"] for r in every["shard_records"]] == [4, 4]  # after each of the 3 steps, and at the end
    synced = _trained(recipe.load(CFG, "cpu", start=str(tmp_path / "every")))
    assert any(not torch.allclose(synced[n], saved[n]) for n in saved)


def test_the_shards_are_part_of_the_stage_and_the_fast_recipe(data_dir):
    fast = teacher_preset("fast")
    assert fast.stage_shards == 2 and teacher_preset("light").stage_shards == 1
    d = load_splits("stsb", ("train",), data_dir=data_dir)["train"].subset(30)
    one = dataclasses.replace(fast, stage_shards=1)
    assert I.stage_key(fast, {"train": d}) != I.stage_key(one, {"train": d})
    assert teacher_key(fast, {"train": d}) != teacher_key(one, {"train": d})
    with pytest.raises(ValueError, match="stage_shards"):
        TeacherConfig(stage_shards=0)
