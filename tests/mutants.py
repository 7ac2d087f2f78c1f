"""The mutation audits' mutants (docs/mutation_audits.md): generated from a file's syntax tree, and run one by one
against the test modules that exercise the file, in a git worktree so the checkout stays clean.

    python -m tests.mutants list FILE [--seed S --count N]     every mutant (or N drawn with seed S): id, line, change
    python -m tests.mutants show FILE ID                       one mutant as a diff
    python -m tests.mutants apply FILE ID                      rewrite FILE as that mutant (``git checkout`` it back)
    python -m tests.mutants run --worktree WT --file FILE --tests TESTS... (--ids 1,4-9 | --seed S --count N | --all)

Ids number the mutants in source order, so they are stable for one text of a file (``list`` and ``show`` read the
file as it is now: not while ``run`` has a mutant written into it); a draw (``--seed``, ``--count``)
is stable too, which is what lets a round's "not run" list be taken up by a later one. The operators: comparisons
flipped or moved across their boundary (``<`` against ``<=`` and ``>``), arithmetic swapped, integer constants moved
by one, floats doubled, booleans swapped, short strings changed, ``not``/unary minus dropped, ``and``/``or`` swapped,
slice bounds dropped, ``return x`` as ``return None``, ``break``/``continue`` swapped, ``if``/``while`` conditions
negated and statements inside functions or classes replaced by ``pass``. Docstrings and annotations are left alone.

``run`` imports the package from the worktree through a shim on ``PYTHONPATH`` (``captioner/models`` and
``captioner/service`` linked to the worktree's folders) rather than from the editable install, runs ``pytest -x -n 0``
(its temporary folders in ``pytest-tmp`` beside the worktree, so audits side by side never clear each other's) for
each mutant, puts the file back after each and prints one row per mutant: killed, survived, timeout (judge
whether a user could hit it) or invalid.
"""

from __future__ import annotations

import argparse
import ast
import copy
import difflib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

COMPARISONS = {
    ast.Lt: [ast.LtE, ast.Gt], ast.LtE: [ast.Lt, ast.GtE], ast.Gt: [ast.GtE, ast.Lt], ast.GtE: [ast.Gt, ast.LtE],
    ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq], ast.In: [ast.NotIn], ast.NotIn: [ast.In],
    ast.Is: [ast.IsNot], ast.IsNot: [ast.Is],
}
ARITHMETIC = {
    ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult, ast.FloorDiv],
    ast.FloorDiv: [ast.Div], ast.Mod: [ast.Mult], ast.Pow: [ast.Mult], ast.BitAnd: [ast.BitOr],
    ast.BitOr: [ast.BitAnd], ast.LShift: [ast.RShift], ast.RShift: [ast.LShift],
}
#: a string constant is changed only where it is a value (an argument, a key, a comparison's side), not a docstring
STRING_PARENTS = (ast.Compare, ast.Call, ast.Return, ast.Assign, ast.keyword, ast.Dict, ast.Tuple, ast.List)
#: statements never dropped: definitions and imports (dropping them fails at import, which tells nothing)
KEPT_STATEMENTS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.Pass,
                   ast.Global, ast.Nonlocal)


@dataclass
class Mutant:
    node: ast.AST  # the node whose source is replaced
    line: int
    description: str
    replacement: str  # the source written in the node's place


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                found.add(id(first))
    return found


def _annotation_nodes(tree: ast.AST) -> set[int]:
    """Annotations are not run (``from __future__ import annotations``): mutating them tells nothing."""
    found = set()
    for node in ast.walk(tree):
        annotations = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            annotations.append(node.returns)
            annotations += [argument.annotation for argument in
                            arguments.posonlyargs + arguments.args + arguments.kwonlyargs
                            + [arguments.vararg, arguments.kwarg] if argument is not None]
        if isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for annotation in annotations:
            if annotation is not None:
                found.update(id(sub) for sub in ast.walk(annotation))
    return found


