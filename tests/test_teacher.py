from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from embed_lib.teacher import config as TC
from embed_lib.teacher import scores as T
from embed_lib.teacher import backbone, recipe
from embed_lib.teacher import intermediate as I
from embed_lib.data.tasks import load_splits
from embed_lib.teacher.config import TeacherConfig
from embed_lib.teacher.scores import teacher_key, teacher_scores
from embed_lib.teacher.intermediate import warm_start

TINY = TeacherConfig(folds=2, epochs=2, batch_size=8, max_length=32, early_stopping_fraction=0.25)


@pytest.fixture(scope="module")
def tiny_splits(data_dir):
    return {k: v.subset(24) for k, v in load_splits("stsb", data_dir=data_dir).items()}


def test_cross_fitted_teacher_scores_and_cache(tiny_splits, tmp_path):
    # another recipe's teacher cached for the task (make run's fast one) is named when this one is to be trained
    (tmp_path / "teacher").mkdir()
    for name, rec in (("f", {"task": "stsb", "preset": "fast"}), ("q", {"task": "qqp", "preset": "light"}),
                      ("bad", "not a record")):
        (tmp_path / "teacher" / f"{name}.json").write_text(json.dumps(rec))
    said = []
    scores, record = teacher_scores(tiny_splits, TINY, tmp_path, progress=said.append)
    assert said[0] == (f"teacher: the custom recipe is not cached for this data (key {record['key']}); training it, "
                       "the longest step on a CPU, cached for later runs (cached here for stsb: the fast recipe, "
                       "--teacher-preset fast)")
    assert {k: len(v) for k, v in scores.items()} == {"train": 24, "validation": 24, "test": 24}
    assert all(np.isfinite(v).all() for v in scores.values())
    assert [f["held_out"] for f in record["folds"]] == [12, 12]
    # 12 fit rows per fold: 3 of them (25%) held out for early stopping, never trained on
    assert [(f["fit_pairs"], f["early_stopping_pairs"]) for f in record["folds"]] == [(9, 3), (9, 3)]
    assert all(1 <= f["epochs_run"] <= 2 and len(f["curve"]) == f["epochs_run"] for f in record["folds"])
    assert record["preset"] == "custom" and record["train_pairs_per_s"] > 0
    again, record2 = teacher_scores(tiny_splits, TINY, tmp_path)  # cache hit: same numbers, no training
    assert record2 == record
    np.testing.assert_array_equal(again["train"], scores["train"])
    # a record cached under a preset's name that the presets no longer give its recipe reads with today's name
    meta = tmp_path / "teacher" / f"{record['key']}.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "preset": "fast"}))
    assert teacher_scores(tiny_splits, TINY, tmp_path)[1] == record


class _FakeCE:
    """Stands in for a CrossEncoder: remembers what it trained on, scores len(a) - 2 len(b) (asymmetric)."""

    def __init__(self):
        self.seen: set[tuple[str, str]] = set()

    def predict(self, pairs, **kw):
        return np.array([len(a) - 2.0 * len(b) for a, b in pairs])

    @staticmethod
    def tokenizer(a, b, **kw):  # a token per character, and three special ones
        return {"input_ids": [[0] * (len(x) + len(y) + 3) for x, y in zip(a, b)]}


def test_no_train_pair_is_scored_by_a_model_that_trained_on_it(tiny_splits, tmp_path, monkeypatch):
    made: list[_FakeCE] = []
    scored: list[tuple[_FakeCE, list]] = []

    def fake_load(cfg, device, start=None, seed=None):
        made.append(_FakeCE())
        return made[-1]

    def fake_fit(ce, pairs, y, cfg, seed, es_pairs=None, es_y=None, progress=None):
        ce.seen |= {tuple(p) for p in pairs} | {tuple(p) for p in (es_pairs or [])}
        return [{"epoch": 1, "train_loss": 0.0, "seconds": 1.0, "pairs_per_s": 1.0, "early_stopping_spearman": 0.0}]

    real_predict = recipe.predict

    def spy_predict(ce, pairs, cfg):
        scored.append((ce, [tuple(p) for p in pairs]))
        return real_predict(ce, pairs, cfg)

    monkeypatch.setattr(recipe, "load", fake_load)
    monkeypatch.setattr(recipe, "fit", fake_fit)
    monkeypatch.setattr(recipe, "predict", spy_predict)
    cfg = TeacherConfig(folds=3, epochs=1, batch_size=8, max_length=32, early_stopping_fraction=0.2)
    teacher_scores(tiny_splits, cfg, tmp_path)
    train = tiny_splits["train"]
    train_pairs = {(a, b) for a, b in zip(train.sentence1, train.sentence2)}
    fold_of = T.fold_assignment(len(train), 3, cfg.seed)  # the assignment itself, not the record
    assert len(made) == 3
    for k, ce in enumerate(made):
        own = {(train.sentence1[i], train.sentence2[i]) for i in np.nonzero(fold_of == k)[0]}
        assert not ce.seen & own  # fold k's model never saw fold k's pairs
        assert ce.seen <= train_pairs and len(ce.seen) == len(train) - len(own)
        scored_train = {p for c, ps in scored if c is ce for p in ps} & train_pairs
        assert scored_train == own  # and scores exactly them
    assert sorted(np.bincount(fold_of).tolist()) == [8, 8, 8]


def test_both_orders_are_averaged():
    ce = _FakeCE()
    pairs = [["ab", "abcd"], ["abcde", "a"]]
    one = recipe.predict(ce, pairs, TeacherConfig(both_orders=False))
    both = recipe.predict(ce, pairs, TeacherConfig(both_orders=True))
    np.testing.assert_allclose(one, [2 - 8, 5 - 2])
    np.testing.assert_allclose(both, [((2 - 8) + (4 - 4)) / 2, ((5 - 2) + (1 - 10)) / 2])
    np.testing.assert_allclose(recipe.predict(ce, [[b, a] for a, b in pairs], TeacherConfig()), both)


def test_length_batches_cover_every_index_once_and_group_lengths():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, size=1000)
    batches = recipe.length_batches(lengths, 16, np.random.default_rng(1), bucket_batches=50)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(1000))
    spread = np.mean([np.ptp(lengths[b]) for b in batches])
    random_spread = np.mean([np.ptp(lengths[b]) for b in np.array_split(rng.permutation(1000), 63)])
    assert spread < random_spread / 4


