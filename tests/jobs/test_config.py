"""Config checks: every mistake is one line and exit code 2, before Ray starts; paths resolved once."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import typing

import pytest

from common.config import OutputDir, RunDir, SinkOptions
from conversations.config import PrepareConfig
from extractor.config import ExtractConfig, ModelConfig
from jobs.actors.cpus import format_cores
from jobs.check_drafter import CheckDrafterConfig
from jobs.check_serving import CheckServingConfig
from jobs.config import JobConfig, build_config, config_keys, load_config, resolve_paths
from jobs.outdir.config import OutputConfig, parse_disk_budget
from jobs.planning.engine import build_engine_spec
from jobs.planning.preflight import refuse_pickled_weights
from jobs.prepare import load_config as load_prepare_config
from jobs.reference import COMMANDS
from jobs.status import StatusConfig
from jobs.verify import VerifyConfig
from runtime.cluster.submission import RAY_JOB_ENV, inside_ray_job, ray_job_submission_id
from runtime.errors import ConfigError
from tests.conftest import REPO_ROOT
from tests.helpers import python_env
from training.export_job import ExportConfig


@pytest.mark.parametrize("override, message", [
    ("model.pth=x", "unknown key model.pth; did you mean model.path?"),
    ("outptu.dir=/x", "unknown key outptu.dir; did you mean output.dir?"),
    ("output.sink_opts.a=1", "unknown key output.sink_opts.a; did you mean output.sink_options?"),
    ("model.tp_size=abc", "model.tp_size: Value 'abc' of type 'str' could not be converted to Integer"),
    ("extract.last_hidden_state=maybe", "extract.last_hidden_state='maybe': use one of post_norm, pre_norm, none"),
    ("output.state_dtype=fp8", "output.state_dtype='fp8': use one of model, float8_e4m3fn"),
    ("output.checksum=md5", "output.checksum='md5': use one of xxh3_128, sha256"),
    ("output.resume_check=sha256", "output.resume_check='sha256': use one of size, checksum"),
    ("output.writer_cpus=8-2", "output.writer_cpus='8-2': use auto, all, or a list of cores such as 4-15"),
    ("output.writer_cpus=some", "output.writer_cpus='some': use auto, all, or a list of cores such as 4-15"),
    ("model.engine=vllm", "model.engine='vllm': use one of sglang, synthetic"),
    ("extract.layers=[2,x]", "extract.layers[1]: Value 'x'"),
    ("extract.layers=[2,3", "cannot parse 'extract.layers=[2,3' as key=YAML value"),
    ("model.path", "overrides must look like section.key=value"),
    ("=3", "overrides must look like section.key=value"),
    ("model.tp_size=0", "model.tp_size=0: must be an integer >= 1"),
    ("model.dtype=fp8", "model.dtype='fp8': use one of bfloat16, float16, float32"),
    ("model.device=tpu", "model.device='tpu': use one of auto, cpu, cuda"),
    ("model.mem_fraction_static=1.5", "model.mem_fraction_static=1.5: must be in (0, 1]"),
    ("model.context_length=0", "model.context_length=0: must be a positive token count"),
    ("extract.layers=[]", "extract.layers=[]: give canonical layer ids"),
    ("extract.layers=[-1,3]", "extract.layers=[-1, 3]: give canonical layer ids"),
    ("extract.max_tokens_per_batch=0", "extract.max_tokens_per_batch=0: must be an integer >= 1"),
    ("data.shard_size=0", "data.shard_size=0: must be an integer >= 1"),
    ("output.max_inflight_batches=-1", "output.max_inflight_batches=-1: must be an integer >= 0"),
    ("output.num_uploaders=0", "output.num_uploaders=0: must be an integer >= 1"),
    ("output.disk_budget=0", "output.disk_budget='0': must be more than 0 bytes"),
    ("output.disk_budget=12XB", "output.disk_budget='12XB': write a size like 500GB"),
    ("output.min_free=lots", "output.min_free='lots': write a size like 500GB"),
    ("output.rescan_s=0", "output.rescan_s=0: must be more than 0 seconds"),
    ("output.budget_wait_s=-1", "output.budget_wait_s=-1.0: must be a number of seconds >= 0"),
    ("progress.interval_s=0", "progress.interval_s=0.0: must be a number of seconds > 0"),
    ("demo.arch=gpt2", "demo.arch='gpt2': use one of llama, qwen3, deepseek_v3"),
    ("shards=[true]", "shards=[True]: use `pending` (every shard not done yet: resume), `failed`"),
    ("shards=[1,-2]", "shards=[1, -2]: use `pending`"),
    ("demo.num_samples=0", "demo.num_samples=0: must be an integer >= 1"),
    ("shards=some", "shards='some': use `pending`"),
    ("model.path=/m", "set both model.path and data.path for a real run (did you forget --config?)"),
    ("ray.address=http://127.0.0.1:8265", "is a dashboard URL, which `ray job` commands use"),
])
def test_each_mistake_is_one_line(override, message):
    with pytest.raises(ConfigError) as error:
        load_config([override])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_config_file_and_overrides(tmp_path):
    (tmp_path / "c.yaml").write_text("model:\n  path: /m\n  tp_size: 8\ndata:\n  path: /d.parquet\n")
    config = load_config(["--config", str(tmp_path / "c.yaml"), "model.tp_size=4", "extract.layers=[2,30,58]"])
    assert (config.model.path, config.model.tp_size, config.extract.layers) == ("/m", 4, [2, 30, 58])
    assert config.output.disk_budget_bytes == 1_300_000_000_000 and config.output.min_free_bytes == 10**10

    (tmp_path / "typo.yaml").write_text("model:\n  path: /m\n  tp_szie: 8\ndata:\n  path: /d.parquet\n")
    with pytest.raises(ConfigError, match=r"unknown key model.tp_szie; did you mean model.tp_size\?"):
        load_config(["--config", str(tmp_path / "typo.yaml")])
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"--config .*bad.yaml: not valid YAML"):
        load_config(["--config", str(tmp_path / "bad.yaml")])
    with pytest.raises(ConfigError, match=r"--config .*missing.yaml: no such file"):
        load_config(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match="unrecognized arguments: --cofnig"):
        load_config(["--cofnig", "x.yaml"])


SGLANG_MODEL_MISTAKES = [
    ("model.tp_size=0", "model.tp_size=0: must be an integer >= 1 (one rank per GPU)"),
    ("model.dtype=fp8", "model.dtype='fp8': use one of bfloat16, float16, float32"),
    ("model.device=tpu", "model.device='tpu': use one of auto, cpu, cuda"),
    ("model.mem_fraction_static=0", "model.mem_fraction_static=0.0: must be in (0, 1]"),
    ("model.serving=[[1]]", "model.serving=[[1]]: give the SGLang server's command line as one string"),
]


@pytest.mark.parametrize("override, message", SGLANG_MODEL_MISTAKES)
@pytest.mark.parametrize("command", ["jobs.extract", "jobs.prepare"])
def test_the_sglang_model_section_refuses_alike_in_the_job_and_prepare(command, override, message):
    """jobs.extract and jobs.prepare share one SGLang model section: the same mistake, the same line."""
    load = load_config if command == "jobs.extract" else load_prepare_config
    with pytest.raises(ConfigError) as error:
        load([override])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_each_command_keeps_its_own_model_keys():
    """What only the extractor reads is no key of jobs.prepare, and the reverse."""
    prepare, job = set(config_keys(PrepareConfig)), set(config_keys(JobConfig))
    assert {f"model.{key}" for key in ("path", "dtype", "device", "tp_size", "serving", "trust_remote_code")} <= prepare & job
    assert {"model.dp_size", "model.context_length", "model.load_format", "model.engine"} <= job - prepare
    assert {"model.chat_template", "model.stop_tokens", "model.max_total_tokens"} <= prepare - job
    with pytest.raises(ConfigError, match="model.max_total_tokens=-1: must be an integer >= 0"):
        load_prepare_config(["model.max_total_tokens=-1"])
    with pytest.raises(ConfigError, match="unknown key model.dp_size"):
        load_prepare_config(["model.dp_size=2"])


READING_COMMANDS = {
    "jobs.status": StatusConfig, "jobs.verify": VerifyConfig, "jobs.export": ExportConfig,
    "jobs.check_drafter": CheckDrafterConfig, "jobs.check_serving": CheckServingConfig,
}
"""The commands that read a run, and the config each parses."""


def test_output_dir_and_sink_options_are_one_section_every_command_extends():
    """output.dir is declared once (common.config): the job's output section and every reading command's extend it,
    and each reading command refuses an empty one with the same line; so is output.sink_options, for the job and the
    commands that open a run's uploaded files; output.disk_budget is parsed by one function for the job and
    jobs.status (the same refusal)."""
    declared = [klass for schema in (JobConfig, *READING_COMMANDS.values())
                for klass in typing.get_type_hints(schema)["output"].__mro__ if "dir" in vars(klass).get("__annotations__", {})]
    assert set(declared) == {OutputDir}, declared
    # output.sink_options too: the job's (its uploads) and those of the commands that open a run's uploaded files
    with_options = [schema for schema in (JobConfig, *READING_COMMANDS.values())
                    if "sink_options" in {f.name for f in dataclasses.fields(typing.get_type_hints(schema)["output"])}]
    assert with_options == [JobConfig, VerifyConfig, ExportConfig], with_options
    declared = [klass for schema in with_options for klass in typing.get_type_hints(schema)["output"].__mro__
                if "sink_options" in vars(klass).get("__annotations__", {})]
    assert set(declared) == {SinkOptions}, declared
    for command, schema in READING_COMMANDS.items():
        assert issubclass(typing.get_type_hints(schema)["output"], RunDir), command
        with pytest.raises(ConfigError) as error:
            build_config(schema, None, ["to=specforge", "dest=/d"] if schema is ExportConfig else [], prog=command)
        assert str(error.value) == "output.dir is empty: name the run's directory, output.dir=DIR", command
    for schema in (JobConfig, StatusConfig):
        with pytest.raises(ConfigError, match=r"^output.disk_budget='0': must be more than 0 bytes, or no shard"):
            build_config(schema, None, ["output.dir=/run", "output.disk_budget=0"], prog="p")
    status = build_config(StatusConfig, None, ["output.dir=/run", "output.disk_budget=1.5GB"], prog="p")
    assert status.output.disk_budget_bytes == parse_disk_budget("1.5GB") == 1_500_000_000
    assert build_config(StatusConfig, None, ["output.dir=/run"], prog="p").output.disk_budget_bytes is None


def _choice_keys(schema: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """Every key of a config tree typed with a ``Literal`` alias: (dotted key, its section, the field's name)."""
    found: list[tuple[str, type, str]] = []
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[field.name]):
            found += _choice_keys(hints[field.name], f"{prefix}{field.name}.")
        elif typing.get_origin(hints[field.name]) is typing.Literal:
            found.append((f"{prefix}{field.name}", schema, field.name))
    return found


