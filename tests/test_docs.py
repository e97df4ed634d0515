"""The README and docs/ say what the code is: the generated reference is current, every command's ``--help``
lists exactly the keys it reads, every path, module and name the pages give exists, every link lands, and the
README fits a screen or two; every README command is run as printed by a test or says why not, and parses.
No Ray, no model."""

from __future__ import annotations

import ast
import difflib
import importlib
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from jobs.config import config_keys
from jobs.reference import COMMANDS, PAGE, REGENERATE, exit_codes, render
from jobs.reference import main as reference_main
from tests.conftest import REPO_ROOT, readme_commands

README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_LIMIT = 12_000
"""Bytes: the README is the first screen (what it is, the two commands, a real run, where to read on)."""

PACKAGES = ("benchmarks", "common", "conversations", "extractor", "inputs", "jobs", "runtime", "storage", "testbeds",
            "tests", "training")
PROJECT_DIRS = (*PACKAGES, ".ci", "conf", "dashboards", "docs", "requirements", "scripts")
SGLANG_DIRS = ("models", "model_runner_components", "model_loader", "model_executor", "python")
"""Roots of SGLang's source tree (``python/sglang/srt/...``) that the pages name SGLang's files under."""
NOT_YET: dict[str, str] = {}
"""Paths the pages name before they exist here; each entry goes once its file lands."""


def _text(page: Path) -> str:
    return page.read_text()


def _fenced(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE)


def _spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return re.findall(r"`([^`\n]+)`", prose)


