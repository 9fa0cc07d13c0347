"""Shared helpers for benchmark scripts: write figures to results/benchmarks/<name>.json and print them."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("EMBED_DATA_DIR", str(REPO.parent / "shared" / "data"))


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_results(name: str, figures: dict) -> Path:
    out = REPO / "results" / "benchmarks" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine":
              {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
               "python": platform.python_version()},
              **figures}
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps(figures, indent=2))
    print(f"wrote {out}")
    return out