CHOICE_KEYS = [(command.modules[0], command.schema, *key) for command in COMMANDS for key in _choice_keys(command.schema)]


def test_choice_keys_are_typed_with_their_choices():
    keys = {key for module, _, key, _, _ in CHOICE_KEYS if module == "jobs.extract"}
    assert keys == {"model.dtype", "model.device", "model.engine", "data.on_invalid", "extract.on_nonfinite",
                    "extract.copy_by", "output.resume_check", "output.checksum", "output.state_dtype", "demo.arch"}
    assert {key for module, _, key, _, _ in CHOICE_KEYS if module == "jobs.prepare"} == {
        "model.dtype", "model.device", "data.format", "data.other_roles", "data.on_invalid", "data.on_too_long"}


@pytest.mark.parametrize("module, schema, key, section, name", CHOICE_KEYS,
                         ids=[f"{module}:{key}" for module, _, key, _, _ in CHOICE_KEYS])
def test_a_bad_choice_gets_the_sections_own_line(module, schema, key, section, name, tmp_path):
    """OmegaConf refuses a value outside a key's Literal before the section is built; the command still says
    what the section's own check says of it (built in Python: the same line), from the command line or a file."""
    with pytest.raises(ValueError) as built:
        section(**{name: "bogus"})
    with pytest.raises(ConfigError) as given:
        build_config(schema, None, [f"{key}=bogus"], prog=module)
    assert str(given.value) == str(built.value)
    assert str(given.value).startswith(f"{key}='bogus': use ")
    assert all(choice in str(given.value) for choice in typing.get_args(typing.get_type_hints(section)[name]))
    top, leaf = key.rsplit(".", 1)
    (tmp_path / "c.yaml").write_text(f"{top}:\n  {leaf}: 7\n")
    with pytest.raises(ConfigError, match=rf"^{key}='7': use "):  # an int, taken as text as a str key takes it
        build_config(schema, str(tmp_path / "c.yaml"), [], prog=module)


