"""The recipes are checked, not just written: every command in a `bash` block of the README or docs/ is one that
runs (a `leaplm` command parses with leaplm's own parser: the subcommand exists, every flag exists and every value
has its type; a `make` target exists; a file it names exists), the Dockerfile runs the README's commands with
leaplm's real flags, and the Kubernetes manifest validates against the Kubernetes schema (kubernetes-validate,
strict: a misspelt field fails) with probes on real routes and a grace period that covers the drain."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
MANIFEST = ROOT / "deploy" / "k8s" / "leaplm.yaml"


def check_serve_argv(argv: list[str]) -> dict[str, object]:
    """argv = ['leaplm', 'serve', ...]: `leaplm serve`'s own parser accepts it (every flag exists, every value has
    its type; it raises otherwise). Returns the parsed options by flag spelling."""
    from leaplm.cli import app

    assert argv[:2] == ["leaplm", "serve"], argv
    cmd = typer.main.get_command(app).commands["serve"]
    ctx = cmd.make_context("serve", list(argv[2:]))
    by_flag = {}
    for p in cmd.params:
        for o in p.opts:
            by_flag[o] = ctx.params[p.name]
    given = {a for a in argv[2:] if a.startswith("--")}
    return {f: v for f, v in by_flag.items() if f in given}


def makefile_targets() -> dict[str, list[str]]:
    targets = {}
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([a-z][\w-]*):(?!=)\s*(.*)$", line)
        if m:
            targets[m.group(1)] = m.group(2).split()
    return targets


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def bash_commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) for every command in the file's ```bash blocks: continuation lines joined, comments
    and blank lines dropped."""
    out = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        i += 1
        pending, start = "", 0
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            if not pending:
                start = i + 1
            pending += line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
            else:
                words = shlex.split(pending, comments=True)
                if words:
                    out.append((start, shlex.join(words)))
                pending = ""
            i += 1
        i += 1
    return out


def readme_commands() -> list[str]:
    return [c for _, c in bash_commands(ROOT / "README.md")]


def parse_leaplm(argv: list[str]):
    """argv = ['leaplm', ...]: walk the command groups to the subcommand and let its parser read the rest (it raises
    on an unknown command or flag, a missing value or a value of the wrong type; parameter callbacks, which check
    that named files exist, are not run). Returns the command's context."""
    from leaplm.cli import app

    assert argv[0] == "leaplm", argv
    cmd, args, path = typer.main.get_command(app), argv[1:], ["leaplm"]
    while hasattr(cmd, "commands") and args and args[0] in cmd.commands:
        path.append(args[0])
        cmd, args = cmd.commands[args[0]], args[1:]
    # Parameter callbacks check that files exist (a recipe names the files its earlier steps write): types only here.
    callbacks = [(p, p.callback) for p in cmd.params]
    try:
        for p, _ in callbacks:
            p.callback = None
        ctx = cmd.make_context(" ".join(path), list(args))
    finally:
        for p, callback in callbacks:
            p.callback = callback
    leftover = list(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])) + list(ctx.args)
    assert not leftover, f"{' '.join(path)}: no subcommand {leftover[0]!r}"
    return ctx


def _doc_commands() -> list[tuple[str, str]]:
    return [(f"{p.relative_to(ROOT)}:{n}", c) for p in DOCS for n, c in bash_commands(p)]


def _words(command: str) -> list[str]:
    """The command's words without leading VAR=value assignments."""
    words = shlex.split(command)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    return words


@pytest.mark.parametrize("where,command", [pytest.param(w, c, id=w) for w, c in _doc_commands()
                                           if _words(c)[:1] == ["leaplm"]])
def test_doc_leaplm_commands_parse(where, command):
    try:
        parse_leaplm(_words(command))
    except Exception as e:     # click's usage errors, or the assertion above
        message = getattr(e, "message", None) or str(e)
        missing = re.search(r"'([^']+)' does not exist", message)
        file, line = where.rsplit(":", 1)
        earlier = [c for n, c in bash_commands(ROOT / file) if n < int(line)]
        if missing and any(missing.group(1) in _words(c) for c in earlier):
            return              # a file an earlier step of the same recipe writes
        pytest.fail(f"{where}: `{command}` does not parse: {message}")


def test_doc_commands_name_real_make_targets_and_files():
    targets = makefile_targets()
    problems = []
    for where, command in _doc_commands():
        words = _words(command)
        if not words:
            continue
        if words[0] == "make":
            problems += [f"{where}: make {t}: no such target" for t in words[1:] if "=" not in t and t not in targets]
        named = [w for w in words[1:] if re.match(r"^(tests|examples|deploy|src)/", w)]
        if words[0] in ("python", "pytest", "kubectl", "docker", "leaplm") or words[:3] == ["python", "-m", "pytest"]:
            for w in named:
                rel = w.split("::")[0]
                if not (ROOT / rel).exists() and not rel.startswith("src/leaplm/embedded/") and "runs/" not in rel:
                    problems.append(f"{where}: {rel} does not exist")
    assert not problems, "\n".join(problems)


