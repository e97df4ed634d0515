"""Does the engine match matter? Train EAGLE-3 drafters on SmolLM2-135M-Instruct's states, serve them with
SGLang, measure acceptance length; on the bf16 target, and on quantized targets (fp8; INT4 W4A16).

    python -m benchmarks.acceptance --work DIR [--arms A,Q,Q-bf16] [--seeds 0,1] [--stages all] [--gguf FILE] ...
    python -m benchmarks.acceptance.background start|status --work DIR ...   (every stage in one background process)

Every step is a project command or a peer's released tool run as a subprocess (prepare, extract, export,
SpecForge's trainer, SGLang's EAGLE3), once per arm: the same prompts, answers and recipe, states from
different sources (ours, the off-by-one layer, HF transformers, fp8, none, each quantized server's).
Each step leaves a record under ``DIR/steps/``; a rerun skips the recorded ones (exit 75 after
``--deadline-s``: rerun the same command to go on). The arms, the stages, the results and how to run
it on a GPU machine: docs/benchmarks.md.
"""