def test_sections_check_themselves_when_built_in_python():
    with pytest.raises(ValueError, match="model.tp_size=0"):
        ModelConfig(tp_size=0)
    with pytest.raises(ValueError, match="extract.max_samples_per_batch=0"):
        ExtractConfig(max_samples_per_batch=0)
    with pytest.raises(ValueError, match="extract.on_nonfinite='ignore': use one of fail, skip, keep"):
        ExtractConfig(on_nonfinite="ignore")
    with pytest.raises(ValueError, match="extract.copy_piece_mb=-1: must be an integer >= 0"):
        ExtractConfig(copy_piece_mb=-1)
    with pytest.raises(ValueError, match="extract.copy_by='sm': use one of copy_engine, kernel"):
        ExtractConfig(copy_by="sm")
    with pytest.raises(ValueError, match="output.max_inflight_batches=-1"):
        OutputConfig(max_inflight_batches=-1)
    assert OutputConfig(disk_budget="64GiB").disk_budget_bytes == 64 * 2**30
    assert not ModelConfig().trust_remote_code


def test_final_state_kinds_and_booleans():
    """extract.last_hidden_state=true/false mean post_norm/none."""
    assert load_config(["extract.last_hidden_state=true"]).extract.last_hidden_state == "post_norm"
    assert load_config(["extract.last_hidden_state=false"]).extract.last_hidden_state == "none"
    assert load_config(["extract.last_hidden_state=pre_norm"]).extract.last_hidden_state == "pre_norm"


