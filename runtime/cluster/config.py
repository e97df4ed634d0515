"""The ``ray`` section: which Ray cluster the driver joins."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RayConfig:
    address: str = ""
    """Ray cluster (GCS host:port) to join. Empty: the job's own cluster under `ray job submit`, else RAY_ADDRESS, else a private one on 127.0.0.1."""

    def __post_init__(self) -> None:
        if self.address.startswith(("http://", "https://")):
            raise ValueError(
                f"ray.address={self.address!r} is a dashboard URL, which `ray job` commands use; the driver "
                "joins a cluster at its GCS address (host:6379). Submit with `ray job submit --address "
                f"{self.address} ...`, or set ray.address=HOST:6379"
            )
