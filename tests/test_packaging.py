"""Packaging: pyproject.toml describes the environment the CPU lock builds, the console entry points
run once installed, each checkout's own virtualenv over the shared one runs that checkout's code, pip check
reports only what the lock leaves out on purpose, cluster.yaml is valid."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT, clone_checkout, shared_site, site_of

PIP_CHECK_LINE = re.compile(r"(\S+) (\S+) requires (\S+), which is not installed\.")


@pytest.fixture(scope="module")
def venv_on_main_environment(tmp_path_factory) -> tuple[Path, Path]:
    """A fresh virtualenv (no pip of its own) that sees the main environment's packages behind its own,
    and a copy of the project's files (tracked and untracked, not ignored) to install from."""
    root = tmp_path_factory.mktemp("packaging")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site_of(venv) / "zz_main_environment.pth").write_text(f"{shared_site()}\n")
    project = clone_checkout(root / "project")
    return venv, project


def pip(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_pyproject_dependencies_are_what_the_lock_installs(venv_on_main_environment, tmp_path):
    """Resolved against the installed lock alone (--no-index), `pip install .[test]` adds this package
    and nothing else: every requirement is there, at a version the ranges accept."""
    venv, project = venv_on_main_environment
    report = tmp_path / "report.json"
    result = pip(venv, "install", "--dry-run", "--no-index", "--no-build-isolation", "--report", str(report),
                 f"{project}[test]", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["eagle3-extract"], installs


def test_installed_entry_points_run(venv_on_main_environment, tmp_path):
    venv, project = venv_on_main_environment
    result = pip(venv, "install", "--no-deps", "--no-build-isolation", str(project), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "RAY_AUTH_MODE": "disabled", "HOME": str(Path.home())}
    for command, text in (("eagle3-extract", "  model.trust_remote_code = "), ("eagle3-status", "  output.dir = "),
                          ("eagle3-export", "  dest = "), ("eagle3-plan", "  output.disk_budget = "),
                          ("eagle3-verify", "  --deep "),
                          ("eagle3-check-drafter", "Exit codes: 0 every config captures"),
                          ("eagle3-prepare", "  data.on_too_long = ")):
        ran = subprocess.run([command, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr[-2000:]
        assert f"usage: {command} " in ran.stdout and text in ran.stdout, ran.stdout
    # the installed copy is what ran, not the checkout
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import jobs; print(jobs.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout
    assert str(venv) in where


def _listing(directory: Path) -> dict[str, int]:
    return {entry.name: entry.lstat().st_mtime_ns for entry in directory.iterdir()}


def test_each_checkout_gets_its_own_venv_and_never_touches_another(private_shared_venv, tmp_path):
    """scripts/setup.sh (the README's two commands run it first) in two clones over one shared virtualenv: each clone
    gets .venv/ with the eagle3-* commands and the shared packages, running that clone's code, whichever ran
    setup last; the shared virtualenv's packages are not touched; a rerun returns at once, installing nothing."""
    shared_site = site_of(private_shared_venv)
    before = _listing(shared_site)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "EAGLE3_VENV": str(private_shared_venv)}
    clones = [clone_checkout(tmp_path / name) for name in ("first", "second")]
    for clone in clones:
        setup = subprocess.run(["bash", str(clone / "scripts" / "setup.sh")], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=300)
        assert setup.returncode == 0, setup.stderr[-3000:]
        assert f"setup: installing the project from {clone} into {clone / '.venv'} (editable)" in setup.stderr
        assert setup.stdout.strip() == str(clone / ".venv" / "bin" / "python")
    for clone in clones:
        venv = clone / ".venv"
        where = subprocess.run([str(venv / "bin" / "python"), "-c", "import jobs, omegaconf; print(jobs.__file__)"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
        assert where == str(clone / "jobs" / "__init__.py")
        on_path = {**env, "PATH": f"{venv / 'bin'}:/usr/bin:/bin", "RAY_AUTH_MODE": "disabled"}
        ran = subprocess.run(["eagle3-extract", "--help"], cwd=tmp_path, env=on_path, capture_output=True, text=True,
                             timeout=120)
        assert ran.returncode == 0 and "usage: eagle3-extract " in ran.stdout, ran.stderr[-2000:]
        ray = subprocess.run(["ray", "--version"], env=on_path, capture_output=True, text=True, timeout=60)
        assert ray.returncode == 0 and "ray, version" in ray.stdout, ray.stderr[-2000:]
    assert _listing(shared_site) == before, "setup.sh changed the shared virtualenv's packages"
    started = time.monotonic()
    again = subprocess.run(["bash", str(clones[0] / "scripts" / "setup.sh")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True, timeout=60)
    assert time.monotonic() - started < 5 and again.stderr == "", again.stderr
    assert again.stdout.strip() == str(clones[0] / ".venv" / "bin" / "python")


def test_two_setups_at_once_install_once_and_pip_is_the_venvs_own(private_shared_venv, tmp_path):
    """Two `bash scripts/setup.sh` started together (two demos at once) in one clone: one installs, the other waits
    for it and finds everything done. In the shell with .venv activated, `pip` is that virtualenv's."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "EAGLE3_VENV": str(private_shared_venv)}
    clone = clone_checkout(tmp_path / "clone")
    setups = [subprocess.Popen(["bash", str(clone / "scripts" / "setup.sh")], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [setup.communicate(timeout=300) for setup in setups]
    assert [setup.returncode for setup in setups] == [0, 0], outputs
    assert all(stdout.strip() == str(clone / ".venv" / "bin" / "python") for stdout, _ in outputs)
    installing = f"setup: installing the project from {clone} into {clone / '.venv'} (editable)"
    assert sum(installing in stderr for _, stderr in outputs) == 1, outputs
    activated = subprocess.run(["bash", "-c", "source .venv/bin/activate && command -v pip && pip show eagle3-extract"],
                               cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert activated.returncode == 0, activated.stderr[-2000:]
    assert activated.stdout.splitlines()[0] == str(clone / ".venv" / "bin" / "pip")
    assert f"Editable project location: {clone}" in activated.stdout, activated.stdout


def test_the_commands_check_for_every_dependency():
    """jobs.environment (a command's one-line refusal on a Python without the project's packages) checks exactly
    pyproject.toml's dependencies, each through the module the code imports."""
    from jobs.environment import REQUIRED_MODULES

    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0] for requirement in declared}
    assert set(REQUIRED_MODULES) == names
    for module in REQUIRED_MODULES.values():
        assert importlib.util.find_spec(module) is not None, module


def _listed(name: str) -> list[str]:
    return [line.strip() for line in (REPO_ROOT / "requirements" / name).read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_pip_check_reports_only_what_the_lock_leaves_out():
    """SGLang is installed --no-deps; pip check lists its CUDA-side requirements (each one named in
    requirements/sglang-left-out.txt), and of the two trainers installed --no-deps for their loaders exactly the
    lines requirements/peers-left-out.txt holds, and must find nothing else wrong."""
    left_out = {line.lower() for line in _listed("sglang-left-out.txt")}
    peers = set(_listed("peers-left-out.txt"))
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    reported, peers_reported = set(), set()
    for line in result.stdout.splitlines():
        if line.strip() in peers:
            peers_reported.add(line.strip())
            continue
        match = PIP_CHECK_LINE.fullmatch(line.strip())
        assert match and match.group(1) == "sglang", f"pip check: {line}"
        reported.add(match.group(3).lower())
    assert reported == left_out
    assert peers_reported == peers


def test_cluster_yaml_is_valid_and_safe():
    from ray.autoscaler._private.util import prepare_config, validate_config

    text = (REPO_ROOT / "cluster.yaml").read_text()
    config = yaml.safe_load(text)
    validate_config(prepare_config(yaml.safe_load(text)))  # Ray's own schema, as `ray up` checks it

    start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start and "0.0.0.0" not in text
    # data-parallel workers: the head's instance, named for output.node_dir's {node}
    types = config["available_node_types"]
    assert types["gpu_worker"]["node_config"]["InstanceType"] == types["gpu_head"]["node_config"]["InstanceType"]
    assert "eagle3-node" in " ".join(config["worker_start_ray_commands"])
    setup = " ".join(config["setup_commands"])
    assert "lsblk" in setup and "/dev/nvme[" not in setup  # devices found, not assumed
    assert "stops the node" in text.lower() and "output.sink" in text  # the NVMe-loss warning

    # it installs the `gpu` extra, which pins what ran on the H200, with a python requires-python accepts
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert '[gpu]"' in setup
    gpu = pyproject["project"]["optional-dependencies"]["gpu"]
    assert "sglang==0.5.17" in gpu and "torch==2.11.0" in gpu
    python = re.search(r"--python (3\.\d+)", setup).group(1)
    minimum = pyproject["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, python.split("."))) >= tuple(map(int, minimum.split(".")))
