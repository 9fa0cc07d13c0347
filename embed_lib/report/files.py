"""A command's report on disk: the markdown at the path asked for, its figures as JSON beside it."""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

#: the instruction sets a CPU figure depends on: the teacher trains in bf16 only where the CPU has it natively
#: (avx512_bf16 or amx_bf16; embed_lib.teacher.recipe.effective_precision), else in fp32 at 1.5-2.4x the time
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """Which of ISA_FLAGS this CPU has (/proc/cpuinfo), [] where that cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in ISA_FLAGS if f in flags]


def machine() -> dict[str, Any]:
    """What a figure was measured on: cores, CPU model, the instruction sets of ISA_FLAGS it has, platform, Python."""
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "cpu_flags": cpu_flags(),
            "platform": platform.platform(), "python": platform.python_version()}


def write_report(path: str | Path, text: str, figures: dict[str, Any], seconds: float) -> Path:
    """Writes `text` to `path` and `figures` to the same name with .json, creating the folder, and says so on stderr
    with the time the command took."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if isinstance(figures, dict) and "machine" not in figures:  # every results file says what measured it
        figures = {**figures, "machine": machine()}
    out.with_suffix(".json").write_text(json.dumps(figures, indent=2))
    print(f"wrote {out} and {out.with_suffix('.json')} in {seconds:.1f}s", file=sys.stderr)
    return out
