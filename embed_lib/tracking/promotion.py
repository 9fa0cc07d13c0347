"""What decides where the registry's `champion` alias sits: like compared with like, and a recorded reason.

A registered version carries its *evidence*: the task, a fingerprint of the validation pairs and labels it was
selected on, the encoder key (encoder, revision, weights, backend / quantisation, tau_attn, pooling), the winner rule
and transfer tolerance, and the rule's own figure (the mean validation delta over the frozen cosine). A new version
takes `champion` only from a champion with the same task, validation data, encoder and rule, and only when that
figure is strictly higher; otherwise it becomes `challenger`, with the reason. Pure logic, no MLflow: the registry
(`embed_lib.tracking.registry`) reads and writes the tags.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

#: the rule's figure: the winner rule picks the best mean validation delta over the frozen cosine
FIGURE = "delta_val_mean"
#: version tags that hold the evidence (one tag per field, readable in the MLflow UI)
EVIDENCE_TAGS = {"task": "task", "val_fingerprint": "val_fingerprint", "val_pairs": "val_pairs",
                 "encoder_key": "encoder_key", "encoder": "encoder", "rule": "winner_rule",
                 "tolerance": "transfer_tolerance", "figure": FIGURE}
#: the manifest fields that make up the encoder's description (what a person compares)
ENCODER_FIELDS = ("encoder", "revision", "backend", "quantization", "tau_attn", "pooling")


@dataclass(frozen=True)
class Evidence:
    """What a version was selected on; two versions are comparable when all but `figure` agree."""

    task: str
    val_fingerprint: str  # sha256 prefix of the validation pairs and labels (PairData.fingerprint)
    val_pairs: int
    encoder_key: str  # cache.cache_key of the encoder manifest: every field that changes the vectors
    encoder: str  # the readable part of the manifest: "encoder=minilm revision=... tau_attn=1.0 ..."
    rule: str
    tolerance: float
    figure: float  # mean validation delta over the frozen cosine (the rule's figure)

    def tags(self) -> dict[str, str]:
        return {tag: repr(float(v)) if isinstance(v, float) else str(v)
                for f, tag in EVIDENCE_TAGS.items() for v in [getattr(self, f)]}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> "Evidence | None":
        """The evidence recorded on a version, or None for a version registered without it."""
        if any(tag not in tags for tag in EVIDENCE_TAGS.values()):
            return None
        raw = {f: tags[tag] for f, tag in EVIDENCE_TAGS.items()}
        try:
            return cls(**{**raw, "val_pairs": int(raw["val_pairs"]), "tolerance": float(raw["tolerance"]),
                          "figure": float(raw["figure"])})
        except ValueError:
            return None


def encoder_description(manifest: Mapping[str, Any]) -> str:
    """'encoder=minilm revision=None backend=torch quantization=None tau_attn=1.0 pooling=mean' from a manifest."""
    return " ".join(f"{k}={manifest.get(k, 'torch' if k == 'backend' else None)}" for k in ENCODER_FIELDS)


def _encoder_diff(new: str, old: str) -> str:
    a = dict(p.split("=", 1) for p in new.split() if "=" in p)
    b = dict(p.split("=", 1) for p in old.split() if "=" in p)
    diff = [f"{k} {a.get(k)} vs {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(diff) or "same description, other weights or settings (encoder key differs)"


def incomparability(new: Evidence, old: Evidence) -> str | None:
    """Why `new` cannot be ranked against `old` (None: comparable)."""
    if new.task != old.task:
        return f"task differs ({new.task} vs {old.task})"
    if new.val_fingerprint != old.val_fingerprint:
        if new.val_pairs != old.val_pairs:
            return f"validation data differs ({new.val_pairs:,} pairs vs {old.val_pairs:,})"
        return (f"validation data differs (same {new.val_pairs:,} pairs count, other pairs or labels: fingerprint "
                f"{new.val_fingerprint} vs {old.val_fingerprint})")
    if new.encoder_key != old.encoder_key:
        return f"encoder differs ({_encoder_diff(new.encoder, old.encoder)})"
    if abs(new.tolerance - old.tolerance) > 1e-12:
        return f"transfer tolerance differs ({new.tolerance:g} vs {old.tolerance:g})"
    if new.rule != old.rule:
        return f"winner rule differs ({new.rule!r} vs {old.rule!r})"
    return None


@dataclass(frozen=True)
class Decision:
    """The alias a new version gets and why (`previous`: the champion it was compared with)."""

    alias: str  # "champion" or "challenger"
    reason: str
    previous: dict[str, Any] | None = None


def decide(new: Evidence, champion_version: str | None, champion: Evidence | None) -> Decision:
    """`champion` for the first version, or for a comparable and strictly better one; else `challenger`."""
    if champion_version is None:
        return Decision("champion", "first version: no champion yet")
    previous: dict[str, Any] = {"version": str(champion_version)}
    if champion is None:
        return Decision("challenger", f"not promoted: the champion (version {champion_version}) carries no "
                        "validation fingerprint or encoder key (registered before promotion records), so nothing "
                        "shows the two are comparable; promote deliberately with `python -m embed_lib registry "
                        "--promote <version>`", previous)
    previous.update(figure=champion.figure, val_pairs=champion.val_pairs, encoder=champion.encoder)
    why = incomparability(new, champion)
    if why is not None:
        return Decision("challenger", f"not promoted: {why}", previous)
    comparison = f"{FIGURE} {new.figure:+.5f} vs {champion.figure:+.5f} of version {champion_version}"
    if new.figure > champion.figure + 1e-12:
        return Decision("champion", f"promoted: better on the rule's figure ({comparison}, same validation data, "
                        "encoder and rule)", previous)
    return Decision("challenger", f"not promoted: not better on the rule's figure ({comparison})", previous)


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran, as one would type it again: `python -m embed_lib registry ...` for the CLI (whose
    sys.argv[0] is the path of its __main__.py), else the script's name and its arguments."""
    argv = sys.argv if argv is None else argv
    head = Path(argv[0] if argv else "python")
    return " ".join([f"python -m {head.parent.name}" if head.name == "__main__.py" else head.name, *argv[1:]])


def record(decision: Decision, *, manual: bool = False, provenance: Mapping[str, Any] | None = None,
           evidence: Evidence | None = None) -> dict[str, Any]:
    """The promotion record stored on the version (JSON): the alias, the reason, the previous champion, the
    comparison's figures, manual or not, the command and commit, and when."""
    return {"alias": decision.alias, "reason": decision.reason, "manual": manual, "previous": decision.previous,
            **({"figure": {FIGURE: evidence.figure}} if evidence is not None else {}),
            "command": command_line(), **dict(provenance or {}),
            "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def to_tag(rec: Mapping[str, Any]) -> str:
    return json.dumps(rec, sort_keys=True, default=str)


#: MLflow keeps at most 8,000 characters per tag: the oldest records of a version's history give way first
HISTORY_CHARS = 7500


def appended(history_tag: str | None, rec: Mapping[str, Any]) -> str:
    """A version's `promotion_history` tag (a JSON list, oldest first) with `rec` added, trimmed to fit a tag."""
    events = (from_tag(history_tag) or []) + [dict(rec)]
    while len(events) > 1 and len(to_tag(events)) > HISTORY_CHARS:
        events.pop(0)
    return to_tag(events)


def from_tag(text: str | None) -> dict[str, Any] | None:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def with_figure(evidence: Evidence, figure: float) -> Evidence:
    """The same evidence with another figure (tests, deliberate what-ifs)."""
    return dataclasses.replace(evidence, figure=float(figure))