def _module_file(module: str) -> Path | None:
    base = REPO_ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
            if any(isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets):
                names.update(ast.literal_eval(node.value))  # a package's lazy names (module __getattr__)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _dotted_problem(dotted: str) -> str | None:
    """``a.b.c``: the longest prefix that is a project module, then a name defined at its top level."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if rest and rest[0] not in _top_level_names(path) and _module_file(".".join(parts[:cut + 1])) is None:
            return f"{'.'.join(parts[:cut])} defines no {rest[0]}"
        return None
    return "no such module"


# -- the generated reference ---------------------------------------------------------------------

def test_reference_page_is_what_the_code_says():
    expected, current = render(), PAGE.read_text() if PAGE.is_file() else ""
    diff = "".join(list(difflib.unified_diff(current.splitlines(True), expected.splitlines(True),
                                             "docs/reference.md", "generated", n=1))[:40])
    assert current == expected, f"docs/reference.md is not what the code says; rewrite it with {REGENERATE}\n{diff}"


def test_asking_the_reference_command_for_help_writes_nothing(capsys):
    before = PAGE.stat().st_mtime_ns
    assert reference_main(["--help"]) == 0 and "--check" in capsys.readouterr().out
    assert reference_main(["--chek"]) == 2 and "unknown arguments --chek" in capsys.readouterr().err
    assert PAGE.stat().st_mtime_ns == before


def test_every_exit_code_constant_has_a_row_and_every_row_a_constant():
    rows = exit_codes()  # raises naming the code or constant that has no partner
    assert [row[0] for row in rows][:2] == ["0", "1"] and rows[-1][0] == "129, 130, 143"


@pytest.mark.parametrize("module, schema", [(module, command.schema) for command in COMMANDS
                                            for module in command.modules])
def test_help_lists_exactly_the_keys_the_command_reads(module, schema, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    listed = re.findall(r"^  ([\w.]+) = ", capsys.readouterr().out, re.MULTILINE)
    assert listed == config_keys(schema)


# -- the README --------------------------------------------------------------------------------

def test_readme_is_short_and_links_every_docs_page():
    text = _text(README)
    assert len(text.encode()) < README_LIMIT, f"README.md is {len(text.encode())} bytes; move detail into docs/"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)[)#]", text))
    assert linked == {f"docs/{page.name}" for page in DOCS}
    for heading in ("## Two commands", "## A real run", "## Does the engine match matter?"):
        assert heading in text
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh", "python -m jobs.plan", "ray job submit",
                    "python -m jobs.extract", "python -m jobs.status"):
        assert command in text


RUN_AS_PRINTED = {
    "bash scripts/demo.sh": "tests/test_readme.py::test_the_demos_run_as_printed_in_any_order",
    "source .venv/bin/activate": "tests/test_readme.py::test_the_demos_run_as_printed_in_any_order",
}
"""README commands a test runs exactly as printed, and the test."""
NOT_RUNNABLE_HERE = {
    "bash scripts/test.sh": "it is the suite itself (CI runs it: .ci/run)",
    "python -m jobs.prepare model.path=/models/target data.path=chat.jsonl output.dir=/data/tokens":
        "a checkpoint at /models/target; tests/conversations/test_prepare.py runs prepare -> extract on a tiny one",
    "python -m jobs.extract model.path=/models/target data.path=/data/tokens output.dir=/data/states":
        "the same placeholder checkpoint",
    "python -m jobs.verify output.dir=/data/states": "the run of the line before",
    "python -m jobs.pipeline model.path=/models/target data.path=chat.jsonl output.dir=/data/run to=specforge":
        "the same placeholder checkpoint; tests/jobs/test_pipeline.py runs it on the demo's conversations",
    "python -m jobs.plan --config conf/kimi.yaml data.path=/mnt/nvme/data/train.parquet "
    "output.dir=/mnt/nvme/eagle3/run1": "Kimi-K2.5's checkpoint (tests/extractor/test_kimi.py plans its published config.json)",
    "export RAY_ADDRESS=http://127.0.0.1:8265": "a real cluster's tunnelled Jobs API; tests/test_readme.py exports its "
                                                "own head's",
    "ray job submit --working-dir . --runtime-env conf/runtime-env.yaml -- python -m jobs.extract --config "
    "conf/kimi.yaml data.path=/mnt/nvme/data/train.parquet output.dir=/mnt/nvme/eagle3/run1":
        "Kimi-K2.5 on 8 GPUs; tests/test_readme.py runs it as printed up to the job's keys (the demo's instead)",
    "ray job logs -f raysubmit_...": "a submission id of a real cluster",
    "python -m jobs.status output.dir=/mnt/nvme/eagle3/run1": "the real run above",
    "python -m jobs.verify output.dir=/mnt/nvme/eagle3/run1": "the real run above",
}
"""README commands that cannot run on a CPU box as printed, and why; each is checked to parse."""


def test_every_readme_command_runs_as_printed_or_says_why_not():
    commands = readme_commands()
    assert sorted(set(commands)) == sorted({*RUN_AS_PRINTED, *NOT_RUNNABLE_HERE}), \
        "a README command must be run by a test as printed (RUN_AS_PRINTED) or say why not (NOT_RUNNABLE_HERE)"
    for command, test in RUN_AS_PRINTED.items():
        path, name = test.split("::")
        assert f"def {name}(" in (REPO_ROOT / path).read_text(), test


def _help_of(module: str, capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(module).main(["--help"])
    assert stopped.value.code == 0
    return capsys.readouterr().out


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    return [key for name, value in tree.items()
            for key in (_leaves(value, f"{prefix}{name}.") if isinstance(value, dict) else [f"{prefix}{name}"])]


def _check_job_command(words: list[str], capsys) -> None:
    """``python -m jobs.X ...``: the module exists and its --help lists every key and option the command gives;
    a --config file exists and holds only keys the command reads."""
    assert words[:2] == ["python", "-m"] and _module_file(words[2]), words
    listed = _help_of(words[2], capsys)
    keys = set(re.findall(r"^  ([\w.]+) = ", listed, re.MULTILINE))
    args = iter(words[3:])
    for word in args:
        if word.startswith("--"):
            assert word in listed, f"{words[2]} has no option {word}"
            if word == "--config":
                config = REPO_ROOT / next(args)
                assert set(_leaves(yaml.safe_load(config.read_text()))) <= keys, config
        else:
            assert word.split("=", 1)[0] in keys, f"{words[2]} reads no key {word}"


@pytest.mark.parametrize("command", NOT_RUNNABLE_HERE)
def test_each_readme_command_not_run_here_parses(command, capsys):
    words = command.split()
    if words[0] == "python":
        _check_job_command(words, capsys)
    elif words[:3] == ["ray", "job", "submit"]:
        from ray.dashboard.modules.job.cli import job_cli_group
        from ray.runtime_env import RuntimeEnv

        options = {name for param in job_cli_group.commands["submit"].params for name in param.opts}
        cut = words.index("--")
        for option in (word for word in words[3:cut] if word.startswith("--")):
            assert option in options, option
        RuntimeEnv(**yaml.safe_load((REPO_ROOT / words[words.index("--runtime-env") + 1]).read_text()))
        _check_job_command(words[cut + 1:], capsys)
    elif words[:3] == ["ray", "job", "logs"]:
        from ray.dashboard.modules.job.cli import job_cli_group

        assert "-f" in {name for param in job_cli_group.commands["logs"].params for name in param.opts}
    elif words[0] == "bash":
        assert subprocess.run(["bash", "-n", str(REPO_ROOT / words[1])]).returncode == 0
    else:
        assert words[0] == "export" and re.fullmatch(r"RAY_ADDRESS=http://[\d.]+:\d+", words[1]), command


# -- everything the pages name exists -----------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_links_land(page):
    text = _text(page)
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        landing = (page.parent / file).resolve() if file else page
        if not landing.exists():
            problems.append(f"{target}: no such file")
        elif anchor and landing.suffix == ".md":
            anchors = {_slug(line.lstrip("#")) for line in landing.read_text().splitlines() if line.startswith("#")}
            if anchor not in anchors:
                problems.append(f"{target}: no heading with that anchor in {landing.name}")
    assert not problems, f"{page.name}: " + "; ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_named_paths_modules_and_names_exist(page):
    text = _text(page)
    code = _spans(text) + _fenced(text)
    problems = []
    for path in sorted({p for chunk in code for p in re.findall(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.py)\b", chunk)}):
        root = path.split("/")[0]
        if path in NOT_YET:
            if (REPO_ROOT / path).exists():
                problems.append(f"{path} exists now: remove it from NOT_YET in tests/test_docs.py")
        elif "/" not in path:
            problems.append(f"{path}: name the file with its directory")
        elif root in PROJECT_DIRS:
            if not (REPO_ROOT / path).is_file():
                problems.append(f"{path}: no such file")
        elif root not in SGLANG_DIRS:
            problems.append(f"{path}: neither a path of this project nor of SGLang's tree ({', '.join(SGLANG_DIRS)})")
    modules = set(re.findall(r"python -m\s+([\w.]+)", text))
    imports = re.findall(r"^\s*from\s+([\w.]+)\s+import\s+([\w, ]+)", "\n".join(code), re.MULTILINE)
    modules |= {module for module, _ in imports}
    dotted = {token for chunk in _spans(text)
              for token in re.findall(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.\w+)+)", chunk)}
    for module in sorted(modules):
        if module.split(".")[0] in PACKAGES and _module_file(module) is None:
            problems.append(f"{module}: no such module")
    for module, names in imports:
        if module.split(".")[0] in PACKAGES and _module_file(module) is not None:
            for name in (n.strip() for n in names.split(",") if n.strip()):
                problem = _dotted_problem(f"{module}.{name}")
                if problem:
                    problems.append(f"from {module} import {name}: {problem}")
    for name in sorted(dotted):
        problem = _dotted_problem(name)
        if problem:
            problems.append(f"{name}: {problem}")
    assert not problems, f"{page.name}: " + "; ".join(problems)


def test_the_checks_catch_what_they_should():
    """The path and module checks above are not vacuous: names of modules that do not exist fail them."""
    assert _dotted_problem("storage.training") == "storage defines no training"
    assert _dotted_problem("jobs.train") == "jobs defines no train"
    assert _dotted_problem("storage.manifest.read_manifest") is None
    assert _dotted_problem("storage.manifest.no_such_thing") == "storage.manifest defines no no_such_thing"
    assert not (REPO_ROOT / "storage/config.py").exists()
    assert _slug("Checking a run: `jobs.verify`") == "checking-a-run-jobsverify"