def test_help_lists_every_key_with_its_meaning():
    result = subprocess.run([sys.executable, "-m", "jobs.extract", "--help"], cwd=REPO_ROOT, env=python_env(),
                            capture_output=True, text=True, check=True)
    keys = config_keys(JobConfig)
    assert {"model.path", "model.trust_remote_code", "output.disk_budget", "demo.seed", "shards"} <= set(keys)
    for key in keys:
        line = next((line for line in result.stdout.splitlines() if line.startswith(f"  {key} = ")), None)
        assert line is not None and "  # " in line, f"--help has no documented line for {key}"


@pytest.mark.parametrize("module, args, message", [
    ("jobs.extract", ["model.pth=x"], "unknown key model.pth; did you mean model.path?"),
    ("jobs.extract", ["--config", "/nonexistent/run.yaml"], "--config /nonexistent/run.yaml: no such file"),
    ("jobs.extract", ["data.shard_size=0"], "data.shard_size=0: must be an integer >= 1"),
    ("jobs.prepare", ["data.format=xml"], "data.format='xml': use one of auto, sharegpt, openai"),
    ("jobs.status", ["output.dri=/x"], "unknown key output.dri; did you mean output.dir?"),
    ("jobs.status", ["output.dir=/nonexistent"], "/nonexistent: no .manifest.json"),
])
def test_cli_mistakes_exit_2_with_one_line_before_ray(module, args, message):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=python_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr and "Ray" not in result.stderr + result.stdout
    print(f"{module} {args}: exit 2 after {time.monotonic() - started:.1f} s")


def test_pickled_weights_are_refused_unless_trusted(llama_fp32, tmp_path):
    import torch
    from safetensors.torch import load_file

    shutil.copy2(llama_fp32 / "config.json", tmp_path / "config.json")
    torch.save(load_file(llama_fp32 / "model.safetensors"), tmp_path / "pytorch_model.bin")  # the same weights, pickled
    with pytest.raises(ConfigError, match=rf"model.path={tmp_path} has only pickled weights \(pytorch_model.bin\).*"
                                          r"Convert the checkpoint to safetensors, or set model.trust_remote_code=true"):
        refuse_pickled_weights(ModelConfig(path=str(tmp_path)))
    refuse_pickled_weights(ModelConfig(path=str(tmp_path), trust_remote_code=True))
    shutil.copy2(llama_fp32 / "model.safetensors", tmp_path / "model.safetensors")
    refuse_pickled_weights(ModelConfig(path=str(tmp_path)))  # SGLang loads the safetensors, never the pickle


