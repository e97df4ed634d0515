"""The README's commands as a new user pastes them, in real processes: the demos in a fresh clone, in any order,
and the real run's `ray job submit` against a Ray head started from a Python that lacks the project's packages.

Which README command runs where, and why the others cannot run here: ``tests/test_docs.py``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from packaging.requirements import Requirement

from runtime.errors import EXIT_BAD_INPUT
from storage.manifest import DONE, read_manifest
from tests.conftest import REPO_ROOT, clone_checkout, free_port, ray_temp_dir, readme_commands
from tests.helpers import assert_run_verifies, read_all

DEMO_SAMPLES = 48
DEMO_SHARDS = 3  # 48 samples, 16 per shard


def shell(command: str, cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    """``command`` exactly as printed, in bash."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def user_shell(**extra: str) -> dict[str, str]:
    """A user's shell: no Ray address, no test-session switches, no path into the checkout the tests run from."""
    dropped = ("RAY_ADDRESS", "PYTHONPATH", "VIRTUAL_ENV", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
               "RAY_prestart_worker_first_driver")
    return {**{key: value for key, value in os.environ.items() if key not in dropped}, **extra}


def run_demo(clone: Path, command: str, env: dict[str, str]) -> Path:
    """``command`` in ``clone``: every sample of the demo written and verified; returns the output dir it printed."""
    result = shell(command, clone, env)
    assert result.returncode == 0, f"{command}: {result.stderr[-3000:]}"
    done = re.search(rf"^{DEMO_SHARDS} of {DEMO_SHARDS} shards done in (\S+): {DEMO_SAMPLES} samples", result.stdout,
                     re.MULTILINE)
    assert done, result.stdout
    out = Path(done.group(1))
    assert out.parent == clone / "eagle3-demo"
    assert sorted(read_all(out)) == list(range(DEMO_SAMPLES))
    assert_run_verifies(out)
    return out


def _two_commands() -> list[str]:
    commands = readme_commands()
    return commands[:commands.index("source .venv/bin/activate") + 1]


