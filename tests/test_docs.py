"""Docs and docstrings resolve inside the repository.

* No citation of documents a reader of the repository does not have: the external implementation spec (by its
  section sign), its numbered decision register ("decision #…"), its paper keys (P1–P5)
  and its tags ([REC], [NS], [REF-CODE]).
  Papers are cited by name, arXiv id and equation; our own choices by a heading of docs/decisions.md.
* Every ``docs/decisions.md#anchor`` and ``docs/decisions.md, section '…'`` reference names an existing heading.
* Every relative link in README.md, docker/README.md and docs/ points at an existing file (and heading, when it has
  an anchor), and every repository path they name exists.
* The README names every problem type and metric the service has; docs/architecture.md places every module.
* Every ``make TARGET`` the docs give is a target of the Makefile (their ``captioner`` flags: tests/test_cli.py).
* Cross-references name the installed packages (``captioner.models.…``), not the folders.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from .conftest import script_module
from .serving_helpers import sent_problem_kinds

ROOT = Path(__file__).resolve().parent.parent
DECISIONS = ROOT / "docs" / "decisions.md"

# built from pieces so that this file does not match its own patterns
FORBIDDEN = {
    # a citation ("… §4.3", "…'s", "… decision", "… rec."), not a variable that happens to be named so
    "the external spec": re.compile(r"\b" + "SP" + r"EC\b\s*(?:§|'s\b|decision|rec\b)"),
    "a numbered decision": re.compile("deci" + r"sion #\d"),
    "a spec tag": re.compile(r"\[(?:" + "R" + "EC|" + "N" + "S|" + "REF-" + r"CODE)\]"),
    "a spec paper key": re.compile(r"\b" + "P" + r"[1-5]\b"),
}
ANCHOR_REFERENCE = re.compile(r"docs/decisions\.md#([\w-]+)")
SECTION_REFERENCE = re.compile(r"docs/decisions\.md, section ['‘\"]([^'’\"]+)['’\"]")
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def repository_files(*suffixes: str) -> list[Path]:
    """Tracked files plus untracked ones git does not ignore (new files count before they are committed)."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted({ROOT / name for name in listed if name.endswith(suffixes) and (ROOT / name).is_file()})


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def heading_list(markdown: Path) -> list[tuple[int, str, str]]:
    """(level, text, anchor) of each heading of a markdown file in order, outside code fences; repeated headings
    get GitHub's ``-1``, ``-2`` suffixes."""
    found: list[tuple[int, str, str]] = []
    counts: dict[str, int] = {}
    fenced = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            anchor = github_anchor(match.group(1))
            found.append((len(line) - len(line.lstrip("#")), match.group(1).strip(),
                          anchor if anchor not in counts else f"{anchor}-{counts[anchor]}"))
            counts[anchor] = counts.get(anchor, 0) + 1
    return found


def headings(markdown: Path) -> tuple[set[str], set[str]]:
    """(anchors, heading texts in lower case) of a markdown file (:func:`heading_list`)."""
    found = heading_list(markdown)
    return {anchor for _, _, anchor in found}, {text.lower() for _, text, _ in found}


def test_anchor_rule_matches_github():
    assert github_anchor("SCST samples and reward statistics") == "scst-samples-and-reward-statistics"
    assert github_anchor("X-LAN / X-Transformer") == "x-lan--x-transformer"
    assert github_anchor("The `grid_smooth` mode, σ") == "the-grid_smooth-mode-σ"


def test_the_decisions_contents_link_every_section_in_order():
    """docs/decisions.md is long: its contents list links each of its ``##`` sections, in their order, so that a
    section added or renamed without its line fails here rather than going missing from the list."""
    listed = re.findall(r"^- \[(.+)\]\(#([\w-]+)\)$", DECISIONS.read_text(encoding="utf-8"), flags=re.MULTILINE)
    sections = [(text, anchor) for level, text, anchor in heading_list(DECISIONS) if level == 2]
    assert listed == sections