def test_paths_resolved_once_and_relative_ones_refused_under_a_ray_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(["model.path=m", "data.path=d.parquet", "output.dir=out"])
    resolved = resolve_paths(config, inside_ray_job=False)
    assert (resolved.model.path, resolved.data.path, resolved.output.dir) == (
        str(tmp_path / "m"), str(tmp_path / "d.parquet"), str(tmp_path / "out"))
    assert resolve_paths(load_config(["output.sink=s3://b/p", "output.dir=/abs"]), False).output.sink == "s3://b/p"
    # the node directories and a local sink too: a rerun from elsewhere would find neither its files nor its uploads
    nodes = resolve_paths(load_config(["output.dir=/abs", "output.node_dir=nodes/{node}", "output.sink=up"]), False)
    assert (nodes.output.node_dir, nodes.output.sink) == (f"{tmp_path}/nodes/{{node}}", f"{tmp_path}/up")

    with pytest.raises(ConfigError, match=r"model.path=m, data.path=d.parquet, output.dir=out: relative paths "
                                          r"under `ray job submit`.*pass absolute paths"):
        resolve_paths(config, inside_ray_job=True)
    with pytest.raises(ConfigError, match=r"^output.node_dir=n/\{node\}, output.sink=up: relative paths under"):
        resolve_paths(load_config(["model.path=/m", "data.path=/d", "output.dir=/o", "output.node_dir=n/{node}",
                                   "output.sink=up"]), True)
    with pytest.raises(ConfigError, match=r"demo.dir=eagle3-demo: relative"):
        resolve_paths(load_config([]), inside_ray_job=True)
    absolute = load_config([f"model.path={tmp_path}/m", f"data.path={tmp_path}/d.parquet", f"output.dir={tmp_path}/o"])
    assert resolve_paths(absolute, inside_ray_job=True) == absolute


def test_ray_job_is_detected_from_the_environment_ray_gives_its_driver(monkeypatch):
    monkeypatch.delenv(RAY_JOB_ENV, raising=False)
    assert not inside_ray_job() and ray_job_submission_id() == ""
    monkeypatch.setenv(RAY_JOB_ENV, json.dumps({"runtime_env": {}, "metadata": {"job_submission_id": "raysubmit_x"}}))
    assert inside_ray_job() and ray_job_submission_id() == "raysubmit_x"


def test_a_list_key_takes_its_values_comma_separated():
    assert load_config(["extract.layers=2,15,27"]).extract.layers == [2, 15, 27]
    assert load_config(["extract.layers=[2,15,27]"]).extract.layers == [2, 15, 27]
    assert load_config(["extract.layers=5"]).extract.layers == [5]
    assert load_config(["extract.layers=null"]).extract.layers is None
    with pytest.raises(ConfigError, match=r"extract.layers\[1\]: Value 'x'"):
        load_config(["extract.layers=2,x"])


def _into_hub_cache(cache, repo_id: str, model_dir, revision: str = "0123456789abcdef0123456789abcdef01234567"):
    """Lay ``model_dir``'s files into a Hugging Face cache as huggingface_hub's downloads do, with its own functions:
    blobs by hash, a snapshot of links to them, refs/main naming the revision."""
    import hashlib

    from huggingface_hub import file_download

    storage = cache / file_download.repo_folder_name(repo_id=repo_id, repo_type="model")
    for file in model_dir.iterdir():
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, blob)
        (storage / "snapshots" / revision).mkdir(parents=True, exist_ok=True)
        file_download._create_symlink(str(blob), str(storage / "snapshots" / revision / file.name))
    file_download._cache_commit_hash_for_specific_revision(str(storage), "main", revision)
    return storage / "snapshots" / revision


