"""Which run a place belongs to: the claim file a run writes into each directory it keeps shards in, and into its
sink, before it writes or removes anything there. No run writes into, or removes from, a place another run claims."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from storage.atomic import write_synced

CLAIM_FILE = ".eagle3-claim.json"
"""The claim: a JSON object naming the run (``Manifest.run_id``), its output.dir and host (a node's directory adds
the node labels its files are recorded under)."""


def link_new_claim(directory: Path, owner: dict[str, Any]) -> None:
    """Write ``owner`` as ``directory``'s claim unless it has one. Written whole under a private name, then linked
    to the claim's: of two runs claiming at once exactly one link succeeds, and nobody reads a half-written claim."""
    claim = Path(directory) / CLAIM_FILE
    temp = claim.with_name(f"{CLAIM_FILE}.{os.getpid()}.tmp")
    write_synced(temp, json.dumps(owner).encode())
    try:
        os.link(temp, claim)
    except FileExistsError:
        pass  # another run claimed it a moment ago: the caller reads whose it is
    finally:
        temp.unlink()
