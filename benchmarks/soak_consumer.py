"""The soak's trainer: takes a running job's shard files as the manifest records them done (docs/training.md,
"Consuming shards while the run goes on"), reads and checks every sample, declares the file consumed
(``storage.consumed.consume_shard``) and deletes it. A file the manifest does not record yet is not taken:
after a crash between its commit and its record the rerun writes that shard again.

One process of ``--of`` takes the shards whose index is ``--index`` modulo ``--of``. Each consumed shard
is one JSON line in ``--ledger``: its sample ids (checked to be the shard's planned range), tokens, bytes
and one xxh3 digest of every sample's states, written only once the file is declared consumed. The soak
reads the ledgers to tell that every sample arrived exactly once and to compare states with a reference
run. Runs until ``--stop`` exists and the directory holds none of its shards.

    python -m benchmarks.soak_consumer --dir OUT --ledger L.jsonl --stop STOP --shard-size 16 --samples 14700
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import xxhash

from storage.consumed import consume_shard
from storage.manifest import DONE, LOCAL, read_manifest
from storage.reader import ShardReader

POLL_S = 0.5


class ShardCheckError(ValueError):
    """A shard file whose samples are not the ones its plan assigns it, or whose states have the wrong shape."""


def raw_bytes(states: torch.Tensor) -> np.ndarray:
    """A state tensor's bytes as stored (numpy has no bfloat16)."""
    return states.contiguous().view(torch.uint8).numpy()


def sample_digests(path: Path) -> tuple[list[int], list[str], int]:
    """Every sample of the shard file ``path`` read as a trainer reads it (page checksums verified): its ids,
    one digest of each sample's states (aux, then final), and its tokens."""
    reader = ShardReader(path)
    meta = reader.metadata
    width = len(meta.layer_ids) * meta.hidden_size
    ids, digests, tokens = [], [], 0
    for sample in reader:
        length = len(sample.input_ids)
        if tuple(sample.aux_hidden_states.shape) != (length, width):
            raise ShardCheckError(f"{path}: sample {sample.sample_id}: aux states {tuple(sample.aux_hidden_states.shape)}, "
                                  f"expected ({length}, {width})")
        digest = xxhash.xxh3_128(raw_bytes(sample.aux_hidden_states))
        if sample.last_hidden_state is not None:
            digest.update(raw_bytes(sample.last_hidden_state))
        ids.append(sample.sample_id)
        digests.append(digest.hexdigest())
        tokens += length
    return ids, digests, tokens


def check_ids(path: Path, shard: int, ids: list[int], shard_size: int, samples: int) -> None:
    start = shard * shard_size
    wanted = list(range(start, min(start + shard_size, samples)))
    if ids != wanted:
        raise ShardCheckError(f"{path}: sample ids {ids[:3]}...{ids[-3:]} ({len(ids)}), the plan gives shard {shard} "
                              f"ids {start}..{wanted[-1] if wanted else start} ({len(wanted)})")


def consume_one(path: Path, shard: int, args: argparse.Namespace) -> dict | None:
    """Read, check, declare consumed and delete one shard file; its ledger entry, or None if the file went
    away first (the job removed it: it is not consumed, and the job writes it again)."""
    try:
        size = path.stat().st_size
        ids, digests, tokens = sample_digests(path)
        check_ids(path, shard, ids, args.shard_size, args.samples)
        consume_shard(path, f"benchmarks.soak_consumer {args.index}/{args.of}")
    except FileNotFoundError:
        return None
    return {"shard": shard, "bytes": size, "first": ids[0], "count": len(ids), "tokens": tokens,
            "digests": digests, "at": time.time()}


def recorded_done(directory: Path) -> list[tuple[int, Path]]:
    """The shards the run's manifest (snapshot and journal, read-only) records done with their file in ``directory``."""
    try:
        shards = read_manifest(directory)["shards"]
    except ValueError:  # no manifest yet
        return []
    return [(record["index"], directory / record["file"]) for record in shards
            if record["state"] == DONE and record["location"] == LOCAL]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, type=Path, help="the run's output.dir")
    parser.add_argument("--ledger", required=True, type=Path)
    parser.add_argument("--stop", required=True, type=Path, help="stop once this file exists and nothing is left")
    parser.add_argument("--shard-size", required=True, type=int)
    parser.add_argument("--samples", required=True, type=int)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--of", type=int, default=1)
    parser.add_argument("--pause-s", type=float, default=0.0, help="pause after each shard: a trainer's time on it")
    args = parser.parse_args()
    with open(args.ledger, "a") as ledger:
        while True:
            stopping = args.stop.exists()  # before the look: a file committed after it is seen next round
            mine = [(shard, path) for shard, path in recorded_done(args.dir)
                    if shard % args.of == args.index and path.exists()]
            for shard, path in mine:
                entry = consume_one(path, shard, args)
                if entry is not None:
                    ledger.write(json.dumps(entry) + "\n")
                    ledger.flush()
                else:
                    ledger.write(json.dumps({"shard": shard, "vanished": True, "at": time.time()}) + "\n")
                time.sleep(args.pause_s)
            if stopping and not mine:
                return
            if not mine:
                time.sleep(POLL_S)


if __name__ == "__main__":
    main()