def test_the_demos_run_as_printed_in_any_order(private_shared_venv, tmp_path):
    """In a fresh clone: `bash scripts/demo.sh`, then `bash scripts/demo.sh demo.arch=kimi_k25` (which once failed
    after ~30 s of Ray: the first demo's output had other content), then `bash scripts/demo.sh` again (every shard
    done: nothing to do, no Ray); then the README's `source .venv/bin/activate` gives the clone's commands."""
    demo, _, activate = _two_commands()
    assert demo == "bash scripts/demo.sh" and activate == "source .venv/bin/activate"
    clone = clone_checkout(tmp_path / "clone")
    env = user_shell(EAGLE3_VENV=str(private_shared_venv))
    llama = run_demo(clone, demo, env)
    kimi = run_demo(clone, f"{demo} demo.arch=kimi_k25", env)
    assert kimi != llama and "model-kimi_k25-" in read_manifest(kimi)["content"]["model.path"]
    assert f"`eagle3-demo/{llama.name}/`" in (REPO_ROOT / "README.md").read_text()  # where the README says

    again = shell(demo, clone, env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"nothing to do: all {DEMO_SHARDS} shards in {llama} are done" in again.stdout
    assert "Ray was not started" in again.stdout and "Ray cluster" not in again.stderr

    activated = shell(f"{activate} && command -v python && eagle3-status output.dir={kimi}", clone, env)
    assert activated.returncode == 0, activated.stderr[-3000:]
    assert activated.stdout.splitlines()[0] == str(clone / ".venv" / "bin" / "python")
    assert re.search(rf"^done +{DEMO_SHARDS} +{DEMO_SAMPLES} ", activated.stdout, re.MULTILINE), activated.stdout


@pytest.mark.extended
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3"])
def test_the_other_demos_run_as_printed(private_shared_venv, tmp_path, arch):
    """The README's other demos, each `bash scripts/demo.sh demo.arch=...` as printed, in a fresh clone."""
    command = f"{_two_commands()[0]} demo.arch={arch}"
    assert f"demo.arch={arch}`" in (REPO_ROOT / "README.md").read_text()
    clone = clone_checkout(tmp_path / "clone")
    run_demo(clone, command, user_shell(EAGLE3_VENV=str(private_shared_venv)))


# -- `ray job submit` to a cluster whose Ray runs another Python ----------------------------------------------

def _closure(requirement: str) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``requirement`` needs, itself included (extras and markers honoured)."""
    found: dict[str, tuple[importlib.metadata.Distribution, set[str]]] = {}

    def visit(name: str, extras: set[str]) -> None:
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in found and extras <= found[key][1]:
            return
        distribution = importlib.metadata.distribution(name)
        found.setdefault(key, (distribution, set()))[1].update(extras)
        for line in distribution.requires or []:
            needed = Requirement(line)
            if needed.marker and not any(needed.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            visit(needed.name, set(needed.extras))

    root = Requirement(requirement)
    visit(root.name, set(root.extras))
    return [distribution for distribution, _ in found.values()]


def bare_python_with_ray(venv: Path) -> Path:
    """A virtualenv holding what `pip install ray[default]` gives (the very files of this environment's copies,
    linked) and nothing else: no omegaconf, pyarrow, torch, SGLang or this project. Returns its bin/."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                               check=True).stdout.strip())
    for distribution in _closure("ray[default]"):
        base = Path(distribution.locate_file(""))
        for top in {Path(str(file)).parts[0] for file in distribution.files or []} - {"..", "bin"}:
            if (base / top).exists() and not (site / top).exists():
                (site / top).symlink_to(base / top)
    ray = venv / "bin" / "ray"
    ray.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n")
    ray.chmod(0o755)
    return venv / "bin"


def _kill_tree(temp_dir: Path) -> None:
    processes = {}
    for process in psutil.process_iter(["cmdline"]):
        if str(temp_dir) in " ".join(process.info["cmdline"] or []):
            processes[process.pid] = process
            try:
                processes.update({child.pid: child for child in process.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
    for process in processes.values():
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(processes.values()), timeout=10)
    for process in alive:
        process.kill()


@pytest.fixture(scope="module")
def bare_bin(tmp_path_factory) -> Path:
    """The bin/ of a bare Python with Ray alone (``bare_python_with_ray``), for the file."""
    return bare_python_with_ray(tmp_path_factory.mktemp("bare") / "venv")


@pytest.fixture
def foreign_head(bare_bin, tmp_path) -> Iterator[str]:
    """A Ray head on 127.0.0.1 started from ``bare_bin`` (its `python` the one that runs a job's entrypoint), on a
    machine whose ~/eagle3-venv is the project's virtualenv (as cluster.yaml installs it): yields its dashboard
    URL."""
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / "eagle3-venv").symlink_to(Path(sys.prefix))
    (home / ".cache" / "eagle3-extract").symlink_to(Path.home() / ".cache" / "eagle3-extract")  # a head that ran before
    with ray_temp_dir("fh") as temp_dir:
        ports = {name: free_port() for name in ("gcs", "dashboard", "metrics", "agent", "client")}
        env = {"HOME": str(home), "PATH": f"{bare_bin}:/usr/bin:/bin", "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        started = subprocess.run(
            [str(bare_bin / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={ports['gcs']}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
             f"--metrics-export-port={ports['metrics']}", f"--dashboard-agent-listen-port={ports['agent']}",
             f"--ray-client-server-port={ports['client']}", f"--temp-dir={temp_dir}", "--num-cpus=3",
             "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=180,
        )
        try:
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
            yield f"http://127.0.0.1:{ports['dashboard']}"
        finally:
            _kill_tree(temp_dir)


def test_ray_job_submit_as_printed_to_a_ray_of_another_python(foreign_head, bare_bin, llama_fp32, demo_dataset,
                                                              tmp_path):
    """The README's real run, `ray job submit --working-dir . --runtime-env conf/runtime-env.yaml -- python -m
    jobs.extract` exactly as printed up to the job's own keys (a tiny Llama's, with absolute paths, instead of
    Kimi-K2.5 on 8 GPUs), against a head whose Python has Ray alone: the job runs in the project's virtualenv,
    driver and workers (SGLang's extractor, the writers), and completes. Without the runtime env the job stops with
    one line saying what to do; the README's other commands, on such a Python, say the same in one line (exit 2)."""
    submit = next(command for command in readme_commands() if command.startswith("ray job submit"))
    printed = submit[:submit.index("python -m jobs.extract") + len("python -m jobs.extract")]
    assert "--runtime-env conf/runtime-env.yaml" in printed
    ray = Path(sys.executable).parent / "ray"
    env = user_shell(RAY_ADDRESS=foreign_head, PATH=f"{ray.parent}:{os.environ['PATH']}")
    out = tmp_path / "out"
    keys = f"model.path={llama_fp32} data.path={demo_dataset} output.dir={out} data.shard_size=10"

    bare = shell(f"{printed.replace(' --runtime-env conf/runtime-env.yaml', '')} {keys}", REPO_ROOT, env)
    assert bare.returncode != 0, bare.stdout[-3000:]
    refusal = sorted({line for line in bare.stdout.splitlines() if line.startswith("error: ")})  # log and status
    assert len(refusal) == 1 and "lacks" in refusal[0] and "omegaconf" in refusal[0], bare.stdout[-3000:]
    assert "submit with --runtime-env conf/runtime-env.yaml" in refusal[0] and "Traceback" not in bare.stdout
    assert not out.exists()

    ran = shell(f"{printed} {keys}", REPO_ROOT, env)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert f"2 of 2 shards done in {out}: 20 samples" in ran.stdout, ran.stdout[-3000:]
    assert all(record["state"] == DONE for record in read_manifest(out)["shards"])
    assert sorted(read_all(out)) == list(range(20))

    for command in (c for c in readme_commands() if c.startswith(("python -m jobs.prepare", "python -m jobs.plan"))):
        local = shell(command, REPO_ROOT, user_shell(PATH=f"{bare_bin}:/usr/bin:/bin"))
        assert local.returncode == EXIT_BAD_INPUT and local.stdout == "", local.stderr
        assert local.stderr.count("\n") == 1 and "lacks" in local.stderr and "scripts/setup.sh" in local.stderr


def test_a_bare_python_is_what_it_claims(bare_bin):
    """The foreign head's Python above holds Ray and none of the project's packages."""
    found = subprocess.run([str(bare_bin / "python"), "-c", "import importlib.util as u, ray; print(ray.__version__, "
                            "[m for m in ('omegaconf', 'pyarrow', 'torch', 'sglang') if u.find_spec(m)])"],
                           capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert found[0] == importlib.metadata.version("ray") and found[1].strip() == "[]"
