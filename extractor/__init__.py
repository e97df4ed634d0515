"""Hidden-state capture with SGLang's own ModelRunner.

This package is the only place that imports SGLang: ``extractor.engine``
drives a runner, ``extractor.language_model`` finds the language model inside
the class SGLang serves, ``extractor.sglang_compat`` holds every difference
between the supported SGLang releases (0.5.17, 0.5.23), ``extractor.host_copy``
the overlapped device-to-host copies, ``extractor.cpu_shims`` the CPU-only
adjustments, ``extractor.drafter_check`` asks SGLang what a drafter config
captures; ``extractor.tensor_parallel`` and ``extractor.actor`` load them
lazily. ``extractor.config``, ``extractor.checkpoint``,
``extractor.drafter_config``, ``extractor.layers`` and ``extractor.types`` are
light and safe to import from the driver.
"""
