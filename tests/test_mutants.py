"""The mutation audits' generator and runner (tests/mutants.py): what a round's ids and draws mean must not drift,
and a mutant the tests cannot see must be reported as surviving."""

from __future__ import annotations

import ast
import textwrap

from tests import mutants

SOURCE = textwrap.dedent('''\
    """A module docstring stays."""
    LIMIT = 10  # module level: never dropped


    def clamp(value: int = 3) -> int | None:
        """Clamp below LIMIT."""
        if value < LIMIT and not value == -1:
            return value  # é: columns count bytes
        return LIMIT


    def total(items):
        acc = 0.0
        for item in items[1:]:
            acc += item * 2
        return acc
''')


def _described(source):
    return [(mutant.line, mutant.description) for mutant in mutants.generate(source)]


def test_each_operator_gives_its_mutants_in_source_order():
    found = _described(SOURCE)
    assert found == sorted(found, key=lambda row: row[0])
    for expected in [(7, "Lt -> LtE"), (7, "Lt -> Gt"), (7, "And -> Or"), (7, "drop `not`"), (7, "Eq -> NotEq"),
                     (7, "negate `if` condition"), (7, "1 -> 2"), (7, "1 -> 0"), (8, "return None"),
                     (13, "0.0 -> 1.0"), (14, "slice lower bound dropped"), (15, "augmented Add -> Sub"),
                     (15, "Mult -> Div"), (15, "drop statement `AugAssign`"), (16, "drop statement `Return`")]:
        assert expected in found


def test_docstrings_annotations_and_module_statements_are_left_alone():
    found = _described(SOURCE)
    assert not [row for row in found if row[0] in (1, 6)]  # the docstrings
    assert (5, "BitOr -> BitAnd") not in found and (5, "3 -> 4") in found  # the annotation, not the default
    assert (2, "drop statement `Assign`") not in found and (2, "10 -> 11") in found


def test_a_mutant_changes_only_its_node_and_keeps_comments():
    for mutant in mutants.generate(SOURCE):
        mutated = mutants.apply(SOURCE, mutant)
        assert mutated != SOURCE
        ast.parse(mutated)
        assert "# é: columns count bytes" in mutated
        assert "# module level: never dropped" in mutated
    (lt_to_lte,) = [mutant for mutant in mutants.generate(SOURCE) if mutant.description == "Lt -> LtE"]
    assert "if value <= LIMIT and not value == -1:" in mutants.apply(SOURCE, lt_to_lte)
    (dropped_return,) = [mutant for mutant in mutants.generate(SOURCE) if mutant.line == 8
                         and mutant.description == "drop statement `Return`"]
    assert "        pass  # é: columns count bytes" in mutants.apply(SOURCE, dropped_return)


def test_ids_and_draws_are_stable():
    generated = mutants.generate(SOURCE)
    assert _described(SOURCE) == _described(SOURCE)
    drawn = mutants.select(generated, seed=280, count=5)
    assert drawn == mutants.select(mutants.generate(SOURCE), seed=280, count=5) == sorted(drawn)
    assert len(set(drawn)) == 5 and set(drawn) <= set(range(1, len(generated) + 1))
    assert mutants.select(generated, seed=None, count=None) == list(range(1, len(generated) + 1))
    assert mutants.parse_ids("1,4-6, 9") == [1, 4, 5, 6, 9]


def test_run_reports_a_mutant_the_tests_miss_as_surviving(tmp_path, capsys):
    """End to end in a stand-in worktree: the package is imported from it through the shim, not the install."""
    worktree = tmp_path / "wt"
    for package in ("models", "service"):
        (worktree / package).mkdir(parents=True)
        (worktree / package / "__init__.py").write_text("")
    (worktree / "models" / "clamping.py").write_text(textwrap.dedent('''\
        def clamp(value):
            return value if value < 10 else 10
    '''))
    (worktree / "test_clamping.py").write_text(textwrap.dedent('''\
        from captioner.models.clamping import clamp


        def test_clamp(tmp_path):
            (tmp_path / "ran").write_text("")
            assert clamp(3) == 3 and clamp(20) == 10
    '''))
    generated = mutants.generate((worktree / "models" / "clamping.py").read_text())
    ids = {mutant.description: index for index, mutant in enumerate(generated, 1)}
    chosen = [ids["Lt -> LtE"], ids["Lt -> Gt"]]
    mutants.main(["run", "--worktree", str(worktree), "--file", "models/clamping.py", "--tests", "test_clamping.py",
                  "--ids", ",".join(map(str, chosen)), "--baseline", "--timeout", "120"])
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert rows[0][:2] == ["baseline", "survived"]
    assert [(row[0], row[3]) for row in rows[1:]] == [(str(chosen[0]), "survived"), (str(chosen[1]), "killed")]
    assert (worktree / "models" / "clamping.py").read_text().count("value < 10") == 1  # put back
    # the runs' temporary folders are the worktree's own, beside it, not pytest's shared ones other audits clear
    assert list((tmp_path / "pytest-tmp").glob("*/ran"))
