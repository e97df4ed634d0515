"""Whether this driver runs as a Ray job (``ray job submit``), read from the environment Ray starts it with.

Apart from ``runtime.cluster.session``, which joins the cluster: a command that may never start Ray (``jobs.prepare``
without regeneration) asks without importing Ray.
"""

from __future__ import annotations

import json
import os

RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor for the driver it starts: the job's runtime env and metadata."""


def inside_ray_job() -> bool:
    """True in a driver that ``ray job submit`` started."""
    return RAY_JOB_ENV in os.environ


def ray_job_submission_id() -> str:
    """The submission id (``raysubmit_...``) of the Ray job this driver runs as, or ""."""
    try:
        metadata = json.loads(os.environ.get(RAY_JOB_ENV, "{}")).get("metadata") or {}
    except ValueError:
        return ""
    return str(metadata.get("job_submission_id", ""))
