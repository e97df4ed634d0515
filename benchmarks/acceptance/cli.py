"""The command line: which arms, seeds and stages to run, the recipe, the deadline; exit 75 when a deadline
stopped it."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
from typing import Optional, Sequence

import benchmarks.acceptance
from benchmarks.acceptance.arms import ARMS, parse_arms
from benchmarks.acceptance.pipeline import EXIT_MORE_TO_DO, OutOfTime, Pipeline
from benchmarks.acceptance.serving import SERVE_PARALLEL
from benchmarks.acceptance.stages import STAGE_FUNCTIONS, STAGES
from benchmarks.acceptance.trainer import Recipe

logger = logging.getLogger("benchmarks.acceptance")

GPU_STAGES = ("prepare", "probe", "train", "serve")
TRAIN_PARALLEL = 4
"""SpecForge trainings at once by default: four ran side by side on the H200 (2026-12-02), 0.16 s a step each."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.acceptance", description=benchmarks.acceptance.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="working directory (kept: every step's output and record)")
    parser.add_argument("--out", default="", help="results JSON (default DIR/results.json); the tables beside it (.md)")
    parser.add_argument("--stages", default="all", help=f"comma-separated, in order: {','.join(STAGES)} (default all)")
    parser.add_argument("--arms", default="all",
                        help=f"comma-separated, of {','.join(ARMS)} (default all); what they serve is trained "
                             "(Q-bf16 serves A's drafter, so A trains), the rest is skipped")
    parser.add_argument("--seeds", default=str(Recipe.seed),
                        help="training seeds, comma-separated: each trained arm trains and is served once per seed")
    parser.add_argument("--deadline-s", type=float, default=0, help="start no step after this many seconds (0: none)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--gguf", default="", help="SmolLM2's GGUF file (a machine without the package registry)")
    parser.add_argument("--train-prompts", type=int, default=4000)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--prompt-seed", type=int, default=0, help="composes and splits the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="answer length, regenerating and serving")
    parser.add_argument("--regenerate-cuda-graph", action="store_true",
                        help="regenerate the answers with decode CUDA graphs (faster; not yet run on the H200's stack)")
    parser.add_argument("--epochs", type=int, default=Recipe.epochs)
    parser.add_argument("--batch-size", type=int, default=Recipe.batch_size)
    parser.add_argument("--learning-rate", "--lr", type=float, default=Recipe.learning_rate)
    parser.add_argument("--ttt-length", type=int, default=Recipe.ttt_length,
                        help="draft steps each training step unrolls (serving drafts 3)")
    parser.add_argument("--draft-vocab", type=int, default=Recipe.draft_vocab,
                        help="the drafter's vocabulary: SpecForge keeps the tokens most frequent in the training "
                             "answers (0: the target's whole vocabulary)")
    parser.add_argument("--warm-head", action="store_true",
                        help="start each drafter's head from the target's (its embedding rows and final norm) "
                             "instead of SpecForge's random initialisation")
    parser.add_argument("--max-steps", type=int, default=0,
                        help="cap every arm's training at this many steps (0: none; bounds a device call's "
                             "training time)")
    parser.add_argument("--epoch-acceptance", action="store_true",
                        help="also serve each trained arm's drafter as it was at the end of every earlier epoch "
                             "(one more engine each: the acceptance curve over epochs)")
    parser.add_argument("--training-distribution-eval", action="store_true",
                        help="also serve arm A's drafter of the first seed over --eval-prompts fresh prompts of the "
                             "training distribution (one more engine): how much of the held-out prompts' acceptance "
                             "the other distribution costs")
    parser.add_argument("--train-parallel", type=int, default=TRAIN_PARALLEL, help="SpecForge trainings at once")
    parser.add_argument("--attention-backend", default="flashinfer", help="SGLang's, when serving")
    parser.add_argument("--quantized-serving", default="",
                        help="the fp8 target's serving command, as model.serving takes it (default: "
                             "'--quantization fp8 --attention-backend BACKEND'): arm Q's extraction and the "
                             "engines of Q and Q-bf16 run it")
    parser.add_argument("--int4-serving", default="",
                        help="the INT4 target's serving command (default: '--quantization compressed-tensors "
                             "--speculative-draft-model-quantization unquant --attention-backend BACKEND': the "
                             "drafter in bf16, as the checkpoint's own quantization config cannot describe it): arm "
                             "Q4's extraction and the engines of Q4 and Q4-bf16 run it on DIR/model-int4")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the extraction's dtype, but for Q's (its serving command's)")
    parser.add_argument("--extract-set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more jobs.extract setting for every run (repeatable)")
    parser.add_argument("--serve-parallel", type=int, default=SERVE_PARALLEL, help="serving engines at once on the GPU")
    return parser


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    stages = STAGES if args.stages == "all" else tuple(s.strip() for s in args.stages.split(","))
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stages {unknown}; known: {', '.join(STAGES)}")
    needs_gpu = [s for s in stages if s in GPU_STAGES]
    if args.device != "cuda" and needs_gpu:
        parser.error(f"stages {needs_gpu} run on CUDA only (SGLang's EAGLE3 serving and regeneration, SpecForge's "
                     "FSDP trainer); on CPU run the others, or tests/benchmarks/test_acceptance_cpu.py")
    try:
        args.arms = parse_arms(args.arms)
        args.seeds = tuple(dict.fromkeys(int(seed) for seed in args.seeds.split(",") if seed.strip()))
    except ValueError as error:
        parser.error(str(error))
    if not args.seeds:
        parser.error("--seeds: name at least one training seed")
    if args.ttt_length < 1 or args.draft_vocab < 0:
        parser.error("--ttt-length takes 1 or more, --draft-vocab 0 (the whole vocabulary) or more")
    args.quantized_serving = tuple(shlex.split(args.quantized_serving) or
                                   ["--quantization", "fp8", "--attention-backend", args.attention_backend])
    args.int4_serving = tuple(shlex.split(args.int4_serving) or
                              ["--quantization", "compressed-tensors", "--speculative-draft-model-quantization",
                               "unquant", "--attention-backend", args.attention_backend])
    args.stages = stages
    return args


def print_steps(p: Pipeline) -> None:
    """Every step recorded so far, one line each (what a device call that ends before the report shows)."""
    for path in sorted((p.work / "steps").glob("*.json"), key=lambda path: path.stat().st_mtime):
        record = json.loads(path.read_text())
        print(f"{path.stem}: {record.pop('seconds')} s {json.dumps(record)[:300]}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    pipeline = Pipeline(args)
    try:
        for stage in args.stages:
            pipeline.progress(stage=stage, step="")
            STAGE_FUNCTIONS[stage](pipeline)
        pipeline.progress(stage="finished", step="")
    except OutOfTime as stopped:
        logger.warning("stopped before step %s (--deadline-s %.0f): rerun the same command to go on", stopped,
                       args.deadline_s)
        return EXIT_MORE_TO_DO
    except ValueError as error:  # a setting or an input the benchmark cannot use
        logger.error("%s", error)
        return 2
    except RuntimeError as error:  # a step's command failed; its log is named
        logger.error("%s", error)
        return 1
    finally:
        print_steps(pipeline)
    return 0