def generate(source: str) -> list[Mutant]:
    """Every mutant of ``source``, in source order (the order that numbers them)."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    annotations = _annotation_nodes(tree)
    parents = {id(child): parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    mutants: list[Mutant] = []

    def add(node: ast.AST, description: str, replacement: ast.AST | str) -> None:
        text = replacement if isinstance(replacement, str) else ast.unparse(replacement)
        mutants.append(Mutant(node, node.lineno, description, text))

    def changed(node: ast.AST, **fields) -> ast.AST:
        copied = copy.deepcopy(node)
        for name, value in fields.items():
            setattr(copied, name, value)
        return copied

    for node in ast.walk(tree):
        if id(node) in annotations or not hasattr(node, "lineno"):
            continue
        if isinstance(node, ast.Compare):
            for index, operator in enumerate(node.ops):
                for other in COMPARISONS.get(type(operator), []):
                    mutated = copy.deepcopy(node)
                    mutated.ops[index] = other()
                    add(node, f"{type(operator).__name__} -> {other.__name__}", mutated)
        elif isinstance(node, (ast.BinOp, ast.AugAssign)):
            kind = "augmented " if isinstance(node, ast.AugAssign) else ""
            for other in ARITHMETIC.get(type(node.op), []):
                add(node, f"{kind}{type(node.op).__name__} -> {other.__name__}", changed(node, op=other()))
        elif isinstance(node, ast.BoolOp):
            other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            add(node, f"{type(node.op).__name__} -> {type(other).__name__}", changed(node, op=other))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add(node, "drop `not`", node.operand)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            add(node, "drop unary minus", node.operand)
        elif isinstance(node, ast.Constant) and id(parents.get(id(node))) not in docstrings:
            value = node.value
            if isinstance(value, bool):
                add(node, f"{value} -> {not value}", ast.Constant(not value))
            elif isinstance(value, int):
                add(node, f"{value} -> {value + 1}", ast.Constant(value + 1))
                if value != 0:
                    add(node, f"{value} -> {value - 1}", ast.Constant(value - 1))
            elif isinstance(value, float):
                other = value * 2 if value else 1.0  # 0.0 doubled is no change
                add(node, f"{value} -> {other}", ast.Constant(other))
            elif (isinstance(value, str) and value and isinstance(parents.get(id(node)), STRING_PARENTS)
                  and len(value) <= 40 and "\n" not in value):
                add(node, f"string {value!r} -> {value + 'X'!r}", ast.Constant(value + "X"))
        elif isinstance(node, ast.Slice):
            if node.upper is not None:
                add(node, "slice upper bound dropped", changed(node, upper=None))
            if node.lower is not None:
                add(node, "slice lower bound dropped", changed(node, lower=None))
        elif isinstance(node, ast.Return) and node.value is not None:
            if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                add(node, "return None", "return None")
        elif isinstance(node, ast.Break):
            add(node, "break -> continue", "continue")
        elif isinstance(node, ast.Continue):
            add(node, "continue -> break", "break")
        if isinstance(node, (ast.If, ast.While)) and not isinstance(node.test, ast.Constant):
            negated = ast.UnaryOp(op=ast.Not(), operand=copy.deepcopy(node.test))
            add(node.test, f"negate `{type(node).__name__.lower()}` condition", f"({ast.unparse(negated)})")
        if (isinstance(node, ast.stmt) and id(node) not in docstrings and not isinstance(node, KEPT_STATEMENTS)
                and not isinstance(parents.get(id(node)), ast.Module)):
            # module-level statements are left: dropping one mostly fails at import
            add(node, f"drop statement `{type(node).__name__}`", "pass")
    mutants.sort(key=lambda mutant: (mutant.node.lineno, mutant.node.col_offset, mutant.description))
    return mutants


def apply(source: str, mutant: Mutant) -> str:
    """``source`` with the mutant's node replaced (the rest of the text, comments included, as it was)."""
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(lineno: int, byte_column: int) -> int:  # ast's columns count UTF-8 bytes
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:byte_column].decode(errors="ignore"))

    node = mutant.node
    start, end = offset(node.lineno, node.col_offset), offset(node.end_lineno, node.end_col_offset)
    text = "".join(lines)
    mutated = text[:start] + mutant.replacement + text[end:]
    ast.parse(mutated)
    return mutated


def select(mutants: list[Mutant], seed: int | None, count: int | None) -> list[int]:
    """The ids to run: all of them, or ``count`` drawn with ``seed`` (sorted)."""
    ids = list(range(1, len(mutants) + 1))
    if seed is None or count is None or count >= len(ids):
        return ids
    return sorted(random.Random(seed).sample(ids, count))


def parse_ids(text: str) -> list[int]:
    """``"1,4-6"`` as ``[1, 4, 5, 6]``."""
    ids = []
    for part in filter(None, (part.strip() for part in text.split(","))):
        first, _, last = part.partition("-")
        ids.extend(range(int(first), int(last or first) + 1))
    return ids


def shim_for(worktree: Path) -> Path:
    """A folder that, on ``PYTHONPATH``, makes ``captioner.models``/``captioner.service`` the worktree's."""
    package = worktree.parent / "shim" / "captioner"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("models", "service"):
        link = package / name
        if not link.exists():
            link.symlink_to(worktree / name)
    return package.parent


