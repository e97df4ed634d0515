"""The writer pool's replacement of a writer, on a real local Ray cluster."""

from __future__ import annotations

import time

import ray

from jobs.actors.writer import WriterPool, WriterSettings

READY_S = 120


def gone(actor, within_s: float = 30.0) -> bool:
    """Whether ``actor`` is found dead within ``within_s`` (ray.kill is asynchronous: a call just after it may run)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=READY_S)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False


def test_a_writer_replaced_while_still_alive_is_killed_and_frees_its_cpu(ray_cluster, tmp_path):
    """Ray reports a writer it cannot reach for now as dead (ActorUnavailableError is a RayActorError): the pool
    replaces it, and the old one must not go on beside its replacement. Replaced three times on a cluster of three
    CPUs, a pool of one writer would otherwise need a fourth CPU: the last replacement would never start."""
    pool = WriterPool(tmp_path, WriterSettings(), 1, {})
    try:
        pool.wait_ready()
        for _ in range(3):
            old = pool.writers[0]
            new = pool.replace(old)
            assert new is pool.writers[0] and new is not old
            assert gone(old)
            assert ray.get(new.ready.remote(), timeout=READY_S)
    finally:
        pool.stop(collect_stats=False)
