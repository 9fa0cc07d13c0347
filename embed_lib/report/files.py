"""A command's report on disk: the markdown at the path asked for, its figures as JSON beside it."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def write_report(path: str | Path, text: str, figures: dict[str, Any], seconds: float) -> Path:
    """Writes `text` to `path` and `figures` to the same name with .json, creating the folder, and says so on stderr
    with the time the command took."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(figures, indent=2))
    print(f"wrote {out} and {out.with_suffix('.json')} in {seconds:.1f}s", file=sys.stderr)
    return out
