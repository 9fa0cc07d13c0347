from __future__ import annotations

import numpy as np
import pytest

from embed_lib.tasks import load_splits
from embed_lib.teacher import TeacherConfig, teacher_key, teacher_scores

TINY = TeacherConfig(folds=2, epochs=1, batch_size=8, max_length=32)


@pytest.fixture(scope="module")
def tiny_splits(data_dir):
    return {k: v.subset(24) for k, v in load_splits("stsb", data_dir=data_dir).items()}


def test_cross_fitted_teacher_scores_and_cache(tiny_splits, tmp_path):
    scores, record = teacher_scores(tiny_splits, TINY, tmp_path)
    assert {k: len(v) for k, v in scores.items()} == {"train": 24, "validation": 24, "test": 24}
    assert all(np.isfinite(v).all() and ((v > 0) & (v < 1)).all() for v in scores.values())
    assert [f["held_out"] for f in record["folds"]] == [12, 12]  # every train pair scored out of fold
    assert all(f["fit_pairs"] + f["held_out"] == 24 for f in record["folds"])
    again, record2 = teacher_scores(tiny_splits, TINY, tmp_path)  # cache hit: same numbers, no training
    assert record2 == record
    np.testing.assert_array_equal(again["train"], scores["train"])


def test_key_depends_on_config_and_data(tiny_splits):
    k = teacher_key(TINY, tiny_splits)
    assert teacher_key(TeacherConfig(folds=3, batch_size=8, max_length=32), tiny_splits) != k
    fewer = {name: d.subset(20) for name, d in tiny_splits.items()}
    assert teacher_key(TINY, fewer) != k


def test_teacher_errors(tiny_splits, tmp_path):
    with pytest.raises(ValueError, match="TeacherConfig.folds=1; allowed 2..20"):
        TeacherConfig(folds=1)
    with pytest.raises(ValueError, match=r"needs the splits train, validation and test; missing \['test'\]"):
        teacher_scores({k: v for k, v in tiny_splits.items() if k != "test"}, TINY, tmp_path)
    with pytest.raises(ValueError, match="Could not load cross-encoder '/no/such/ce'"):
        teacher_scores(tiny_splits, TeacherConfig(model="/no/such/ce", pretrained=True), tmp_path)
