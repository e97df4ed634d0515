"""The layout's rules, read from the source (ast, no import runs): who may import whom.

- Only ``extractor/`` imports SGLang.
- ``storage/`` (the on-disk format, imported by writer processes) imports nothing of ``jobs``, ``conversations``,
  ``inputs``, ``runtime``, ``training`` or ``extractor``; ``training/`` (what consumes a run) nothing of ``jobs`` or
  ``conversations``.
- ``common/`` (the shared config checks) imports nothing of the project; ``runtime/`` (what a command runs on:
  exit codes, signals, the Ray session, the display, output.dir's lock) of the project only ``common``.
- Two packages of commands: ``jobs/`` (the extraction job, and every command) and ``conversations/`` (the
  conversations pipeline ``jobs.prepare`` runs). ``conversations`` imports nothing of ``jobs``; what both share sits
  below both: ``runtime/``, and ``inputs/`` (the files behind ``data.path``, the demos), which imports nothing of
  either.
- The driver (``jobs.driver``) is imported, of the rest of the product, only by the commands at the top of
  ``jobs/`` (``jobs.extract``, ``jobs.pipeline``, ``jobs.status``): all else in ``jobs/`` sits below it.
- Config modules import no implementation: only other config modules, ``runtime.errors``, the
  shared checks and the format's names (``storage.schema``).
- No import circles, counting every import: ``if TYPE_CHECKING:`` (a circle of types is still a circle)
  and inside functions (an import deferred to a call is still an arrow back); a package's ``__init__``
  may import its submodules, a submodule never its ``__init__`` (``storage``'s modules import each
  other, never the package itself).
- Around the product: the product imports none of ``testbeds``, ``benchmarks`` or ``tests``.
  ``testbeds/`` (the models the tests and the benchmarks run on) imports, of the project, only
  ``storage`` (its atomic file helpers); the benchmarks import nothing of ``tests``; and the tests
  import a benchmark only in the test file whose subject that benchmark is (``BENCHMARK_TESTS``):
  what tests and benchmarks share comes from ``testbeds``, never from ``benchmarks``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO_ROOT

PACKAGES = ("common", "conversations", "extractor", "inputs", "jobs", "runtime", "storage", "training")
"""The product: what ``pip install`` installs."""
AROUND = ("testbeds", "benchmarks", "tests")
"""What sits around the product: the models it is tried on, its benchmarks, its tests."""
CONFIG_MAY_IMPORT = ("common.checks", "runtime.errors", "storage.schema")
TESTBEDS_MAY_IMPORT = ("storage",)
BENCHMARK_TESTS = {
    "benchmarks.test_benchmarks": ("benchmarks.throughput", "benchmarks.extract_wall"),
    "benchmarks.test_acceptance_cpu": ("benchmarks.acceptance",),
    "benchmarks.test_quantize_int4": ("benchmarks.acceptance.quantize_int4",),
    "benchmarks.test_jit_prebuild": ("benchmarks.gpu.jit_prebuild",),
}
"""The test files whose subject is a benchmark, and the benchmark each may import."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    return {_module_name(path): path for package in packages for path in (REPO_ROOT / package).rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Modules ``path`` imports anywhere: at module level, under ``if`` (``TYPE_CHECKING`` too) and inside
    functions (``from a.b import c`` gives ``a.b`` and ``a.b.c``; callers keep what exists)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _violations(rule, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    return sorted(
        f"{name} imports {imported}"
        for name, path in _modules(packages).items()
        for imported in _imports(path)
        if rule(name, imported)
    )


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_only_the_extractor_imports_sglang():
    assert _violations(lambda name, imported: _within(imported, "sglang") and not _within(name, "extractor")) == []


def test_storage_imports_only_itself():
    others = ("conversations", "extractor", "inputs", "jobs", "runtime", "training")
    assert _violations(
        lambda name, imported: _within(name, "storage") and any(_within(imported, p) for p in others)) == []


def test_common_imports_nothing_of_the_project():
    assert _violations(lambda name, imported: _within(name, "common") and any(
        _within(imported, p) for p in PACKAGES if p != "common")) == []


def test_runtime_imports_of_the_project_only_common():
    assert _violations(lambda name, imported: _within(name, "runtime") and any(
        _within(imported, p) for p in PACKAGES if p not in ("runtime", "common"))) == []


def test_conversations_import_nothing_of_the_job():
    """``jobs.prepare`` and ``jobs.pipeline`` import the conversations pipeline: an import back would be a circle of
    packages."""
    assert _violations(lambda name, imported: _within(name, "conversations") and _within(imported, "jobs")) == []


def test_inputs_import_neither_package_of_commands():
    assert _violations(lambda name, imported: _within(name, "inputs") and any(
        _within(imported, p) for p in ("jobs", "conversations"))) == []


def test_training_imports_nothing_of_the_job():
    assert _violations(lambda name, imported: _within(name, "training") and any(
        _within(imported, p) for p in ("jobs", "conversations"))) == []


def test_config_modules_import_no_implementation():
    modules = _modules()

    def is_config(name: str) -> bool:
        return name.rsplit(".", 1)[-1] == "config"

    def breaks(name: str, imported: str) -> bool:
        return (is_config(name) and imported in modules and not is_config(imported)
                and imported not in CONFIG_MAY_IMPORT)

    assert _violations(breaks) == []


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles in ``graph`` (module -> the project's modules it imports), each from its first module back to it."""
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 finished

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return circles


def test_no_import_circles():
    modules = _modules((*PACKAGES, *AROUND))
    graph = {name: {i for i in _imports(path) if i in modules and i != name} for name, path in modules.items()}
    assert _circles(graph) == []


def _is_command(name: str) -> bool:
    """A command: a module at the top of ``jobs/`` that runs as ``python -m`` (``jobs.extract``, ``jobs.status``)."""
    path = _modules()[name]
    return name.count(".") == 1 and _within(name, "jobs") and 'if __name__ == "__main__":' in path.read_text()


def test_only_the_commands_import_the_driver():
    """The driver (``jobs.driver``) runs one extraction: of the rest of the product only the commands above it import
    it; the config tree, what plans a run, the actors and the output directory's budget and config
    (``jobs.outdir``) all sit below it, and so do ``conversations``, ``inputs`` and ``runtime``."""
    assert _violations(lambda name, imported: _within(imported, "jobs.driver") and not _within(name, "jobs.driver")
                       and not _is_command(name)) == []
    assert _violations(lambda name, imported: _within(name, "jobs.outdir") and any(
        _within(imported, p) for p in ("jobs.planning", "jobs.actors"))) == []


def test_storage_modules_import_submodules_not_the_package():
    assert _violations(lambda name, imported: name.startswith("storage.") and imported == "storage") == []


def test_the_product_imports_nothing_around_it():
    assert _violations(lambda name, imported: any(_within(imported, p) for p in AROUND)) == []


def test_testbeds_import_of_the_project_only_storage():
    others = [p for p in (*PACKAGES, *AROUND) if p not in (*TESTBEDS_MAY_IMPORT, "testbeds")]
    assert _violations(lambda name, imported: any(_within(imported, p) for p in others), ("testbeds",)) == []


def test_benchmarks_import_nothing_of_the_tests():
    assert _violations(lambda name, imported: _within(imported, "tests"), ("benchmarks",)) == []


def _imports_a_benchmark_it_does_not_test(name: str, imported: str) -> bool:
    if not _within(imported, "benchmarks") or imported == "benchmarks":
        return False
    return not any(_within(imported, subject) for subject in BENCHMARK_TESTS.get(name.removeprefix("tests."), ()))


def test_tests_import_a_benchmark_only_where_it_is_the_subject():
    """tests/helpers.py, tests/conftest.py and every other test file take the models they need from
    testbeds; only a benchmark's own test file imports that benchmark."""
    assert _violations(_imports_a_benchmark_it_does_not_test, ("tests",)) == []


def test_the_rules_see_real_imports():
    """The checks above would notice: extractor does import SGLang and jobs' config imports other config."""
    modules = _modules()
    assert any(_within(i, "sglang") for i in _imports(modules["extractor.sglang_compat"]))
    # the regeneration's SGLang is extractor.generator's, which conversations.regenerate runs in its actor
    assert "sglang" in _imports(modules["extractor.generator"])
    assert "extractor.generator" in _imports(modules["conversations.regenerate"])
    assert "runtime.cluster.session" in _imports(modules["conversations.pipeline"])
    assert "inputs.files" in _imports(modules["conversations.reader"])
    assert "conversations.pipeline" in _imports(modules["jobs.prepare"])
    assert "extractor.config" in _imports(modules["jobs.config"])
    assert "common.checks" in modules and "storage.schema" in _imports(modules["jobs.outdir.config"])
    assert "jobs.outdir.budget" in _imports(modules["jobs.planning.preflight"])
    around = _modules(AROUND)
    assert "testbeds.smollm2" in _imports(around["tests.helpers"])
    assert "storage.atomic" in _imports(around["testbeds.smollm2"])
    assert _imports_a_benchmark_it_does_not_test("tests.helpers", "benchmarks.smollm2")
    assert _imports_a_benchmark_it_does_not_test("tests.benchmarks.test_benchmarks", "benchmarks.acceptance.stats")
    assert not _imports_a_benchmark_it_does_not_test("tests.benchmarks.test_acceptance_cpu",
                                                  "benchmarks.acceptance.stats")


def test_test_modules_import_only_the_shared_helpers():
    """Test modules share code through tests.helpers and tests.conftest, never through one another."""
    offending = sorted(
        f"{path.relative_to(REPO_ROOT)} imports {imported}"
        for path in (REPO_ROOT / "tests").rglob("test_*.py")
        for imported in _imports(path)
        if _within(imported, "tests") and imported.rsplit(".", 1)[-1].startswith("test_")
    )
    assert offending == []


def test_the_circle_check_sees_types_deferred_imports_and_a_submodule_importing_its_package(tmp_path):
    """Imports under ``if TYPE_CHECKING:`` and inside functions count; a package's ``__init__`` importing its
    submodule is no circle, until the submodule imports the ``__init__`` back."""
    module = tmp_path / "module.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.types import Shard\n"
                      "def later():\n    import pkg.other\n")
    assert _imports(module) == {"typing", "typing.TYPE_CHECKING", "pkg.types", "pkg.types.Shard", "pkg.other"}
    assert _circles({"pkg": {"pkg.writer", "pkg.schema"}, "pkg.writer": {"pkg.schema"}, "pkg.schema": set()}) == []
    assert _circles({"pkg": {"pkg.writer"}, "pkg.writer": {"pkg"}}) == [["pkg", "pkg.writer", "pkg"]]
