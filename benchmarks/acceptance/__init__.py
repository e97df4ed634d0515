"""Does the engine match matter? Train EAGLE-3 drafters on SmolLM2-135M-Instruct's states, serve them with
SGLang, measure acceptance length.

    python -m benchmarks.acceptance --work DIR [--out results.json] [--stages all] [--gguf FILE] ...

Every step is a project command or a peer's released tool, run as a subprocess (but for arm C's HF forward
and arm E's initialisation, made here with transformers and SpecForge's own draft model class):

1. prompts (``prompts``): a few thousand varied single-turn prompts composed here (no data set download)
   and a disjoint held-out set of at least 200 for evaluation;
2. data (``data``): ``python -m jobs.prepare`` with regeneration: the target answers the prompts itself
   through SGLang, greedy, with its chat template and an assistant-only loss mask;
3. states, one ``python -m jobs.extract`` per arm (canonical layers [1, 14, 26], post-norm final state),
   then ``python -m jobs.export to=specforge`` (``arms``; arm C's HF states: ``hf_states``);
4. training (``trainer``): SpecForge 0.2.0's own trainer (``specforge train -c run.yaml``, offline), the
   same recipe, seed and steps for every arm;
5. serving (``drafters``, ``serving``): ``specforge export --to sglang``, then SGLang's EAGLE3 (3 steps,
   top-k 1, 4 draft tokens, temperature 0, flashinfer, no CUDA graphs) over the held-out prompts;
   acceptance length = 1 + sum(spec_num_correct_drafts) / sum(spec_verify_ct), with a bootstrap 95%
   interval over prompts (``stats``);
6. ``python -m jobs.check_drafter`` on every arm's served config against the run its states came from.

The arms (same prompts, answers, recipe):
  A  our states; the drafter config as the run wrote it.
  B  the off-by-one bug: states of HF ``hidden_states[k]`` (the input of layer k, as other engines number
     layers), served with a config claiming k. Taken from our own extraction of layers k-1, whose outputs
     are exactly HF ``hidden_states[k]`` (tests/test_real_weights.py), so only the layer numbering differs
     from A.
  C  HF-path states: HF transformers in bf16 on the GPU, right layers (the "other kernels" half of the
     story); with C's relative difference from A per layer.
  D  ours with fp8 states (``output.state_dtype=float8_e4m3fn``), dequantized to bf16 by the export.
  E  an untrained drafter (SpecForge's own initialisation, seeded, exported the same way): the floor.

Results: ``--out`` (JSON) and ``results.md`` beside it (a table for benchmarks/RESULTS.md; ``report``).
Each step leaves a record under ``DIR/steps/``; a rerun skips the steps recorded there, so the pipeline
goes on across device calls (``--stages`` names which to run, ``--deadline-s`` stops before starting a
step past that time; exit code 75 then means "rerun the same command to go on"; ``pipeline``, ``stages``).
The work directory needs about 35 GB of disk at the default 4,000 prompts (three runs and four exports of
~1M tokens). How to run it on a GPU machine without a package registry, call by call: docs/benchmarks.md.
"""
