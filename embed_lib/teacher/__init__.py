"""The held-out cross-encoder teacher behind the ce_margin target, in layers: `config` (TeacherConfig, presets) <
`recipe` (fine-tuning and scoring one cross-encoder) < `intermediate` (the stage on other tasks' pairs) < `scores`
(K-fold cross-fitted scores, cached) < `cross_encoder` (one served model, calibrated, `PairCrossEncoder`)."""
from embed_lib._moved import package_getattr

__getattr__ = package_getattr(__name__, ["config", "scores"])  # embed_lib.teacher was a module in 0.1
