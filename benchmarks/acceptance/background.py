"""The whole benchmark in one background process, and a short status call that follows it.

    python -m benchmarks.acceptance.background start --work DIR [benchmark arguments]
    python -m benchmarks.acceptance.background status --work DIR [--wait-s S] [--collect DEST]
    python -m benchmarks.acceptance.background report --collected DEST [DEST ...] --work LOCAL_DIR

``start`` checks the arguments as the benchmark does (a refusal exits 2 here), then starts
``python -m benchmarks.acceptance`` with them in a session of its own (setsid: it outlives the call that
started it, and that call's terminal) and returns. Every stage runs in that one process, in order; its
output goes to DIR/background/log.txt, its exit code to DIR/background/exit.json when it ends.

``status`` prints what runs (stage, step, since when), the steps done with their wall times and the log's last
lines; ``--wait-s`` first waits up to that long for the run to end (a machine that is released when idle
between calls stays held while a status call waits). ``--collect DEST`` copies into DEST on every call the step
records so far (one file, steps.json), each finished engine's per-prompt results with the run's arguments
(served.json), the progress record and the log's tail (a machine taken back mid-run then still leaves what it
finished with whoever called), and the results (JSON and tables) once the run has ended. Exit code: the run's
own once it has ended (0 done, 1 a step failed, 2 bad input, 75 deadline), 3 while it runs, 4 when there is no
run or it died without an exit record (killed).

``report`` builds the results from a DEST that a status call filled, on any machine (CPU): the step records and
served results go into LOCAL_DIR (a new directory), and the benchmark's report stage runs there with the run's
own arguments: the tables of a run whose machine went before its report stage, over the engines it finished.
Several DESTs, from runs with the same arguments but their training seeds (one seed per machine's half hour),
make one report: every seed per arm, pooled over all of them, every difference paired on the same held-out
prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

RUNNING, LOST = 3, 4
SERVED_FILE = "served.json"
LOG_TAIL_LINES = 400
"""Lines of the log that --collect keeps (the whole log can run to megabytes of SGLang output)."""


def directory(work: Path) -> Path:
    return work / "background"


def _read(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else None


def _write(value: dict[str, Any], path: Path) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(temp, path)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: an ended process that nobody reaped yet (a zombie) still answers signal 0."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def start(argv: Sequence[str]) -> int:
    from benchmarks.acceptance.cli import parse_args

    args = parse_args(argv)  # a refusal exits 2 before anything starts
    work = Path(args.work).expanduser().absolute()
    here = directory(work)
    here.mkdir(parents=True, exist_ok=True)
    started = _read(here / "started.json")
    if started and not (here / "exit.json").is_file() and _alive(started["pid"]):
        print(f"error: a background run is already running in {work} (pid {started['pid']}): follow it with "
              f"`python -m benchmarks.acceptance.background status --work {work}`", file=sys.stderr)
        return 2
    (here / "exit.json").unlink(missing_ok=True)
    command = [sys.executable, "-m", "benchmarks.acceptance.background", "run", *argv]
    with open(here / "log.txt", "a") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, close_fds=True)
    out = Path(args.out).absolute() if args.out else work / "results.json"
    _write({"pid": process.pid, "started": time.time(), "argv": list(argv), "out": str(out)}, here / "started.json")
    print(f"started the benchmark in the background (pid {process.pid}, its own session); log {here / 'log.txt'}; "
          f"follow it with `python -m benchmarks.acceptance.background status --work {work} --wait-s 560`")
    return 0


def run(argv: Sequence[str]) -> int:
    """The background process itself: the benchmark, then its exit code on disk."""
    from benchmarks.acceptance.cli import main, parse_args

    here = directory(Path(parse_args(argv).work).expanduser().absolute())
    code = 1
    try:
        code = main(argv)
    finally:
        _write({"code": code, "ended": time.time()}, here / "exit.json")
    return code


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def _steps(work: Path) -> list[str]:
    paths = sorted((work / "steps").glob("*.json"), key=lambda path: path.stat().st_mtime)
    return [f"{path.stem} {json.loads(path.read_text()).get('seconds', 0):.0f} s" for path in paths]


def _tail(path: Path, lines: int) -> list[str]:
    if not path.is_file():
        return []
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - 400 * max(lines, 1)))  # the end only: the log can be large
        return handle.read().decode(errors="replace").splitlines()[-lines:]


def state(work: Path) -> tuple[int, str]:
    """(exit code as ``status`` returns it, a line saying where the run stands)."""
    here = directory(work)
    started, ended = _read(here / "started.json"), _read(here / "exit.json")
    if started is None:
        return LOST, f"no background run in {work} (start one with `python -m benchmarks.acceptance.background start`)"
    if ended is not None:
        return ended["code"], (f"finished with exit code {ended['code']} after "
                               f"{_minutes(ended['ended'] - started['started'])}")
    if _alive(started["pid"]):
        return RUNNING, f"running (pid {started['pid']}) for {_minutes(time.time() - started['started'])}"
    return LOST, (f"not running (pid {started['pid']} is gone) and no exit code recorded: it was killed "
                  f"{_minutes(time.time() - started['started'])} after it started. Start it again: the steps "
                  "recorded are kept")


def collect(work: Path, dest: Path, ended: bool) -> list[str]:
    """The step records (one file: ``steps.json``, step name to record), the finished engines' results with the
    run's arguments (``served.json``), the progress record, the log's tail and, once the run has ended, its
    results, copied into ``dest``; returns what was copied. At most seven files: a device call brings back eight.
    (A running run's results file, if any, is an earlier run's.)"""
    here = directory(work)
    started = _read(here / "started.json") or {}
    out = Path(started.get("out", work / "results.json"))
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in ((out, out.with_suffix(".md"), here / "exit.json") if ended else ()) + (work / "progress.json",):
        if path.is_file():
            shutil.copy(path, dest / path.name)
            copied.append(path.name)
    steps = {path.stem: _read(path) for path in sorted((work / "steps").glob("*.json"))}
    if steps:
        _write(steps, dest / "steps.json")
        copied.append("steps.json")
    engines = {path.stem: _read(path) for path in sorted((work / "serve").glob("*.json"))}
    if engines:
        _write({"argv": started.get("argv", []), "engines": engines}, dest / SERVED_FILE)
        copied.append(SERVED_FILE)
    (dest / "log-tail.txt").write_text("\n".join(_tail(here / "log.txt", LOG_TAIL_LINES)) + "\n")
    return copied + ["log-tail.txt"]


def status(work: Path, wait_s: float, dest: Optional[Path], lines: int) -> int:
    deadline = time.monotonic() + wait_s
    code, said = state(work)
    while code == RUNNING and time.monotonic() < deadline:
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
        code, said = state(work)
    print(f"acceptance benchmark in {work}: {said}")
    progress = _read(work / "progress.json")
    if progress:
        print(f"stage {progress.get('stage') or '-'}, step {progress.get('step') or '-'} "
              f"(since {_minutes(time.time() - progress['since'])} ago)")
    done = _steps(work)
    if done:
        print(f"steps done ({len(done)}): " + ", ".join(done))
    tail = _tail(directory(work) / "log.txt", lines)
    if tail:
        print(f"--- last {len(tail)} lines of {directory(work) / 'log.txt'}")
        print("\n".join(tail))
    if dest is not None:  # a running or killed run's steps and log are worth keeping too
        print(f"--- collected into {dest}: {', '.join(collect(work, dest, ended=code != RUNNING))}")
        table = dest / Path((_read(directory(work) / "started.json") or {}).get("out", "results.json")).with_suffix(
            ".md").name
        if code != RUNNING and table.is_file():
            print(table.read_text())
    return code


REPLACED_OPTIONS = ("--work", "--device", "--stages", "--out")
"""The run's options that a report built elsewhere sets itself."""


