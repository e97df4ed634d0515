"""Hidden-state capture with SGLang's own ModelRunner.

This package is the only place that imports SGLang, and only inside
``extractor.engine`` (the version adapter) and the modules that load it
lazily (``extractor.tensor_parallel``, ``extractor.actor``). ``extractor.config``,
``extractor.layers`` and ``extractor.types`` are light and safe to import from
the driver.
"""