def run_tests(worktree: Path, tests: list[str], timeout: float, env: dict[str, str]) -> tuple[str, float, str]:
    """(outcome, seconds, the first failing test) of one pytest run; a hung run's whole process group is killed."""
    started = time.monotonic()
    # a base folder of the worktree's own: under the shared /tmp/pytest-of-<user>, another helper's run removed the
    # folders of a run still going (pytest keeps only the last few), which failed its baseline for no mutant
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", "--no-header",
               "-W", "ignore", "--basetemp", str(worktree.parent / "pytest-tmp"), *tests]
    process = subprocess.Popen(command, cwd=worktree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return "timeout", time.monotonic() - started, ""
    seconds = time.monotonic() - started
    failed = next((line[:160] for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
    return ("survived" if process.returncode == 0 else "killed"), seconds, failed


def run(arguments: argparse.Namespace) -> None:
    worktree = arguments.worktree.resolve()
    env = dict(os.environ, PYTHONPATH=str(shim_for(worktree)), CI="true")
    target = worktree / arguments.file
    original = target.read_text(encoding="utf-8")
    mutants = generate(original)
    if arguments.ids:
        ids = parse_ids(arguments.ids)
    else:
        ids = select(mutants, None if arguments.all else arguments.seed, None if arguments.all else arguments.count)
    if arguments.baseline:
        outcome, seconds, failed = run_tests(worktree, arguments.tests, arguments.timeout * 3, env)
        print(f"baseline\t{outcome}\t{seconds:.1f}s\t{failed}", flush=True)
        if outcome != "survived":
            sys.exit("the tests fail (or hang) without any mutant: fix that first")
    log = open(arguments.out, "a", encoding="utf-8") if arguments.out else None
    try:
        for mutant_id in ids:
            mutant = mutants[mutant_id - 1]
            try:
                mutated = apply(original, mutant)
            except SyntaxError:
                outcome, seconds, failed = "invalid", 0.0, ""
            else:
                target.write_text(mutated, encoding="utf-8")
                try:
                    outcome, seconds, failed = run_tests(worktree, arguments.tests, arguments.timeout, env)
                finally:
                    target.write_text(original, encoding="utf-8")
            row = f"{mutant_id}\tline {mutant.line}\t{mutant.description}\t{outcome}\t{seconds:.1f}s\t{failed}"
            print(row, flush=True)
            if log:
                log.write(row + "\n")
                log.flush()
    finally:
        target.write_text(original, encoding="utf-8")
        if log:
            log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="list the mutants of a file")
    listing.add_argument("file", type=Path)
    listing.add_argument("--seed", type=int)
    listing.add_argument("--count", type=int)
    for name in ("show", "apply"):
        one = commands.add_parser(name, help=f"{name} one mutant")
        one.add_argument("file", type=Path)
        one.add_argument("id", type=int)
    running = commands.add_parser("run", help="run mutants against test modules in a git worktree")
    running.add_argument("--worktree", required=True, type=Path)
    running.add_argument("--file", required=True, help="the file, relative to the worktree")
    running.add_argument("--tests", nargs="+", required=True)
    chosen = running.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--ids", help="e.g. 1,4-9")
    chosen.add_argument("--all", action="store_true")
    chosen.add_argument("--seed", type=int)
    running.add_argument("--count", type=int)
    running.add_argument("--timeout", type=float, default=300, help="seconds one mutant's tests may take")
    running.add_argument("--out", type=Path, help="append the rows to this file too")
    running.add_argument("--baseline", action="store_true", help="first run the tests without a mutant")
    arguments = parser.parse_args(argv)
    if arguments.command == "run":
        if arguments.seed is not None and arguments.count is None:
            parser.error("--seed needs --count")
        run(arguments)
        return
    source = arguments.file.read_text(encoding="utf-8")
    mutants = generate(source)
    if arguments.command == "list":
        for mutant_id in select(mutants, arguments.seed, arguments.count):
            mutant = mutants[mutant_id - 1]
            print(f"{mutant_id}\tline {mutant.line}\t{mutant.description}")
        print(f"# {len(mutants)} mutants in all", file=sys.stderr)
        return
    if not 1 <= arguments.id <= len(mutants):
        parser.error(f"{arguments.file} has mutants 1 to {len(mutants)}")
    mutated = apply(source, mutants[arguments.id - 1])
    if arguments.command == "apply":
        arguments.file.write_text(mutated, encoding="utf-8")
    else:
        sys.stdout.writelines(difflib.unified_diff(source.splitlines(True), mutated.splitlines(True),
                                                   str(arguments.file), str(arguments.file), n=1))


if __name__ == "__main__":
    main()
