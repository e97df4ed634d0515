"""``python -m jobs.status output.dir=DIR [output.disk_budget=1.3TB]``: where a run stands.

Prints shards by state, tokens, bytes on local disk and in the sink, budget
use, and the last error of every failed shard, from ``manifest.json`` and
the files actually present.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from jobs.budget import format_bytes
from storage.config import OutputConfig, parse_bytes
from storage.manifest import CONSUMED, DONE, FAILED, LOCAL, PENDING, SINK, read_manifest


def status_report(output_dir: Path, disk_budget: int) -> str:
    manifest = read_manifest(output_dir)
    shards = manifest["shards"]
    rows = []
    for state in (DONE, PENDING, FAILED):
        selected = [s for s in shards if s["state"] == state]
        rows.append((state, len(selected), sum(s["rows"] for s in selected), sum(s["tokens"] for s in selected)))
    done = [s for s in shards if s["state"] == DONE]
    local = sum(s["bytes"] for s in done if s["location"] == LOCAL and (output_dir / s["file"]).exists())
    in_sink = sum(s["bytes"] for s in done if s["location"] == SINK)
    consumed = sum(1 for s in done if s["location"] == CONSUMED)
    lines = [f"{'state':<8} {'shards':>7} {'samples':>9} {'tokens':>12}"]
    lines += [f"{state:<8} {count:>7} {samples:>9} {tokens:>12}" for state, count, samples, tokens in rows]
    lines.append(f"{'total':<8} {len(shards):>7}")
    lines.append("")
    lines.append(f"on local disk: {format_bytes(local)} of budget {format_bytes(disk_budget)} ({100 * local / disk_budget:.1f}%)")
    lines.append(f"in the sink:   {format_bytes(in_sink)}")
    if consumed:
        lines.append(f"consumed:      {consumed} shards deleted from output.dir by someone else")
    for shard in shards:
        if shard["state"] == FAILED or shard["error"]:
            lines.append(f"shard {shard['index']} ({shard['state']}, {shard['attempts']} attempts): {shard['error']}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    overrides = OmegaConf.from_dotlist(list(argv))
    output = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OutputConfig), overrides.get("output", {})))
    if not output.dir:
        print("usage: python -m jobs.status output.dir=DIR [output.disk_budget=1.3TB]", file=sys.stderr)
        return 2
    try:
        print(status_report(Path(output.dir), parse_bytes(output.disk_budget, "output.disk_budget")))
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