def test_doc_command_checks_catch_bad_commands():
    """Negative control: a misspelt flag, a wrong type, an unknown subcommand and a stray argument all fail."""
    parse_leaplm(["leaplm", "bench", "--methods", "none,draft", "--k", "4"])
    parse_leaplm(["leaplm", "models"])
    for bad in (["leaplm", "bench", "--method", "none"], ["leaplm", "generate", "--k", "four"],
                ["leaplm", "train", "no-such-recipe"], ["leaplm", "eval", "acceptance", "stray"]):
        with pytest.raises(Exception):
            parse_leaplm(bad)
    assert bash_commands_from("```bash\nleaplm bench \\\n  --k 4   # four\n```\n") == ["leaplm bench --k 4"]


def bash_commands_from(text: str) -> list[str]:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as f:
        f.write(text)
    try:
        return [c for _, c in bash_commands(Path(f.name))]
    finally:
        Path(f.name).unlink()


# --- Dockerfile --------------------------------------------------------------------------------------------------
def _dockerfile():
    from dockerfile_parse import DockerfileParser

    return DockerfileParser(path=str(DOCKERFILE))


def test_dockerfile_builds_with_the_readme_commands():
    df = _dockerfile()
    runs = [i["value"] for i in df.structure if i["instruction"] == "RUN"]
    make_calls = [shlex.split(part.strip()) for r in runs for part in r.split("&&") if part.strip().startswith("make")]
    targets = makefile_targets()
    readme = readme_commands()
    ran = [c[1] for c in make_calls]
    assert "demo" in ran, "the image build runs `make demo`, one of the README's two commands"
    for c in make_calls:
        target = c[1]
        assert target in targets, f"make {target}: no such Makefile target"
        assert f"make {target}" in readme or target in targets["demo"] + targets["test"], \
            f"make {target} is neither a README command nor what they build first"
        for var in c[2:]:
            name = var.split("=")[0]
            assert re.search(rf"^{name} \?=", (ROOT / "Makefile").read_text(), re.M), f"{name} is not a Makefile variable"
    # the build argument's default is the Makefile's torch
    default_torch = re.search(r"^TORCH_SPEC \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert df.args["TORCH_SPEC"] == default_torch
    assert "TORCH_INDEX" in df.args and "cpu" in df.args["TORCH_INDEX"]


def test_dockerfile_serves_with_real_flags_on_the_exposed_port_and_the_readme_names_its_commands():
    import json

    df = _dockerfile()
    cmd = json.loads(next(i["value"] for i in df.structure if i["instruction"] == "CMD"))
    flags = check_serve_argv(cmd)
    expose = next(i["value"] for i in df.structure if i["instruction"] == "EXPOSE")
    assert flags["--port"] == int(expose) and flags["--host"] == "0.0.0.0"
    header = DOCKERFILE.read_text()
    readme = readme_commands()
    for command in ("docker build -f deploy/Dockerfile -t leaplm .", "docker run --rm -p 8000:8000 leaplm"):
        assert command in header and command in readme, command
    assert (ROOT / ".dockerignore").read_text().splitlines()[0] == ".venv"


# --- Kubernetes --------------------------------------------------------------------------------------------------
def _manifest() -> list[dict]:
    import yaml

    return list(yaml.safe_load_all(MANIFEST.read_text()))


def test_manifest_validates_against_the_kubernetes_schema():
    import kubernetes_validate

    docs = _manifest()
    assert [d["kind"] for d in docs] == ["Deployment", "Service"]
    for d in docs:
        kubernetes_validate.validate(d, "1.37.0", strict=True)


def test_schema_validation_rejects_a_misspelt_probe():
    """Negative control: the validator is not a no-op."""
    import copy

    import kubernetes_validate

    bad = copy.deepcopy(_manifest()[0])
    c = bad["spec"]["template"]["spec"]["containers"][0]
    c["readinessProb"] = c.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37.0", strict=True)


def test_manifest_probes_routes_scrape_and_drain_fit_leaplm():
    from leaplm.config import ServerConfig

    dep, svc = _manifest()
    pod = dep["spec"]["template"]
    c = pod["spec"]["containers"][0]
    flags = check_serve_argv(c["args"])
    port = int(flags["--port"])
    assert c["ports"][0]["containerPort"] == port
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"      # 503 while loading and draining
    assert c["livenessProbe"]["httpGet"]["path"] == "/metrics"      # 200 while draining: not restarted mid-drain
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == port
    assert ann["prometheus.io/path"] == "/metrics"
    drain = float(flags.get("--drain-timeout", ServerConfig().drain_timeout_s))
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + drain + 5, f"grace {grace} s < preStop {pre_stop} s + drain {drain} s + 5 s margin"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert svc["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]


def test_probe_routes_behave_as_the_manifest_assumes():
    """/health is 503 while draining and /metrics stays 200, on the real app."""
    from fastapi.testclient import TestClient

    from leaplm.config import ServerConfig
    from leaplm.server.app import create_app

    app = create_app(ServerConfig(host="0.0.0.0"), load=lambda: (_ for _ in ()).throw(RuntimeError("no model needed")),
                     model_name="x")
    with TestClient(app) as client:
        app.state.leaplm.draining = True
        assert client.get("/health").status_code == 503
        assert client.get("/metrics").status_code == 200
