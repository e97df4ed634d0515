"""The Ray job: plans shards, schedules the extractor and writer actors, reports progress.

Nothing here imports SGLang; the extractor actor does, in its own process.
"""
