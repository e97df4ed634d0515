"""How a job ends: each outcome has its own exit code, and every message says what to run next.

| code | outcome | what the user does |
|---|---|---|
| 0 | every selected shard is done | nothing |
| 1 | some shards failed (their errors are in the manifest) | rerun with ``shards=failed`` |
| 2 | bad config or input, refused before any work | fix what the message names |
| 3 | the disk budget is full and nothing can free it | free space or raise the budget, rerun |
| 4 | a fault the job could not absorb (actors or a node lost) | rerun the same command: it resumes |
| 5 | another job holds output.dir | wait for it, or choose another output.dir |
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_SHARDS_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_BUDGET_EXHAUSTED = 3
EXIT_FAULT = 4
EXIT_LOCKED = 5


class JobStopped(RuntimeError):
    """The job ended early but cleanly: what is done is recorded, a rerun resumes."""

    exit_code = EXIT_FAULT


class BudgetExhausted(JobStopped):
    """The disk budget is full and nothing in flight can free it."""

    exit_code = EXIT_BUDGET_EXHAUSTED


class JobFault(JobStopped):
    """Actors died more often than the job restarts them; done shards are kept, a rerun resumes."""

    exit_code = EXIT_FAULT


class OutputLocked(JobStopped):
    """Another job holds output.dir."""

    exit_code = EXIT_LOCKED
