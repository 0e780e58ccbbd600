"""The documentation describes the software as it is: the CLI pages (docs/cli*.md) list exactly the commands and
options the command line has, every relative link (and #anchor) resolves, every docs/results file a page names
exists and docs/results/README.md is what `leaplm bench report` renders, a page stays a short reference, and the
prose carries no work history (session numbers, issue numbers, commit ids, "fixed after this table"): what changed
for users goes in CHANGELOG.md by date, and the rest is in git."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[2]
# Rendered by `leaplm bench report` from the result files, which record the code they ran (commit ids): the link
# checks read it, the prose checks do not.
RESULTS_MD = ROOT / "docs" / "results" / "README.md"
PROSE = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")),
         *sorted((ROOT / "deploy").rglob("*.md"))]
WRITTEN = [p for p in PROSE if p != RESULTS_MD]

# Work-history patterns, case-insensitive. A commit id is a 7-40 character hex word with a letter and a digit.
HISTORY = [
    (r"\bsessions?\s*#?\d+", "a work session's number"),
    (r"\b(this|that|previous|next|last|earlier|later) session\b", "a work session"),
    (r"\bissues?\s*#?\d+", "an issue number"),
    (r"\b(PR|pull request)\s*#?\d+", "a pull request number"),
    (r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", "a commit id"),
    (r"\b(fixed|changed) after (this|the) table\b", "a fix narrated after a figure"),
    (r"\bnot fixed yet\b", "a fix narrated as pending"),
    (r"\bwork periods?\b", "a work period"),
]

# What code, tests and reference docs narrate when they describe a change instead of the software (CHANGELOG.md
# may: it lists changes by date). A targeted list, not a ban on ordinary words.
CHANGE_HISTORY = [
    (r"\brefactor(ed|ing|s)?\b", "a refactor"),
    (r"\bthe issue'?s (goal|aim|ask)\b", "an issue's goal"),
    (r"\b(its|their|the) (old|former|previous) (home|name|location|module|place)\b", "a former home"),
    (r"\bused to (be|live|return|call|take|raise|run)\b", "what the code used to do"),
    (r"\b(previously|formerly)\b", "what the code did before"),
    (r"\bbackwards? compat(ibility|ible)?\b", "a compatibility shim"),
    (r"\b(fit|for|during|in|within) the session\b|\bthe session'?s deadline\b", "a work session"),
    (r"\b(is|are) now (not )?(made|done|computed|handled|checked|refused|priced|kept|taken|used|called|raised)\b",
     "a change narrated as 'now'"),
    (r"\(was [^)]*\)", "an earlier value in parentheses"),
    (r"\b(before|after|since|until) (this|the) (change|fix|refactor|rewrite)\b", "a change narrated"),
    (r"\bthe lead\b(?! time)|\bthe brief\b", "the team's work"),
]
COMMIT_ID = HISTORY[4]
# Code and tests, and the shipped models' cards; this file is left out (its negative controls are history on purpose).
CODE = [p for p in [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
                    *sorted((ROOT / "src").rglob("*.md"))] if p != Path(__file__).resolve()]


def history_findings(text: str, patterns=HISTORY) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, what in patterns:
            m = re.search(pattern, line, flags=re.I)
            if m:
                found.append(f"{n}: {what}: {m.group(0)!r}")
    return found


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_history_in_the_prose(path):
    found = history_findings(path.read_text())
    assert not found, f"{path.relative_to(ROOT)} narrates the work, not the software:\n" + "\n".join(found)


@pytest.mark.parametrize("path", [p for p in WRITTEN if p.name != "CHANGELOG.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_change_history_in_the_docs(path):
    found = history_findings(path.read_text(), CHANGE_HISTORY)
    assert not found, f"{path.relative_to(ROOT)} narrates a change, not the software:\n" + "\n".join(found)


def test_no_work_history_in_code_tests_or_model_cards():
    """Comments, docstrings, test names and the shipped cards describe the software. Hex digests (weights'
    sha256) look like commit ids, so that one pattern is left to the prose check."""
    patterns = [h for h in HISTORY if h is not COMMIT_ID] + CHANGE_HISTORY
    found = [f"{p.relative_to(ROOT)}:{f}" for p in CODE for f in history_findings(p.read_text(), patterns)]
    assert not found, "code, tests or model cards narrate the work, not the software:\n" + "\n".join(found)


def test_change_history_check_catches_narration_and_passes_reference_text():
    """Negative control for CHANGE_HISTORY: each pattern fires on the sentence it is for, not on reference code."""
    for bad in ("re-exported: its home before the refactor", "The issue's goal on simulated machines",
                "it used to return a tuple", "previously the step did this", "kept for backward compatibility",
                "stopped at its checkpoint to fit the session", "A probe is now made only while it pays",
                "acceptance 0.261 (was 0.231)", "slower before the fix", "as the lead asked"):
        assert history_findings(bad, CHANGE_HISTORY), bad
    for good in ('@pytest.fixture(scope="session")', "now = time.perf_counter()", "429 for one that cannot fit now",
                 "its proposals are now accepted whole", "a cache that was cropped", "the lead time of a request",
                 "the old one until they finish", "what was in flight does not count"):
        assert not history_findings(good, CHANGE_HISTORY), good


def test_history_check_catches_history_and_passes_reference_text():
    """Negative control: each pattern fires on the kind of sentence it is for, and not on reference prose."""
    for bad in ("Measured in session 19 on the VM", "re-measured this session", "the goal of issue 15",
                "until commit 33642fb the bench", "both were fixed after this table", "better, but not fixed yet",
                "numbered work periods", "see PR #12"):
        assert history_findings(bad), bad
    for good in ("a 4096-token vocabulary, 131072 positions", "decoded at 48.4 tokens/s on 2026-11-23",
                 "aiohttp.ClientSession and the HTTP session", "the issue is the draft's cost", "deadbeef",
                 "`d2t` [N] int64 offsets", "SHA-256 of the weights"):
        assert not history_findings(good), good


README_MAX_LINES = 300


def test_readme_is_a_short_reference():
    """The README is the reference in brief (one results table per model); tables and details live in docs/."""
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move details to docs/"


PAGE_MAX_LINES = 250
DOCS_PAGES = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p != RESULTS_MD]


@pytest.mark.parametrize("path", DOCS_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docs_page_is_a_short_reference(path):
    """A page says what a user needs now; measurement histories are result files (docs/results) and their
    generated tables, which the page links to."""
    n = len(path.read_text().splitlines())
    assert n <= PAGE_MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {PAGE_MAX_LINES}): link to " \
        "docs/results instead of retelling measurements, or split the page by topic"


def results_links(text: str) -> list[str]:
    """Every docs/results path a text names, as a link target or as a plain path (`docs/results/x.json`)."""
    text = re.sub(r"[a-z]+://\S+", "", text)
    found = re.findall(r"\]\(((?:\.\./)*(?:docs/)?results/[^)\s#]*)", text)
    found += re.findall(r"(?<![\w/.(-])((?:docs/)?results/[\w.*-]+\.(?:json|png|md))", text)
    return found


def test_results_links_are_found_in_text():
    """Negative control for the results-link check."""
    assert results_links("[x](results/a.json), `docs/results/b.png`, [y](../docs/results/README.md#c)") == [
        "results/a.json", "../docs/results/README.md", "docs/results/b.png"]
    assert not results_links("https://example.com/results/a.json and a results table")


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_named_exists(path):
    """A figure's source named in a page (a link or a `docs/results/...` path) is a file in docs/results; a
    name with `*` must match at least one file."""
    missing = []
    for name in results_links(path.read_text()):
        rel = name[name.index("results/"):]
        if "*" in rel:
            if not list((ROOT / "docs").glob(rel)):
                missing.append(name)
        elif not (ROOT / "docs" / rel).exists():
            missing.append(name)
    assert not missing, f"{path.relative_to(ROOT)} names result files that are not in docs/results: {missing}"


def test_results_tables_are_current():
    """docs/results/README.md is what `leaplm bench report` renders from docs/results/*.json."""
    from leaplm.bench.report import results_markdown

    assert RESULTS_MD.read_text() == results_markdown(ROOT / "docs" / "results"), \
        "docs/results/README.md is out of date: run `leaplm bench report`"


MD_NAME = re.compile(r"(?<![\w./-])([\w./-]*[A-Za-z0-9_-]\.md)\b")


def md_names(text: str) -> set[str]:
    """Markdown file names a text mentions (`docs/cli.md`, `adaptive-k.md`), URLs left out."""
    text = re.sub(r"[a-z]+://\S+", "", text)
    return {m.group(1).lstrip("./") for m in MD_NAME.finditer(text)}


def test_md_names_are_found_in_text():
    """Negative control for the dead-reference check: the pattern finds the names it is for."""
    assert md_names("see NOTES.md rule 9 and [x](docs/cli.md#a), ../deploy/triton/README.md") == {
        "NOTES.md", "docs/cli.md", "deploy/triton/README.md"}
    assert not md_names("https://example.com/guide.md and a .md suffix")


def test_every_markdown_file_named_is_in_the_repository():
    """A document the prose, the code or the tests cite is one a reader of the repository can open."""
    names = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    sources = PROSE + sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    sources.remove(Path(__file__).resolve())   # its negative control names a document on purpose
    dead = []
    for path in sources:
        for name in md_names(path.read_text()):
            if Path(name).name not in names:
                dead.append(f"{path.relative_to(ROOT)}: {name}")
    assert not dead, "documents cited but not in the repository:\n" + "\n".join(dead)


# --- docs/cli.md against the command line ------------------------------------------------------------------------
def cli_tree() -> dict[str, set[str]]:
    """'leaplm bench serve' -> its option spellings (without --help), for every command and group."""
    from leaplm.cli import app

    out: dict[str, set[str]] = {}

    def walk(cmd, path):
        opts = set()
        for p in cmd.params:
            if type(p).__name__.endswith("Option") and p.name != "help":
                opts.update(p.opts + p.secondary_opts)
        out[" ".join(path)] = opts
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk(sub, path + [name])

    walk(typer.main.get_command(app), ["leaplm"])
    return out


# The reference is split by topic: each page holds the commands its prefixes select (the longest match wins).
CLI_PAGES = {"cli.md": ("leaplm",), "cli-bench.md": ("leaplm bench",), "cli-train.md": ("leaplm train",),
             "cli-heads.md": ("leaplm train eagle", "leaplm train medusa", "leaplm train export-head",
                              "leaplm train ship-head")}


def cli_page(command: str) -> str:
    """The docs page that documents a command ('leaplm bench serve' -> 'cli-bench.md')."""
    fits = [(len(prefix), page) for page, prefixes in CLI_PAGES.items() for prefix in prefixes
            if command == prefix or command.startswith(prefix + " ")]
    return max(fits)[1]


def cli_md_sections() -> dict[str, set[str]]:
    """'### `leaplm X`' sections of the CLI pages -> the options named in the first column of their tables."""
    sections: dict[str, set[str]] = {}
    for page in CLI_PAGES:
        current = None
        for line in (ROOT / "docs" / page).read_text().splitlines():
            m = re.match(r"^### `(leaplm[^`]*)`\s*$", line)
            if m:
                current = m.group(1)
                assert cli_page(current) == page, f"{current} is documented in {page}, not {cli_page(current)}"
                sections[current] = set()
            elif current and line.startswith("| `-"):
                first = line.split(" | ")[0]
                sections[current].update(re.findall(r"`(-[^`]+)`", first))
    return sections


def test_cli_md_lists_every_command_and_option():
    real, documented = cli_tree(), cli_md_sections()
    assert sorted(documented) == sorted(real), (
        f"commands missing from docs/cli.md: {sorted(set(real) - set(documented))}; "
        f"documented but not in the CLI: {sorted(set(documented) - set(real))}")
    problems = []
    for command, opts in real.items():
        if opts - documented[command]:
            problems.append(f"{command}: undocumented {sorted(opts - documented[command])}")
        if documented[command] - opts:
            problems.append(f"{command}: documented but not an option {sorted(documented[command] - opts)}")
    assert not problems, "the docs/cli*.md pages are out of date (`python tests/docs/test_docs.py --write-cli-md` regenerates " \
        "their reference sections from the command line):\n" + "\n".join(problems)


CLI_MD_MARKER = "## Every command and option"


def render_cli_reference(page: str = "cli.md") -> str:
    """A CLI page's reference section: one '### `leaplm ...`' heading per command the page holds, its help's first
    paragraph, its arguments and a table of its options (spellings, default, help), as `--help` prints them."""
    import os

    from leaplm.cli import app

    home = os.path.expanduser("~")
    out = []

    def walk(cmd, path):
        name = " ".join(path)
        if cli_page(name) == page:
            out.append(f"### `{name}`\n")
            first = (cmd.help or "").strip().split("\n\n")[0].replace("\n", " ")
            args = [p for p in cmd.params if type(p).__name__.endswith("Argument")]
            if args:
                first += (" " if first else "") + "Arguments: " + ", ".join(
                    f"`{a.metavar or a.name.upper()}`" for a in args) + "."
            if first:
                out.append(first + "\n")
            opts = [p for p in cmd.params if type(p).__name__.endswith("Option") and p.name != "help"]
            if opts:
                out.append("| option | default | meaning |\n|---|---|---|")
                for o in opts:
                    names = ", ".join(f"`{n}`" for n in o.opts + o.secondary_opts)
                    d = o.default
                    shown = "" if d is None or d == () or d is False or callable(d) else f"`{d}`".replace(home, "~")
                    meaning = (o.help or "").replace("\n", " ").replace("|", "\\|")
                    out.append(f"| {names} | {shown} | {meaning} |")
                out.append("")
        for sub_name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk(sub, path + [sub_name])

    walk(typer.main.get_command(app), ["leaplm"])
    return "\n".join(out)


def write_cli_md() -> None:
    """Rewrite each CLI page's reference section (what follows CLI_MD_MARKER's intro) from the command line."""
    for page in CLI_PAGES:
        path = ROOT / "docs" / page
        text = path.read_text()
        head = text[: text.index(CLI_MD_MARKER)]
        intro = text[text.index(CLI_MD_MARKER):].split("\n### ", 1)[0].rstrip("\n")
        path.write_text(head + intro + "\n\n" + render_cli_reference(page) + "\n")


# --- links -------------------------------------------------------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_slug_matches_githubs_rule():
    assert slug("Comparing with llama.cpp (`--baselines llamacpp`)") == "comparing-with-llamacpp---baselines-llamacpp"
    assert slug("Server: concurrency 1, 4, 16, 64") == "server-concurrency-1-4-16-64"
    assert slug("6. Clients and the latency table") == "6-clients-and-the-latency-table"


@pytest.mark.parametrize("path", PROSE, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write-cli-md"]:
        sys.exit("usage: python tests/docs/test_docs.py --write-cli-md")
    write_cli_md()
