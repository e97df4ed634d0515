"""The Ray job: plans shards, schedules the extractor and writer actors, reports progress.

Nothing here imports SGLang; the extractor actor does, in its own process. A command started on a
Python without the project's packages says so in one line (``jobs.environment``).
"""

from jobs.environment import refuse_incomplete_environment

refuse_incomplete_environment()