def test_bucketed_batch_loss_equals_unbucketed(tiny_splits):
    """Padding must not change a pair's logit: the loss of 8 pairs in one padded batch equals the
    size-weighted mean of the losses of two length-sorted batches."""
    cfg = TeacherConfig(max_length=64)
    ce = recipe.load(cfg, "cpu")
    ce.model.eval()
    train = tiny_splits["train"]
    pairs, y = T._pairs(train, np.arange(8)), torch.as_tensor(train.label[:8], dtype=torch.float32)
    loss = torch.nn.BCEWithLogitsLoss(reduction="sum")
    with torch.no_grad():
        whole = loss(recipe.logits(ce, pairs), y) / 8
        order = np.argsort([len(a) + len(b) for a, b in pairs])
        parts = sum(loss(recipe.logits(ce, [pairs[i] for i in idx]), y[idx]) for idx in (order[:4], order[4:])) / 8
    assert float(whole) == pytest.approx(float(parts), abs=1e-5)


def test_scoring_batches_pairs_by_their_tokens_and_gives_the_logits_of_sentence_transformers(tiny_splits,
                                                                                                monkeypatch):
    """The teacher scores in batches sorted by each pair's tokens as the model reads them ([CLS] a [SEP] b [SEP],
    truncated at max_length), not by its characters (sentence-transformers' own sort), with the same logits."""
    from embed_lib.encoding.batching import SLACK

    cfg = TeacherConfig(max_length=32)
    ce = recipe.load(cfg, "cpu", seed=0)
    # characters and tokens disagree: a long word is a few word pieces, each comma a token of its own
    pairs = [["a b", "c"], ["supercalifragilistic", "x"], [", , , , ,", "."], ["a " * 40, "b " * 40]]
    # super ##cal ##if ##rag ##ilis ##tic; five commas and a full stop; 83 tokens cut at 32
    assert recipe.token_lengths(ce, pairs, 32).tolist() == [3 + 3, 3 + 6 + 1, 3 + 5 + 1, 32]
    assert recipe.token_lengths(ce, [], 32).tolist() == [] and recipe.predict(ce, [], cfg).shape == (0,)

    val = T._pairs(tiny_splits["validation"]) + pairs
    kw = dict(batch_size=32, show_progress_bar=False, activation_fn=torch.nn.Identity())
    own_sort = (np.asarray(ce.predict(val, **kw)) + np.asarray(ce.predict([[b, a] for a, b in val], **kw))) / 2
    batches, real = [], ce.predict
    monkeypatch.setattr(ce, "predict", lambda ps, **k: batches.append(ps) or real(ps, **k))
    np.testing.assert_allclose(recipe.predict(ce, val, dataclasses.replace(cfg, batch_size=4)), own_sort, atol=1e-5)
    # each batch holds at most 32 pairs, none shorter than its longest / (1 + SLACK), longest batches first
    lengths = [recipe.token_lengths(ce, b, 32) for b in batches]
    assert sum(map(len, batches)) == 2 * len(val) and max(map(len, batches)) <= 32
    assert all(x.max() <= x.min() * (1 + SLACK) for x in lengths) and lengths[0].max() == 32


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = recipe.param_groups(model, 0.01)
    assert decay["weight_decay"] == 0.01 and [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


def test_error_correlation_and_rank_average():
    y = np.arange(10.0)
    s0 = y.copy()
    s0[[2, 7]] = s0[[7, 2]]  # the cosine swaps two pairs
    assert T.error_correlation(s0, s0, y) == pytest.approx(1.0)
    teacher = y.copy()
    teacher[[0, 9]] = teacher[[9, 0]]  # the teacher errs elsewhere
    assert T.error_correlation(teacher, s0, y) < 0.1
    np.testing.assert_allclose(T.rank_average(y, y), np.arange(10) / 9)


def test_presets():
    assert TC.preset_of(TC.teacher_preset("strong")) == "strong"
    assert TC.preset_of(TC.teacher_preset("light", model="minilm")) == "light"
    assert TC.teacher_preset("light").epochs == 1
    fast = TC.teacher_preset("fast")
    assert TC.preset_of(fast) == "fast" and TC.preset_of(TC.teacher_preset("light")) == "light"  # not one another
    assert (fast.precision, fast.freeze_embeddings, fast.folds, fast.lr) == ("bf16", True, 2, 1e-4)
    assert {TC.teacher_preset(p).dropout for p in TC.PRESETS} == {None}  # the model's own dropout in the folds
    assert {p: TC.teacher_preset(p).stage_dropout for p in TC.PRESETS} == {"strong": None, "light": None, "fast": 0.0}
    assert [I.stage_config(TC.teacher_preset(p)).dropout for p in ("strong", "fast")] == [None, 0.0]
    assert I.stage_config(TeacherConfig(dropout=0.2)).dropout == 0.2  # no stage_dropout: the teacher's
    assert I.stage_config(dataclasses.replace(fast, dropout=0.2)).dropout == 0.0  # the stage's own wins
    # otherwise the light recipe: one epoch per fold, no early stopping, the same stage's tasks and pairs
    fast_rest = {k: v for k, v in dataclasses.asdict(fast).items() if k not in {*TC.LATER_FIELDS, "folds", "lr"}}
    assert fast_rest == {k: v for k, v in dataclasses.asdict(TC.teacher_preset("light")).items()
                         if k not in {*TC.LATER_FIELDS, "folds", "lr"}}
    assert TC.teacher_preset("light").intermediate == TC.teacher_preset("strong").intermediate == "others"
    assert TC.teacher_preset("light", intermediate="").intermediate == ""  # a stage can be switched off
    assert TC.teacher_preset("strong", model="x", pretrained=True).intermediate == ""  # nothing to train
    with pytest.raises(ValueError, match=r"Unknown teacher preset 'huge'. Valid presets: "
                                         r"\['fast', 'light', 'strong'\]"):
        TC.teacher_preset("huge")


def test_key_depends_on_config_and_data(tiny_splits):
    k = teacher_key(TINY, tiny_splits)
    assert teacher_key(TeacherConfig(folds=3, batch_size=8, max_length=32), tiny_splits) != k
    fewer = {name: d.subset(20) for name, d in tiny_splits.items()}
    assert teacher_key(TINY, fewer) != k


def test_teacher_errors(tiny_splits, tmp_path):
    with pytest.raises(ValueError, match="TeacherConfig.folds=1; allowed 2..20"):
        TeacherConfig(folds=1)
    with pytest.raises(ValueError, match=r"TeacherConfig.early_stopping_fraction=0.9 is out of range"):
        TeacherConfig(early_stopping_fraction=0.9)
    with pytest.raises(ValueError, match=r"needs the splits train, validation and test; missing \['test'\]"):
        teacher_scores({k: v for k, v in tiny_splits.items() if k != "test"}, TINY, tmp_path)
    with pytest.raises(ValueError, match="Could not load cross-encoder '/no/such/ce': no such file or directory"):
        teacher_scores(tiny_splits, TeacherConfig(model="/no/such/ce", pretrained=True), tmp_path)
    if os.environ.get("HF_HUB_OFFLINE") == "1":  # the packaged model's Hub id, offline: the alias is named
        with pytest.raises(ValueError, match=r"Could not load cross-encoder 'sentence-transformers/all-MiniLM-L6-v2'"
                                             r" .*[^.]\. sentence-transformers/all-MiniLM-L6-v2 is the model of the "
                                             r"alias 'minilm'.*: give 'minilm' \(--teacher minilm\) to load it"):
            recipe.load(TeacherConfig(model="sentence-transformers/all-MiniLM-L6-v2"), "cpu")


def test_the_intermediate_stage_reads_only_other_tasks_train_pairs(tiny_splits, data_dir, tmp_path, monkeypatch):
    made: list[tuple[_FakeCE, str | None]] = []

    def fake_load(cfg, device, start=None, seed=None):
        made.append((_FakeCE(), start))
        made[-1][0].save_pretrained = lambda path, **kw: __import__("os").makedirs(path)
        return made[-1][0]

    def fake_fit(ce, pairs, y, cfg, seed, es_pairs=None, es_y=None, progress=None):
        ce.seen |= {tuple(p) for p in pairs} | {tuple(p) for p in (es_pairs or [])}
        ce.stage_cfg = cfg
        return [{"epoch": 1, "train_loss": 0.0, "seconds": 1.0, "pairs_per_s": 1.0, "early_stopping_spearman": 0.0}]

    monkeypatch.setattr(recipe, "load", fake_load)
    monkeypatch.setattr(recipe, "fit", fake_fit)
    cfg = TeacherConfig(folds=2, epochs=1, batch_size=8, max_length=32, intermediate="others", intermediate_pairs=150)
    _, record = teacher_scores(tiny_splits, cfg, tmp_path)
    stage, *folds = made
    assert stage[1] is None and len(folds) == 2  # the stage starts from the backbone; both folds from the stage
    assert {start for _, start in folds} == {str(tmp_path / "teacher" / "intermediate" / record["intermediate"]["key"])}
    assert record["intermediate"]["tasks"] == ["mrpc", "paws", "qqp"] and record["intermediate"]["pairs"] == 450
    allowed = set()
    for task in ("mrpc", "paws", "qqp"):
        d = load_splits(task, ("train",), data_dir=data_dir)["train"]
        allowed |= set(zip(d.sentence1, d.sentence2))
    assert len(stage[0].seen) == 450 and stage[0].seen <= allowed  # train splits only: never validation or test
    stsb = {tuple(p) for d in tiny_splits.values() for p in zip(d.sentence1, d.sentence2)}
    assert not stage[0].seen & stsb
    assert (stage[0].stage_cfg.epochs, stage[0].stage_cfg.both_orders) == (1, False)
    made.clear()
    teacher_scores(tiny_splits, dataclasses.replace(cfg, folds=3), tmp_path)  # another teacher, the same stage
    assert [start for _, start in made] == [folds[0][1]] * 3


def test_intermediate_stage_rules_and_keys(tiny_splits, tmp_path):
    with pytest.raises(ValueError, match="includes the teacher's own task 'stsb': its train pairs are the folds' "
                                         "held-out pairs"):
        teacher_key(TeacherConfig(intermediate="qqp,stsb"), tiny_splits)
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['qqq'\]"):
        TeacherConfig(intermediate="qqp,qqq")
    with pytest.raises(ValueError, match="a pretrained teacher is not trained"):
        TeacherConfig(pretrained=True, intermediate="others")
    with pytest.raises(ValueError, match=r"intermediate stage reads the train split of 'qqp' and could not: .*"
                                         r"skip the stage with --teacher-intermediate ''"):
        I._train_split("qqp", tmp_path / "no-mirror")
    with_stage = teacher_key(TeacherConfig(intermediate="others"), tiny_splits)
    assert with_stage != teacher_key(TeacherConfig(), tiny_splits)
    assert with_stage != teacher_key(TeacherConfig(intermediate="others", intermediate_pairs=500), tiny_splits)
    assert with_stage == teacher_key(TeacherConfig(intermediate="paws,mrpc,qqp"), tiny_splits)
    # a teacher without the stage keeps the key it had before the stage existed (its cache stays valid)
    # and so does one that leaves the fields added later (precision, freeze_embeddings) at their defaults
    old = {k: v for k, v in dataclasses.asdict(TINY).items()
           if not k.startswith("intermediate") and k not in TC.LATER_FIELDS}
    prints = {k: v.fingerprint for k, v in sorted(tiny_splits.items())}
    blob = json.dumps({"teacher": old, "version": 2, "data": prints}, sort_keys=True)
    assert teacher_key(TINY, tiny_splits) == hashlib.sha256(blob.encode()).hexdigest()[:20]


def test_later_fields_enter_the_keys_only_when_set(tiny_splits):
    bf16, frozen = dataclasses.replace(TINY, precision="bf16"), dataclasses.replace(TINY, freeze_embeddings=True)
    layers, no_dropout = dataclasses.replace(TINY, freeze_layers=3), dataclasses.replace(TINY, dropout=0.0)
    assert len({teacher_key(c, tiny_splits) for c in (TINY, bf16, frozen, layers, no_dropout)}) == 5
    staged = TeacherConfig(intermediate="others")
    stage_keys = {I.stage_key(c, tiny_splits) for c in
                  (staged, dataclasses.replace(staged, precision="bf16"), dataclasses.replace(staged, dropout=0.0),
                   dataclasses.replace(staged, freeze_embeddings=True), dataclasses.replace(staged, freeze_layers=3))}
    assert len(stage_keys) == 5  # a stage trained in bf16, without dropout, with frozen embeddings or layers: another
    # a stage trained at some dropout is the same stage however the config says so; the folds' dropout is the teacher's
    stage_only, everywhere = dataclasses.replace(staged, stage_dropout=0.0), dataclasses.replace(staged, dropout=0.0)
    assert I.stage_key(stage_only, tiny_splits) == I.stage_key(everywhere, tiny_splits)
    assert I.stage_key(dataclasses.replace(everywhere, stage_dropout=0.1), tiny_splits) == I.stage_key(
        dataclasses.replace(staged, dropout=0.1), tiny_splits) != I.stage_key(staged, tiny_splits)
    assert len({teacher_key(c, tiny_splits) for c in (staged, stage_only, everywhere)}) == 3
    # the stage trains one epoch on one order, whatever the folds' epochs: the same stage
    assert I.stage_key(dataclasses.replace(staged, epochs=3), tiny_splits) == I.stage_key(
        staged, tiny_splits)
    with pytest.raises(ValueError, match=r"TeacherConfig.precision='fp16'; give one of \['fp32', 'bf16'\]"):
        TeacherConfig(precision="fp16")


def _fit_tiny(tiny_splits, cfg):
    ce = recipe.load(cfg, "cpu", None)
    train = tiny_splits["train"]
    torch.manual_seed(0)
    torch.nn.init.normal_(ce.model.classifier.weight, std=0.02)  # the same fresh head for every call
    torch.nn.init.zeros_(ce.model.classifier.bias)
    before = {n: p.detach().clone() for n, p in ce.model.named_parameters()}
    curve = recipe.fit(ce, T._pairs(train), train.label, cfg, seed=0)
    return ce, before, curve


def test_frozen_embeddings_stay_as_the_backbone_has_them_and_the_rest_trains(tiny_splits):
    cfg = TeacherConfig(epochs=1, batch_size=8, max_length=32, both_orders=False, early_stopping_fraction=0.0,
                        freeze_embeddings=True)
    ce, before, _ = _fit_tiny(tiny_splits, cfg)
    table = ce.model.get_input_embeddings().weight
    name = next(n for n, p in ce.model.named_parameters() if p is table)
    assert torch.equal(table, before[name])
    changed = [n for n, p in ce.model.named_parameters() if not torch.equal(p, before[n])]
    assert any("encoder.layer.0." in n for n in changed) and any("classifier" in n for n in changed)
    assert name not in changed


def test_frozen_layers_keep_the_embedding_block_and_the_first_layers_and_train_the_rest(tiny_splits):
    cfg = TeacherConfig(epochs=1, batch_size=8, max_length=32, both_orders=False, early_stopping_fraction=0.0,
                        freeze_layers=2)
    ce, before, _ = _fit_tiny(tiny_splits, cfg)
    changed = {n for n, p in ce.model.named_parameters() if not torch.equal(p, before[n])}
    frozen = {n for n in before if ".embeddings." in n or ".encoder.layer.0." in n or ".encoder.layer.1." in n}
    assert frozen and not frozen & changed  # position and type embeddings and their norm too, not only the table
    assert any(".encoder.layer.2." in n for n in changed) and any(".encoder.layer.5." in n for n in changed)
    assert any("classifier" in n for n in changed)
    # the backward pass stops above the frozen layers: nothing below layer 2 holds a gradient
    assert all(p.grad is None for n, p in ce.model.named_parameters() if n in frozen)


def test_frozen_layers_refuse_a_model_without_that_many(tiny_splits):
    ce = recipe.load(TINY, "cpu", None)
    for too_many in (6, 7):  # all 6 frozen would leave only the head to train
        with pytest.raises(ValueError, match=rf"freeze_layers={too_many}, but the model has 6 layers: give at most 5"):
            backbone.freeze_bottom(ce.model, too_many)
    with pytest.raises(ValueError, match=r"no embedding block and layer list to freeze: set freeze_layers=0"):
        backbone.freeze_bottom(torch.nn.Sequential(torch.nn.Linear(2, 2)), 1)
    with pytest.raises(ValueError, match=r"TeacherConfig.freeze_layers=-1"):
        TeacherConfig(freeze_layers=-1)


def test_the_dropout_setting_reaches_every_dropout_and_without_dropout_a_training_step_is_deterministic(tiny_splits):
    ce = recipe.load(TINY, "cpu", None)
    pairs = T._pairs(tiny_splits["train"])[:8]
    ce.model.train()
    with torch.no_grad():
        assert not torch.equal(recipe.logits(ce, pairs), recipe.logits(ce, pairs))  # MiniLM's own dropout: 0.1
        backbone.set_dropout(ce.model, 0.0)
        assert torch.equal(recipe.logits(ce, pairs), recipe.logits(ce, pairs))
    assert {m.p for m in ce.model.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}

    class Attention(torch.nn.Module):  # transformers' newer attention blocks keep their dropout as a number
        def __init__(self):
            super().__init__()
            self.attention_dropout, self.dropout, self.scaling = 0.1, torch.nn.Dropout(0.1), 0.1

    block = Attention()
    backbone.set_dropout(block, 0.25)
    assert (block.attention_dropout, block.dropout.p, block.scaling) == (0.25, 0.25, 0.1)
    # the recipe sets it before training: fit leaves every dropout of the model at cfg.dropout
    cfg = TeacherConfig(epochs=1, batch_size=8, max_length=32, both_orders=False, early_stopping_fraction=0.0,
                        dropout=0.0)
    fitted, _, _ = _fit_tiny(tiny_splits, cfg)
    assert {m.p for m in fitted.model.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}
    with pytest.raises(ValueError, match=r"TeacherConfig.dropout=-0.1 is out of range; allowed None or \[0.0, 0.9\]"):
        TeacherConfig(dropout=-0.1)


def test_bf16_training_attends_through_the_math_kernel_which_the_model_s_dropout_takes_anyway(tiny_splits):
    from contextlib import nullcontext
    from torch.nn.attention import SDPBackend

    from embed_lib.teacher import packed

    cpu, q = torch.device("cpu"), torch.randn(2, 4, 8, 16, dtype=torch.bfloat16)
    math, fused = int(SDPBackend.MATH), int(SDPBackend.FLASH_ATTENTION)
    assert torch._fused_sdp_choice(q, q, q) == fused and torch._fused_sdp_choice(q, q, q, dropout_p=0.1) == math
    with recipe.training_attention("bf16", cpu):
        assert torch._fused_sdp_choice(q, q, q) == math
    with recipe.training_attention("fp32", cpu):  # fp32's fused kernel trained as fast (measured)
        assert torch._fused_sdp_choice(q, q, q) == fused
    # with the model's dropout, the same logits and random draws either way: the recipes' teachers are unchanged
    ce = recipe.load(TINY, "cpu", None)
    ce.model.train()
    pairs, outs = T._pairs(tiny_splits["train"])[:8], []
    for attention in (nullcontext(), recipe.training_attention("bf16", cpu)):
        torch.manual_seed(5)
        with torch.no_grad(), recipe.autocast("bf16", cpu), attention:
            outs.append((packed.training_logits(ce, pairs).float(), torch.get_rng_state()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_bf16_trains_in_bf16_where_the_device_has_it_and_in_fp32_where_not(tiny_splits, monkeypatch, caplog):
    cfg = TeacherConfig(epochs=1, batch_size=8, max_length=32, both_orders=False, early_stopping_fraction=0.0)
    bf16 = dataclasses.replace(cfg, precision="bf16")
    monkeypatch.setattr(recipe, "_cpu_has_bf16", lambda: False)
    assert recipe.effective_precision(bf16, torch.device("cpu")) == "fp32"
    with caplog.at_level("WARNING", logger=recipe.__name__):
        ce_fallback, _, curve = _fit_tiny(tiny_splits, bf16)
    assert curve[0]["precision"] == "fp32" and "asks for bf16 training" in caplog.text
    assert "AVX512-BF16 or AMX: " in caplog.text and "x the time of bf16" in caplog.text  # why, and what it costs
    ce_fp32, _, curve = _fit_tiny(tiny_splits, cfg)
    assert curve[0]["precision"] == "fp32"
    body = lambda ce: next(p for n, p in ce.model.named_parameters() if "encoder.layer.5." in n)  # noqa: E731
    assert torch.equal(body(ce_fallback), body(ce_fp32))  # the fallback is the fp32 recipe, bit for bit
    monkeypatch.setattr(recipe, "_cpu_has_bf16", lambda: True)  # bf16 emulated where the CPU lacks it: slow, valid
    ce_bf16, _, curve = _fit_tiny(tiny_splits, bf16)
    assert curve[0]["precision"] == "bf16"
    assert not torch.equal(body(ce_bf16), body(ce_fp32))  # autocast took effect
    assert body(ce_bf16).dtype == torch.float32  # the weights stay fp32


def test_an_isa_capped_below_bf16_is_no_native_bf16():
    capped = recipe.isa_capped_below_bf16
    assert not capped({})
    assert not capped({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "ATEN_CPU_CAPABILITY": "avx512"})
    assert not capped({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"})
    assert capped({"ONEDNN_MAX_CPU_ISA": "avx2"})  # oneDNN's matrix products without bf16
    assert capped({"DNNL_MAX_CPU_ISA": "AVX512_CORE_VNNI"})  # the older name
    assert capped({"ATEN_CPU_CAPABILITY": "avx2"}) and capped({"ATEN_CPU_CAPABILITY": "default"})  # torch's own
    # torch reads its cap at import: a process started with ATEN_CPU_CAPABILITY=avx2 trains in fp32 on any CPU
    code = ("import torch; from embed_lib.teacher import recipe, config; "
            "print(recipe.effective_precision(config.teacher_preset('fast'), torch.device('cpu')))")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "fp32"


def _pairs_of(task, split, pairs):
    from embed_lib.data.tasks import PairData
    y = np.linspace(0, 1, len(pairs)).astype(np.float32)
    return PairData(task, split, "made", split, False, [a for a, _ in pairs], [b for _, b in pairs], y, y,
                    np.arange(len(pairs)))


def test_the_stage_never_trains_on_a_pair_the_teacher_scores(tmp_path, monkeypatch):
    """Tasks share pairs (STS-B's MSRpar pairs are MRPC pairs), and a user's file may hold a built-in task's: the
    stage leaves out every pair of another task that is also a pair of any split the teacher scores, however it is
    ordered, cased or spaced, so that the folds' scores stay held out and the teacher's test pairs unseen."""
    stage = _pairs_of("mrpc", "train", [("A cat sits.", "A dog runs."), ("Stocks fell.", "Rain today."),
                                        ("markets  DROPPED.", "stocks fell."), ("A cat sits.", "A bird sings."),
                                        ("One.", "Two.")])
    own = {"train": _pairs_of("mine", "train", [("a dog runs.", "A cat sits."), ("Three.", "Four.")]),
           "validation": _pairs_of("mine", "validation", [("Five.", "Six.")]),
           "test": _pairs_of("mine", "test", [("Stocks fell.", "Markets dropped.")])}
    apart = {k: _pairs_of("mine", k, [("Seven.", "Eight.")]) for k in own}  # shares no pair with the stage
    monkeypatch.setattr(I, "_splits", lambda cfg, o: {"mrpc": stage})
    # rows 0 (the train pair, reversed and recased) and 2 (the test pair, respaced); a shared sentence is not a pair
    assert {t: r.tolist() for t, r in I.left_out({"mrpc": stage}, own).items()} == {"mrpc": [0, 2]}
    assert I.left_out({"mrpc": stage}, apart) == {}
    pairs, y = I._sample({"mrpc": stage}, 10, 0, I.left_out({"mrpc": stage}, own))
    assert sorted(map(tuple, pairs)) == [("A cat sits.", "A bird sings."), ("One.", "Two."),
                                         ("Stocks fell.", "Rain today.")]
    assert sorted(y.tolist()) == [0.25, 0.75, 1.0]
    # with nothing left out, the seeded sample it always drew (stages cached before keep their keys and models)
    rows = np.sort(np.random.default_rng(0).permutation(5)[:3])
    assert I._sample({"mrpc": stage}, 3, 0, {})[0] == [[stage.sentence1[i], stage.sentence2[i]] for i in rows]
    cfg = TeacherConfig(intermediate="mrpc", stage_shards=1)
    other = {k: _pairs_of("mine", k, [("Nine.", "Ten.")]) for k in own}
    # the task's own pairs enter the key only where they leave some out
    assert I.stage_key(cfg, apart) == I.stage_key(cfg, other)
    assert I.stage_key(cfg, own) != I.stage_key(cfg, apart)
    assert I.stage_key(cfg, own) != I.stage_key(cfg, {**own, "test": apart["test"]})  # another pair left out
    with pytest.raises(TypeError, match=r"needs every split the teacher scores, e\.g\. \{'train': \.\.\., "
                                        r"'validation'.*got PairData"):
        I.stage_key(cfg, own["train"])
    # the stage trains on what is left, and its record and progress say what was left out
    fitted = []

    class Saved:
        def save_pretrained(self, folder, safe_serialization):
            Path(folder).mkdir(parents=True)

    monkeypatch.setattr(I.recipe, "load", lambda cfg, device, seed: Saved())
    monkeypatch.setattr(I.recipe, "fit", lambda ce, pairs, y, stage_cfg, seed, progress: fitted.append(pairs) or [])
    said = []
    folder, record = warm_start(cfg, own, tmp_path, "cpu", said.append)
    assert sorted(map(tuple, fitted[0])) == sorted(map(tuple, pairs)) and record["pairs"] == 3
    assert record["left_out"] == {"mrpc": 2} and json.loads((Path(folder) / "intermediate.json").read_text())[
        "left_out"] == {"mrpc": 2}
    assert "intermediate stage: left out 2 mrpc train pairs that are also mine pairs (the teacher scores them)" in said


def test_the_stsb_teachers_stage_leaves_out_its_mrpc_pairs(data_dir, mirror_figures):
    """On the mirror: 683 MRPC train pairs are STS-B pairs (454 of its train split, 110 of validation, 119 of test);
    QQP's and PAWS's stages leave nothing out, and keep the keys they had."""
    from embed_lib.teacher.config import teacher_preset

    fast, stsb = teacher_preset("fast"), load_splits("stsb", data_dir=data_dir)
    stage = I._splits(fast, stsb)
    assert {t: len(r) for t, r in I.left_out(stage, stsb).items()} == {"mrpc": 683}
    assert [len(I.left_out(stage, {k: d}).get("mrpc", [])) for k, d in stsb.items()] == [454, 110, 119]
    qqp = load_splits("qqp", data_dir=data_dir)
    assert I.left_out(I._splits(fast, qqp), qqp) == {}


def test_a_real_intermediate_stage_round_trips_through_its_folder(tiny_splits, tmp_path):
    cfg = TeacherConfig(max_length=32, intermediate="mrpc", intermediate_pairs=100)
    folder, record = warm_start(cfg, tiny_splits, tmp_path, "cpu", lambda m: None)
    assert record["pairs"] == 100 and (Path(folder) / "intermediate.json").is_file()
    # no temporary folder left; the lock it was trained under stays (an empty file: a lock removed could be held twice)
    assert sorted(f.name for f in Path(folder).parent.iterdir()) == [Path(folder).name, Path(folder).name + ".lock"]
    pairs = [[a, b] for a, b in zip(tiny_splits["test"].sentence1, tiny_splits["test"].sentence2)]
    loaded = []
    for seed in (0, 1):  # a fresh head would differ between the two loads; the stage's trained head does not
        torch.manual_seed(seed)
        loaded.append(recipe.load(cfg, "cpu", folder))
    np.testing.assert_allclose(recipe.predict(loaded[0], pairs, cfg), recipe.predict(loaded[1], pairs, cfg), rtol=1e-5)
    body = lambda ce: next(p for n, p in ce.model.named_parameters() if "encoder.layer.0." in n)  # noqa: E731
    assert not torch.equal(body(loaded[0]), body(recipe.load(cfg, "cpu")))  # the body trained, and was saved
    # its new head is drawn from the seed: another fresh cache trains the same stage, whatever the global random state
    torch.manual_seed(123)
    again, _ = warm_start(cfg, tiny_splits, tmp_path / "another", "cpu", lambda m: None)
    np.testing.assert_array_equal(recipe.predict(recipe.load(cfg, "cpu", again), pairs, cfg),
                                  recipe.predict(loaded[0], pairs, cfg))


def test_the_stage_trains_at_its_own_dropout_and_the_folds_start_from_it_at_the_models(tiny_splits, tmp_path,
                                                                                      monkeypatch):
    fit, seen = recipe.fit, []

    def spy(ce, *args, **kwargs):
        curve = fit(ce, *args, **kwargs)
        seen.append({m.p for m in ce.model.modules() if isinstance(m, torch.nn.Dropout)})
        return curve

    monkeypatch.setattr(recipe, "fit", spy)
    cfg = TeacherConfig(max_length=32, intermediate="mrpc", intermediate_pairs=100, stage_dropout=0.0)
    folder, _ = warm_start(cfg, tiny_splits, tmp_path, "cpu", lambda m: None)
    assert seen == [{0.0}]  # the stage trained without dropout
    assert Path(folder).name == I.stage_key(dataclasses.replace(cfg, stage_dropout=None, dropout=0.0), tiny_splits)
    # what it saved keeps the model's own dropout: a fold loads the stage at MiniLM's 0.1 and trains so (dropout None)
    assert json.loads((Path(folder) / "config.json").read_text())["hidden_dropout_prob"] == 0.1
    fold = recipe.load(cfg, "cpu", folder)
    assert {m.p for m in fold.model.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}
    rows = np.arange(16)
    T.fit_on_rows(fold, tiny_splits["train"], rows, dataclasses.replace(cfg, epochs=1, batch_size=8,
                                                                        early_stopping_fraction=0.0), 0, 0,
                  lambda m: None)
    assert seen[1:] == [{0.1}]


def _write_teacher_cache_many_times(args):
    from embed_lib.teacher.scores import _write_cache

    folder, k = args
    npz, meta = Path(folder) / "t.npz", Path(folder) / "t.json"
    for i in range(150):
        _write_cache(npz, meta, {"train": np.full(300, k, np.float32)}, {"key": "t", "writer": k, "i": i})
    return k


def test_processes_writing_one_teacher_cache_at_once_all_succeed(tmp_path):
    """Two sweeps that trained the same teacher at once write the same cache files: each through files of its own
    (one fixed temporary file let the later writer's rename find it gone and fail, after the teacher's minutes)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(4) as pool:
        assert sorted(pool.map(_write_teacher_cache_many_times, [(str(tmp_path), k) for k in range(4)])) == [0, 1, 2, 3]
    with np.load(tmp_path / "t.npz") as f:
        assert len(set(f["train"].tolist())) == 1  # one writer's scores whole, never a mix
    assert json.loads((tmp_path / "t.json").read_text())["key"] == "t"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.npz"]


def test_a_stage_in_training_has_a_folder_of_its_own_and_a_dead_ones_is_removed(tmp_path):
    from embed_lib.teacher.intermediate import own_folder

    folder = tmp_path / "intermediate" / "abc"
    folder.parent.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = folder.with_name(f"abc.{int(dead.stdout)}.1234abcd.tmp")  # a stage whose process was killed
    alive = folder.with_name(f"abc.{os.getpid()}.5678abcd.tmp")  # one that another sweep is training now
    other = folder.with_name(f"abcd.{int(dead.stdout)}.1234abcd.tmp")  # another stage's
    for f in (left, alive, other):
        f.mkdir()
    a, b = own_folder(folder), own_folder(folder)
    assert a != b and a.parent == folder.parent and a.name.startswith(f"abc.{os.getpid()}.")
    assert not left.exists() and alive.exists() and other.exists()


def test_a_teacher_trained_elsewhere_is_cached_here_and_never_trained_again(tiny_splits, tmp_path, monkeypatch):
    """compute= (a Ray task on a GPU node in the sweeps): its scores and record come back and are cached where the
    caller runs; the next call reads them, training nothing."""
    calls = []

    def elsewhere(splits, cfg):
        calls.append(sorted(splits))
        return {k: np.full(len(d), 0.5, np.float32) for k, d in splits.items()}, {"key": teacher_key(cfg, splits),
                                                                                  "where": "a GPU node"}

    scores, record = teacher_scores(tiny_splits, TINY, tmp_path, compute=elsewhere)
    assert calls == [["test", "train", "validation"]] and record["where"] == "a GPU node"
    monkeypatch.setattr(T, "_cross_fit", lambda *a, **k: pytest.fail("trained again"))
    again, record2 = teacher_scores(tiny_splits, TINY, tmp_path)  # no compute: the cache written above
    assert record2["where"] == "a GPU node" and len(calls) == 1
    assert all(np.array_equal(again[k], scores[k]) for k in scores)


def test_processes_asking_at_once_for_one_teacher_train_it_once_and_the_others_wait(tiny_splits, tmp_path,
                                                                                    monkeypatch):
    """Two sweeps of one task started together each trained the teacher (minutes, at half speed on shared cores):
    the second now waits for the first and reads its cache. So does a second caller of the intermediate stage."""
    import threading

    calls, said = [], []

    def slow(splits, cfg):
        calls.append(threading.get_ident())
        time.sleep(1.5)
        return {k: np.full(len(d), 0.25, np.float32) for k, d in splits.items()}, {"key": teacher_key(cfg, splits)}

    def stage(cfg, split, folder, key, device, progress):
        calls.append(key)
        time.sleep(1.5)
        folder.mkdir(parents=True)
        (folder / "intermediate.json").write_text(json.dumps({"key": key}))
        return str(folder), {"key": key}

    monkeypatch.setattr("embed_lib.teacher.intermediate._train_stage", stage)
    staged = TeacherConfig(max_length=32, intermediate="mrpc", intermediate_pairs=100)
    jobs = [lambda: teacher_scores(tiny_splits, TINY, tmp_path, compute=slow, progress=said.append),
            lambda: warm_start(staged, tiny_splits, tmp_path / "stage", "cpu", said.append)]
    for job in jobs:
        out = []
        threads = [threading.Thread(target=lambda: out.append(job())) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)  # the first holds the lock
        for t in threads:
            t.join()
        assert len(calls) == 1 and len(out) == 2, (calls, out)
        first, second = (o[0] for o in out)  # the waiter's result is the maker's: scores, or the stage's folder
        assert all(np.array_equal(first[k], second[k]) for k in first) if isinstance(first, dict) else first == second
        assert "another process is making it" in said[-1]
        calls.clear()
    assert said[0].startswith("teacher ") and said[1].startswith("intermediate stage ")


def test_fold_plan_runs_big_cpu_folds_at_once_and_the_rest_here(monkeypatch):
    from embed_lib.teacher.workers import ENV, MIN_EXAMPLES_PER_FOLD as MIN, fold_plan
    monkeypatch.delenv(ENV, raising=False)
    assert fold_plan(3, MIN, "cpu", cores=2) == (3, 1)  # three one-thread processes share the 2 cores
    assert fold_plan(3, MIN, "cpu", cores=16) == (3, 5)
    assert fold_plan(10, MIN, "cpu", cores=2) == (4, 1)  # at most two per core
    assert fold_plan(3, MIN - 1, "cpu", cores=2) == (1, 0)  # a worker's start would cost more than it gains
    assert fold_plan(3, MIN, "cpu", cores=1) == (1, 0)
    assert fold_plan(3, MIN, "cuda", cores=16) == (1, 0)  # one GPU: one fold after another
    assert fold_plan(3, 10, "cpu", workers=2, cores=2) == (2, 1)  # asked for: as asked, at most one per fold
    assert fold_plan(2, MIN, "cpu", workers=5, cores=2) == (2, 1)
    assert fold_plan(3, MIN, "cpu", workers=1, cores=2) == (1, 0)
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="fold_workers"):
            fold_plan(3, MIN, "cpu", workers=bad)
    # the environment decides where the caller does not (a sweep's job, the CLI, make)
    monkeypatch.setenv(ENV, "1")
    assert fold_plan(3, MIN, "cpu", cores=2) == (1, 0)
    assert fold_plan(3, MIN, "cpu", workers=2, cores=2) == (2, 1)  # the caller's word wins
    monkeypatch.setenv(ENV, "0")
    assert fold_plan(3, MIN, "cpu", cores=2) == (3, 1)
    for bad in ("two", "-2"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            fold_plan(3, MIN, "cpu", cores=2)


def test_folds_in_worker_processes_give_the_folds_trained_here(tiny_splits, tmp_path):
    """The same folds, seeds and scores whether they train here one after another or at once in spawned processes
    (whose progress lines come back here); only the threads' rounding differs."""
    cfg = TeacherConfig(folds=2, epochs=1, batch_size=8, max_length=32, early_stopping_fraction=0.0)
    here, rec_here = teacher_scores(tiny_splits, cfg, tmp_path / "here", fold_workers=1)
    lines: list[str] = []
    there, rec_there = teacher_scores(tiny_splits, cfg, tmp_path / "there", progress=lines.append, fold_workers=2)
    assert (rec_here["fold_processes"], rec_there["fold_processes"], rec_there["fold_threads"]) == (1, 2, 1)
    assert [f["held_out"] for f in rec_there["folds"]] == [f["held_out"] for f in rec_here["folds"]] == [12, 12]
    for split in here:
        np.testing.assert_allclose(there[split], here[split], atol=2e-3)
    assert any(line.startswith("teacher fold 2/2: held-out Spearman") for line in lines)
    with pytest.raises(ValueError, match="fold_workers=-1"):
        teacher_scores(tiny_splits, cfg, tmp_path / "bad", fold_workers=-1)


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie, ended and waiting for its reaper, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# the project's machines and CI run Linux; elsewhere /proc (how a zombie is told from a running process without
# psutil, which is not installed) is missing, and the test says so instead of failing on it
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_the_workers_end_when_the_process_that_started_them_is_killed(tmp_path):
    """A `train` killed while its folds trained (SIGTERM, SIGKILL, or SIGINT to it alone) left the fold processes
    training as orphans (three of them, 9 minutes on, still busy); now each ends within seconds of its parent."""
    script = tmp_path / "folds.py"
    script.write_text("import os, pathlib, sys, time\nfrom embed_lib.teacher.workers import run_folds\n"
                      "def work(k, out, progress):\n"
                      "    pathlib.Path(out, str(os.getpid())).touch()\n    time.sleep(300)\n"
                      "if __name__ == '__main__':\n"
                      "    run_folds(work, [(0, sys.argv[1]), (1, sys.argv[1])], 2, 1, print)\n")
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    parent = subprocess.Popen([sys.executable, str(script), str(pids_dir)], cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.time() + 120
        while len(list(pids_dir.iterdir())) < 2 and time.time() < deadline and parent.poll() is None:
            time.sleep(0.2)
        workers = [int(p.name) for p in pids_dir.iterdir()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    finally:
        parent.kill()  # SIGKILL: the parent can clean nothing up
        parent.wait()
    deadline = time.time() + 15
    while any(_alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if _alive(pid)], "fold workers outlived the process that started them"


def test_a_worker_that_dies_is_named_with_both_causes_and_their_fixes(tmp_path):
    """A script that starts worker processes at import, without a `__main__` guard: each spawned worker re-imports it
    and dies before it starts. The error names memory and the guard, each with its fix, not memory alone (a user who
    followed the advice to run one fold at a time would still have the stage's two shards die the same way)."""
    script = tmp_path / "unguarded.py"
    script.write_text("from embed_lib.teacher.workers import run_folds\n"
                      "def work(x, progress):\n    return x\n"
                      "print(run_folds(work, [(1,), (2,)], 2, 1, print))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode != 0
    # the parent's error; after it, multiprocessing's resource tracker may warn of the dead pool's semaphores
    ours = [line for line in out.stderr.splitlines() if line.startswith("RuntimeError: A worker process training")]
    assert len(ours) == 1, out.stderr[-2000:]
    for fix in ("EMBED_TEACHER_FOLD_WORKERS=1", "stage_shards=1", 'if __name__ == "__main__":'):
        assert fix in ours[0]



def test_a_teacher_with_non_finite_scores_is_refused_and_not_cached(tiny_splits, tmp_path, monkeypatch):
    """A diverged fold scores NaN: the error names the splits, the counts and the fix, and nothing is cached (a
    cached NaN teacher would be read by every later run)."""
    def diverged(splits, cfg):
        out = {k: np.full(len(d), 0.5, np.float32) for k, d in splits.items()}
        out["train"][:2] = [np.nan, np.inf]
        return out, {"key": teacher_key(cfg, splits), "config": dataclasses.asdict(cfg)}

    with pytest.raises(ValueError, match=r"non-finite scores \(train: 2 pairs\); nothing was cached\. Its training "
                                         r"diverged: lower its learning rate \(--teacher-lr\)"):
        teacher_scores(tiny_splits, TINY, tmp_path, compute=diverged)
    assert not list((tmp_path / "teacher").glob("*.npz"))
    monkeypatch.setattr(T, "_cross_fit", lambda *a, **k: {k: np.full(len(d), np.nan, np.float32)
                                                          for k, d in tiny_splits.items()})
    with pytest.raises(ValueError, match=r"train: 24 pairs, validation: 24 pairs, test: 24 pairs"):
        teacher_scores(tiny_splits, TINY, tmp_path)
    assert [f.suffix for f in (tmp_path / "teacher").iterdir()] == [".lock"]  # nothing but the lock it trained under
    pretrained = dataclasses.replace(TINY, pretrained=True)
    monkeypatch.setattr(recipe, "load", lambda *a, **k: None)
    monkeypatch.setattr(recipe, "predict", lambda ce, pairs, cfg: np.full(len(pairs), np.nan, np.float32))
    said = []
    with pytest.raises(ValueError, match=r"Check the cross-encoder's weights \(a corrupt or mismatched model\)"):
        teacher_scores(tiny_splits, pretrained, tmp_path, progress=said.append)
    # a pretrained teacher only scores (it said "training it")
    assert said[0].startswith("teacher: minilm (pretrained) has not scored this data yet (key ")


def test_load_study_trains_the_teacher_on_the_device_it_is_given(data_dir, tmp_path, monkeypatch):
    """A sweep's --device cpu reaches the teacher trained on the driver (it used to take the best device there)."""
    from embed_lib.pipeline import prepare

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("device"))
        return teacher_scores(*args, **kwargs)
    monkeypatch.setattr(prepare, "teacher_scores", spy)
    _, record = prepare.load_study("stsb", teacher=TINY, data_dir=data_dir, cache_dir=tmp_path, limit=24,
                                   teacher_device="cpu")
    assert seen == ["cpu"] and record["device"] == "cpu"


def test_the_folds_score_the_silver_pairs_and_they_are_in_the_key(tiny_splits, tmp_path):
    """Silver pairs given with the splits: every fold model scores them (their mean, as for validation), they have no
    Spearman of their own (no labels), and they make another teacher key."""
    from embed_lib.training.silver import SILVER, build_silver

    train = tiny_splits["train"]
    texts = train.texts()
    vectors = np.random.default_rng(0).normal(size=(len(texts), 8)).astype(np.float32)
    splits = {**tiny_splits, SILVER: build_silver(train, texts, vectors, 10)}
    scores, record = teacher_scores(splits, TINY, tmp_path, fold_workers=1)
    assert {k: len(v) for k, v in scores.items()} == {"train": 24, "validation": 24, "test": 24, SILVER: 10}
    assert np.isfinite(scores[SILVER]).all() and f"{SILVER}_spearman" not in record
    assert teacher_key(TINY, splits) != teacher_key(TINY, tiny_splits)


def test_load_study_refuses_silver_pairs_without_a_teacher():
    from embed_lib.pipeline.prepare import load_study

    with pytest.raises(ValueError, match=r"silver=100.*give a teacher, or no silver pairs \(--no-silver\)"):
        load_study("stsb", silver=100)