def test_no_citations_that_do_not_resolve_inside_the_repository():
    found = []
    for path in repository_files(".py", ".md", ".toml", "Makefile"):
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()[:100]}")
    assert not found, "cite papers by name + arXiv id + equation, our choices by docs/decisions.md#heading:\n" + \
        "\n".join(found)


def test_dotted_references_use_the_installed_package_names():
    """``models`` and ``service`` install as ``captioner.models`` and ``captioner.service``: a cross-reference such
    as :class:`~captioner.models.protocol.Captioner` or `captioner.models.decoding.beam_search` in a docstring or a
    doc must use those names, or it points at nothing (or at a user's own ``models`` module)."""
    stale = re.compile(r"[`~](?:models|service)\.(?!py\b)[A-Za-z_]")
    found = []
    for path in repository_files(".py", ".md"):
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if stale.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "write captioner.models.… / captioner.service.…:\n" + "\n".join(found)


def test_decision_references_point_at_existing_headings():
    anchors, texts = headings(DECISIONS)
    broken, references = [], 0
    for path in repository_files(".py", ".md"):
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for anchor in ANCHOR_REFERENCE.findall(text):
            references += 1
            if anchor not in anchors:
                broken.append(f"{path.relative_to(ROOT)}: docs/decisions.md#{anchor}")
        for section in SECTION_REFERENCE.findall(text):
            references += 1
            if section.strip().lower() not in texts:
                broken.append(f"{path.relative_to(ROOT)}: docs/decisions.md, section '{section}'")
    assert references > 0, "the code cites no decision at all: the reference patterns no longer match anything"
    assert not broken, "references to missing headings of docs/decisions.md:\n" + "\n".join(broken)


