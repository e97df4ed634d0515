"""Does the engine match matter? Train EAGLE-3 drafters on SmolLM2-135M-Instruct's states, serve them with
SGLang, measure acceptance length; on the bf16 target, and on the target served quantized.

    python -m benchmarks.acceptance --work DIR [--arms A,Q,Q-bf16] [--seeds 0,1] [--stages all] [--gguf FILE] ...
    python -m benchmarks.acceptance.background start|status --work DIR ...   (every stage in one background process)

Every step is a project command or a peer's released tool, run as a subprocess (but for arm C's HF forward,
arm E's initialisation and the state comparisons, made here with transformers, SpecForge's own draft model
class and the project's shard reader):

1. prompts (``prompts``): a few thousand varied single-turn prompts composed here (no data set download) and
   a disjoint held-out set of at least 200, of another distribution (other phrasings and subjects);
2. data (``data``): ``python -m jobs.prepare`` with regeneration: the target answers the prompts itself
   through SGLang (bf16), greedy, with its chat template and an assistant-only loss mask;
3. states, one ``python -m jobs.extract`` per run (canonical layers [1, 14, 26], post-norm final state; the
   quantized run first, with the quantized server's command as ``model.serving``), then a probe of the
   quantized serving path (an untrained drafter served on the quantized target over a few prompts), then
   ``python -m jobs.export to=specforge`` (``arms``; arm C's HF states: ``hf_states``; how far states are
   from each other per layer: ``differences``);
4. training (``trainer``): SpecForge 0.2.0's own trainer (``specforge train -c run.yaml``, offline), the
   same recipe for every arm, once per training seed (``--seeds``), its logged loss and accuracy per epoch
   kept as the curve;
5. serving (``drafters``, ``serving``): ``specforge export --to sglang``, then SGLang's EAGLE3 (3 steps,
   top-k 1, 4 draft tokens, temperature 0, flashinfer, no CUDA graphs) over the held-out prompts, on the
   bf16 target or on the quantized one (``--quantized-serving``, default ``--quantization fp8``: SGLang's
   W8A8 of the bf16 checkpoint); acceptance length = 1 + sum(spec_num_correct_drafts) / sum(spec_verify_ct),
   with a bootstrap 95% interval over prompts per seed and pooled over seeds, and paired differences
   (``stats``);
6. ``python -m jobs.check_drafter`` on every served drafter against the run its states came from, and
   ``python -m jobs.check_serving`` of the quantized server's command against the run of every arm served
   on it.

The arms (same prompts, answers, recipe; ``--arms`` picks some, and what they serve is all that is made):
  A  our states; the drafter config as the run wrote it.
  B  the off-by-one bug: states of HF ``hidden_states[k]`` (the input of layer k, as other engines number
     layers), served with a config claiming k. Taken from our own extraction of layers k-1, whose outputs
     are exactly HF ``hidden_states[k]`` (tests/test_real_weights.py), so only the layer numbering differs
     from A.
  C  HF-path states: HF transformers in bf16 on the GPU, right layers (the "other kernels" half of the
     story); with C's relative difference from A per layer.
  D  ours with fp8 states (``output.state_dtype=float8_e4m3fn``), dequantized to bf16 by the export.
  E  an untrained drafter (SpecForge's own initialisation, seeded, exported the same way): the floor.
  Q  our states extracted with the quantized server's own settings (serve-exact), served on that target.
  Q-bf16  A's drafter (our bf16 states: what any bf16 path gives) served on the quantized target; with how
     far A's states are from Q's per layer (what the quantized target really computes).
The main differences: A-B (the layer offset) and Q-(Q-bf16) (what serve-exact states buy on a quantized
target).

Results: ``--out`` (JSON) and ``results.md`` beside it (tables for benchmarks/RESULTS.md; ``report``).
Each step leaves a record under ``DIR/steps/``; a rerun skips the steps recorded there, so the pipeline
goes on across device calls (``--stages`` names which to run, ``--deadline-s`` stops before starting a
step past that time; exit code 75 then means "rerun the same command to go on"; ``pipeline``, ``stages``),
or runs to the end in one background process (``background``).
The work directory needs about 35 GB of disk at the default 4,000 prompts and every arm (four runs and five
exports of ~1M tokens). How to run it on a GPU machine without a package registry, call by call:
docs/benchmarks.md.
"""