def test_a_hub_id_is_found_in_the_local_hugging_face_cache(llama_fp32, demo_dataset, tmp_path):
    """model.path=org/name (no such directory here) is the hub id's snapshot in HF_HUB_CACHE, found offline as
    SGLang and transformers find it; a directory of that relative path wins; an id not in the cache is one line
    saying how to download it."""
    import huggingface_hub

    cache = tmp_path / "hub"
    snapshot = _into_hub_cache(cache, "HuggingFaceTB/tiny-llama", llama_fp32)
    (repo,) = huggingface_hub.scan_cache_dir(cache).repos  # huggingface_hub reads the cache as its own
    assert repo.repo_id == "HuggingFaceTB/tiny-llama" and {r.commit_hash for r in repo.revisions} == {snapshot.name}

    def plan(model_path: str, cwd) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "jobs.plan", f"model.path={model_path}", f"data.path={demo_dataset}",
             f"output.dir={tmp_path / 'out'}", "model.engine=synthetic"],
            cwd=cwd, env=python_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1"), capture_output=True, text=True,
            timeout=120)

    found = plan("HuggingFaceTB/tiny-llama", tmp_path)
    assert found.returncode == 0, found.stderr[-3000:]
    assert f"model    {snapshot}: LlamaForCausalLM" in found.stdout, found.stdout

    local = tmp_path / "HuggingFaceTB" / "tiny-llama"
    local.mkdir(parents=True)
    config = json.loads((llama_fp32 / "config.json").read_text())
    (local / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    here = plan("HuggingFaceTB/tiny-llama", tmp_path)
    assert here.returncode == 0 and f"model    {local}: LlamaForCausalLM" in here.stdout, here.stderr[-3000:]

    missing = plan("HuggingFaceTB/SmolLM2-135M-Instruct", REPO_ROOT)
    assert missing.returncode == 2 and missing.stdout == "", missing.stderr
    assert missing.stderr.splitlines() == [
        f"error: model.path=HuggingFaceTB/SmolLM2-135M-Instruct: no such directory, and no complete snapshot of it in "
        f"the local Hugging Face cache ({cache}); HF_HUB_OFFLINE is set, so nothing is downloaded. Download it where the hub "
        "is reachable (HF_HUB_OFFLINE=0 hf download HuggingFaceTB/SmolLM2-135M-Instruct, into this cache), or name "
        "the checkpoint's directory"]


PLACE_WRITER = """
import json, os, sys, threading
from jobs.actors import cpus
cpus.MIN_WRITER_CORES = int(sys.argv[3])
started = threading.Event()
threading.Thread(target=lambda: (started.set(), threading.Event().wait()), daemon=True).start()  # a thread from before
started.wait()
said = cpus.place_this_process(cpus.WriterCpus(sys.argv[1], int(sys.argv[2])))
threads = [int(tid) for tid in os.listdir("/proc/self/task")]
print(json.dumps({"said": said, "cores": sorted({tuple(sorted(os.sched_getaffinity(t))) for t in threads}),
                  "nice": sorted({os.getpriority(os.PRIO_PROCESS, t) for t in threads})}))
"""


def test_writer_cpus_pin_and_lower_every_thread_of_a_writer():
    """``jobs.actors.cpus.place_this_process`` as a writer actor runs it (in a process of its own: it changes every
    thread of its process, those started before it too)."""
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        pytest.skip("needs two cores")

    def place(setting: str, reserved: int, min_writer_cores: int = 1) -> dict:
        result = subprocess.run([sys.executable, "-c", PLACE_WRITER, setting, str(reserved), str(min_writer_cores)],
                                cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout)

    last = available[-1]
    assert place(str(last), 0) == {"said": f"cores {last}", "cores": [[last]], "nice": [0]}  # a list: as named
    assert place("auto", 0) == {"said": "all cores", "cores": [available], "nice": [0]}  # a CPU engine: unchanged
    assert place("auto", 1) == {"said": f"cores {format_cores(available[1:])}, nice 5", "cores": [available[1:]],
                                "nice": [5]}  # off the reserved core, at a lower priority
    too_few = place("auto", 1, min_writer_cores=len(available))
    assert too_few["cores"] == [available] and too_few["nice"] == [5]
    assert too_few["said"].startswith("all cores, nice 5 ("), too_few["said"]
    refused = subprocess.run([sys.executable, "-c", PLACE_WRITER, "4096", "0", "1"], cwd=REPO_ROOT, env=python_env(),
                             capture_output=True, text=True, timeout=120)
    assert "output.writer_cpus=4096: cores 4096 are not among the cores" in refused.stderr, refused.stderr[-2000:]


def test_the_copy_pieces_reach_the_engine_in_bytes():
    pieces = load_config(["extract.copy_piece_mb=16"])
    whole = load_config(["extract.copy_piece_mb=0"])
    default = load_config([])
    assert build_engine_spec(pieces.model, pieces.extract, [1], "cuda", 100).copy_piece_bytes == 16 << 20
    assert build_engine_spec(whole.model, whole.extract, [1], "cuda", 100).copy_piece_bytes == 0
    assert build_engine_spec(default.model, default.extract, [1], "cuda", 100).copy_piece_bytes == 4 << 20
    assert build_engine_spec(default.model, default.extract, [1], "cuda", 100).copy_by == "copy_engine"
    by_kernel = load_config(["extract.copy_by=kernel"])
    assert build_engine_spec(by_kernel.model, by_kernel.extract, [1], "cuda", 100).copy_by == "kernel"