def test_relative_markdown_links_resolve():
    documents = [ROOT / "README.md", ROOT / "docker" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for document in documents:
        text = re.sub(r"```.*?```", "", document.read_text(encoding="utf-8"), flags=re.S)
        for target in MARKDOWN_LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("/"):
                continue  # URLs (http:, mailto:) and paths served by the app, not files of the repository
            path_part, _, anchor = target.partition("#")
            linked = (document.parent / path_part).resolve() if path_part else document
            if not linked.exists():
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in headings(linked)[0]:
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _paragraph(markdown: str, start: str) -> str:
    """The paragraph of ``markdown`` that begins with ``start`` (up to the next blank line)."""
    begin = markdown.index(start)
    end = markdown.find("\n\n", begin)
    return markdown[begin:end if end >= 0 else len(markdown)]


def test_readme_lists_every_problem_type():
    """The README's list of error answers names every problem type the service can send (the table of
    service/errors.py, the handlers' own kinds, the API-key refusal) and what Starlette's 404/405 become."""
    kinds = sent_problem_kinds()
    listed = _paragraph((ROOT / "README.md").read_text(encoding="utf-8"), "Errors are RFC 9457 problem documents")
    missing = sorted(kind for kind in kinds if f"`{kind}`" not in listed)
    assert not missing, f"README.md's 'Errors are RFC 9457 …' paragraph does not name: {missing}"


def test_readme_lists_every_metric():
    names = set(re.findall(r'"(captioner_[a-z_]+)"', (ROOT / "service" / "metrics.py").read_text(encoding="utf-8")))
    assert len(names) > 5, "the pattern no longer matches service/metrics.py"
    row = next(line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("| `GET /metrics`"))
    missing = sorted(name for name in names if f"`{name}" not in row)
    assert not missing, f"README.md's GET /metrics row does not name: {missing}"


def test_architecture_places_every_module():
    """docs/architecture.md names every module of models/ and service/: by path, or by file name beside its
    folder, or a whole folder (``models/interop/``); a model file is covered by ``models/<name>.py``."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for package in ("models", "service"):
        for module in sorted((ROOT / package).rglob("*.py")):
            relative = module.relative_to(ROOT).as_posix()
            folder = module.parent.relative_to(ROOT).as_posix() + "/"
            nested = module.parent.name != package
            if module.name == "__init__.py" or relative in text:
                continue
            if nested and (re.search(re.escape(folder) + r"[`\s)|]", text) or (folder in text and module.name in text)):
                continue
            if not nested and "models/<name>.py" in text and "@register(" in module.read_text(encoding="utf-8"):
                continue
            missing.append(relative)
    assert not missing, f"docs/architecture.md does not say where these belong: {missing}"


def test_repository_paths_named_in_the_docs_exist():
    """A path of the repository written in README.md, docker/README.md or docs/*.md (decisions.md excepted: it
    records history) exists, so a renamed or removed file cannot stay documented. Placeholders (NAME, STAGE, <x>)
    and paths under weights/ (what the examples write) are not checked."""
    documents = [ROOT / "README.md", ROOT / "docker" / "README.md",
                 *sorted(p for p in (ROOT / "docs").glob("*.md") if p != DECISIONS)]
    path = re.compile(r"(?<![\w/.<-])((?:models|service|tests|benchmarks|docs|docker)/[\w./-]*[\w/])")
    broken = []
    for document in documents:
        for number, line in enumerate(document.read_text(encoding="utf-8").splitlines(), 1):
            for found in path.findall(line):
                found = found.rstrip("/.")
                if re.search(r"[A-Z]{3,}|<|_$", found):
                    continue
                if not (ROOT / found).exists() and not (document.parent / found).exists():
                    broken.append(f"{document.relative_to(ROOT)}:{number}: {found}")
    assert not broken, "\n".join(broken)


def user_documents() -> list[Path]:
    """What a user reads for commands: the READMEs, docs/ (decisions.md included: its commands reproduce its runs)
    and the model cards."""
    return [ROOT / "README.md", ROOT / "docker" / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "weights").rglob("*.md"))]


def test_make_targets_named_in_the_docs_exist():
    """``make NAME`` in the docs is a Makefile target, or matches one of its pattern rules (``train-%``); the docs'
    placeholders (``make train-NAME``) match the pattern."""
    rules = re.findall(r"^([\w.%-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    patterns = [re.compile(re.escape(rule).replace("%", ".+")) for rule in rules]
    unknown = {f"{document.relative_to(ROOT)}: make {target}"
               for document in user_documents()
               for target in re.findall(r"`make ([\w.-]*\w)", document.read_text(encoding="utf-8"))
               if not any(pattern.fullmatch(target) for pattern in patterns)}
    assert not unknown, "\n".join(sorted(unknown))


def test_every_dependency_reaches_a_gpu_machine_from_its_image_or_the_gpu_wheels():
    """benchmarks/gpu_session.sh serves on a machine that holds its own image and what `make gpu-wheels` downloads:
    a dependency of the service in neither stopped a lent GPU call at the app's first import."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    project_name = script_module(ROOT / "docker" / "requirements.py").project_name  # what the image build reads

    def names(requirements: list[str]) -> set[str]:
        return {project_name(requirement) for requirement in requirements}

    def variable(name: str) -> set[str]:
        value = re.search(rf"^{name} :=((?:.*\\\n)*.*)$", makefile, re.M)
        assert value, f"the Makefile has no {name}"
        return names(value.group(1).replace("\\\n", " ").split())

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    not_served = names(pyproject["tool"]["captioner"]["container"]["not-served"])
    missing = names(pyproject["project"]["dependencies"]) - variable("GPU_WHEELS") - variable("GPU_IMAGE_PROVIDES") \
        - not_served
    assert not missing, f"add {sorted(missing)} to the Makefile's GPU_WHEELS (or GPU_IMAGE_PROVIDES)"


@pytest.mark.parametrize("script", ["benchmarks/gpu_session.sh", "docker/build_and_check.sh"])
def test_the_python_that_shell_scripts_run_imports_names_that_exist(script):
    # gpu_session.sh imported a function renamed long before: its GPU session would have stopped at its first step
    text = (ROOT / script).read_text()
    imports = re.findall(r"from (captioner(?:\.\w+)+) import ([\w, ]+)", text)
    for module, names in imports:
        loaded = importlib.import_module(module)
        missing = [name.strip() for name in names.split(",") if not hasattr(loaded, name.strip())]
        assert not missing, f"{script}: {module} has no {missing}"