SCHEDULING_OPTIONS = ("work", "out", "device", "stages", "seeds", "deadline_s", "train_parallel", "serve_parallel")
"""The parsed options that say how and where a run went, not what it measured: runs pooled into one report may
differ in them."""


def _recipe(args: argparse.Namespace) -> dict[str, Any]:
    """What a run's parsed arguments say it measured (any spelling, any order): all but how it was run."""
    return {key: value for key, value in vars(args).items() if key not in SCHEDULING_OPTIONS}


def merge_collected(folders: Sequence[Path]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The step records, the engines' results and the arguments of the runs whose status calls filled ``folders``:
    runs of one recipe (their arguments but ``SCHEDULING_OPTIONS``), none serving an engine another did. A step
    every run recorded (the prompts, the answers, the extractions) keeps the first folder's record; the held-out
    prompts must be the same in all (the differences pair arms prompt by prompt): their digest is compared where
    both runs recorded one. Raises ValueError naming what does not fit."""
    from benchmarks.acceptance.cli import parse_args

    steps: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    seeds: list[int] = []
    first_argv: list[str] = []
    first_recipe: dict[str, Any] = {}
    for folder in folders:
        run_steps, served = _read(folder / "steps.json"), _read(folder / SERVED_FILE)
        if run_steps is None or served is None:
            raise ValueError(f"{folder} lacks steps.json or {SERVED_FILE}: collect them with `status --collect` "
                             "while the run's machine is still held (no engine had finished when the last call "
                             "collected)")
        args = parse_args(served["argv"])
        recipe = _recipe(args)
        if not first_argv:
            first_argv, first_recipe = list(served["argv"]), recipe
        if recipe != first_recipe:
            differ = sorted(key for key in recipe.keys() | first_recipe.keys() if recipe.get(key) != first_recipe.get(key))
            raise ValueError(f"the run collected in {folder} differs from {folders[0]}'s in more than its seeds: "
                             + ", ".join(f"{key} {recipe.get(key)!r} against {first_recipe.get(key)!r}" for key in differ)
                             + "; one report pools runs of one recipe")
        if twice := sorted(set(engines) & set(served["engines"])):
            raise ValueError(f"{folder} holds engines an earlier folder holds too ({', '.join(twice)}): name each "
                             "seed's run once")
        engines.update(served["engines"])
        seeds += [seed for seed in args.seeds if seed not in seeds]
        for name, record in run_steps.items():
            if name not in steps:
                steps[name] = record
            elif name == "prompts":
                _check_same_prompts(folder, folders[0], record, steps[name])
            elif _less_time(record) != _less_time(steps[name]):
                print(f"note: step {name} recorded other values in {folder} than in {folders[0]} "
                      f"({json.dumps(_less_time(record))[:200]}); the report keeps {folders[0]}'s")
    return steps, engines, _with_option(first_argv, "--seeds", ",".join(map(str, seeds)))


def _check_same_prompts(folder: Path, first: Path, record: dict[str, Any], first_record: dict[str, Any]) -> None:
    """The held-out prompts of two runs are the same ones, by the digest each recorded (a run recorded before the
    digest was kept is taken on its arguments, which name the same prompts: said, not refused)."""
    digests = record.get("held_out_sha256"), first_record.get("held_out_sha256")
    if None in digests:
        print(f"note: {folder if digests[0] is None else first}'s run recorded no digest of its held-out prompts: "
              "they are taken to be the same as its arguments say")
    elif digests[0] != digests[1]:
        raise ValueError(f"{folder}'s run held out other prompts than {first}'s (digest {digests[0][:12]} against "
                         f"{digests[1][:12]}): its arms cannot be paired with theirs")


def _less_time(record: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in record.items() if key != "seconds"}


def report(collected: Sequence[Path], work: Path) -> int:
    """The report stage over what status calls collected into ``collected`` (one run, or one per training seed), in
    the new directory ``work``."""
    from benchmarks.acceptance.cli import main

    try:
        steps, engines, argv = merge_collected(collected)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if work.exists():
        print(f"error: {work} exists: name a new directory for the report (nothing in it is replaced)",
              file=sys.stderr)
        return 2
    for folder, records in (("steps", steps), ("serve", engines)):
        (work / folder).mkdir(parents=True)
        for name, record in records.items():
            _write(record, work / folder / f"{name}.json")
    argv = [*_without(argv, REPLACED_OPTIONS), "--work", str(work), "--device", "cpu", "--stages", "report"]
    runs = f" from {len(collected)} runs" if len(collected) > 1 else ""
    print(f"the report over {len(engines)} engines' results{runs}, as `python -m benchmarks.acceptance "
          f"{' '.join(argv)}`")
    return main(argv)


def _without(argv: Sequence[str], options: Sequence[str]) -> list[str]:
    """``argv`` less each of ``options`` and its value (``--opt VALUE`` or ``--opt=VALUE``)."""
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in options:
            skip = True
        elif not word.startswith(tuple(f"{option}=" for option in options)):
            kept.append(word)
    return kept


def _with_option(argv: Sequence[str], option: str, value: str) -> list[str]:
    """``argv`` with ``option`` set to ``value``: in its place where ``argv`` names it, else at the end."""
    out, found, skip = [], False, False
    for word in argv:
        if skip:
            out.append(value)
            skip = False
        elif word == option:
            out.append(word)
            skip = found = True
        elif word.startswith(f"{option}="):
            out.append(f"{option}={value}")
            found = True
        else:
            out.append(word)
    return out if found else [*out, option, value]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["start"]:
        return start(argv[1:])
    if argv[:1] == ["run"]:
        return run(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.acceptance.background", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["start", "status", "report"])
    parser.add_argument("--work", required=True, help="the run's directory (report: a new one for the report)")
    parser.add_argument("--wait-s", type=float, default=0, help="wait up to this long for the run to end first")
    parser.add_argument("--collect", default="", help="copy the step records so far here (and the results once "
                        "the run has ended)")
    parser.add_argument("--lines", type=int, default=25, help="the log's last lines to print")
    parser.add_argument("--collected", nargs="+", default=[],
                        help="report: what status --collect brought back (one folder per run: runs of the same "
                             "arguments but their --seeds make one report)")
    args = parser.parse_args(argv)
    if args.command == "report":
        if not args.collected:
            parser.error("report needs --collected DEST [DEST ...] (folders status calls filled)")
        return report([Path(folder) for folder in args.collected], Path(args.work).expanduser().absolute())
    return status(Path(args.work).expanduser().absolute(), args.wait_s, Path(args.collect) if args.collect else None,
                  args.lines)


if __name__ == "__main__":
    sys.exit(main())
