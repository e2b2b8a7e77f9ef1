"""The user docs say what the repository holds and what its tools accept.

- README.md's fenced shell commands resolve: scripts exist and are executable, ``python -m`` targets exist,
  ``pip install`` extras are declared, ``m3-accuracy`` lines parse with its own parser, ``sglang.launch_server``
  lines (and what ``m3-accuracy`` passes after ``--``) parse with SGLang's server-argument parser with the plugin
  loaded, and their model folders exist (one without weights carries ``--load-format dummy``). The CPU launch line is
  the one ``tests/accuracy/test_chat_template.py`` serves.
- No doc names a repository path (script, module file, folder) that does not exist.
"""

import argparse
import glob
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The docs a user reads; lab/logs/ holds dated records whose commands ran at the commits they name.
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "configs" / "README.md",
        ROOT / "accuracy" / "README.md", ROOT / "lab" / "README.md"]
SHELLS = {"bash", "sh", "shell", "console"}
CI_TEST_COMMAND = "./scripts/setup.sh && .venv/bin/python -m pytest -q"
MAIN_JOB_COMMAND = "./scripts/setup.sh && ./scripts/main.sh"


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(info string, body)`` of every fenced code block of a markdown text."""
    return re.findall(r"^```([^\n`]*)\n(.*?)^```", text, flags=re.M | re.S)


def shell_commands(text: str) -> list[str]:
    """The commands of the shell blocks of ``text``: continuation lines joined, comments and blank lines dropped."""
    commands = []
    for info, body in fenced_blocks(text):
        if info.strip() not in SHELLS:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(" ".join(w if w == "&&" else shlex.quote(w) for w in words))
    return commands


def simple_commands(command: str) -> list[list[str]]:
    """``a && b`` as ``[argv(a), argv(b)]``."""
    out, cur = [], []
    for word in shlex.split(command):
        if word == "&&":
            out.append(cur)
            cur = []
        else:
            cur.append(word)
    return [*out, cur]


def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own server-argument parser, with the plugin's flags (``--index-k-format``)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def has_weights(model: Path) -> bool:
    return any(model.glob("*.safetensors")) or any(model.glob("*.bin"))


def check_launch_args(argv: list[str]) -> None:
    """``argv`` of ``python -m sglang.launch_server``: parsed by SGLang; a repository model folder exists, and one
    without weights is loaded with ``--load-format dummy``."""
    args = sglang_parser().parse_args(argv)
    model = ROOT / args.model_path
    if args.model_path.startswith(("configs/", "./configs/")):
        assert (model / "config.json").is_file(), f"--model-path {args.model_path}: no config.json there"
        if not has_weights(model):
            assert args.load_format == "dummy", f"{args.model_path} has no weights: the line needs --load-format dummy"


def check_m3_accuracy(argv: list[str]) -> None:
    """``m3-accuracy`` arguments: parsed by the runner's own parser; a repository model exists; the launch
    arguments after ``--`` parse as SGLang's, with the model the runner adds."""
    from accuracy.run import build_parser, parse_command_line

    parser = build_parser()
    parser.exit_on_error = False
    args, _, launch_args = parse_command_line(parser, argv)
    if args.model and args.model.startswith("configs/"):
        assert (ROOT / args.model / "config.json").is_file(), f"--model {args.model}: no config.json there"
    if launch_args:
        check_launch_args(["--model-path", args.model or "configs/msa-small", *launch_args])


def module_exists(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def check_python(argv: list[str]) -> None:
    """``python ...`` / ``.venv/bin/python ...``: a ``-m`` target that exists, or a script file of the repository."""
    if argv[1] == "-m":
        module, rest = argv[2], argv[3:]
        assert module_exists(module), f"python -m {module}: no such module"
        if module == "sglang.launch_server":
            check_launch_args(rest)
    else:
        assert (ROOT / argv[1]).is_file(), f"{argv[1]}: no such script"


def check_pip(argv: list[str]) -> None:
    assert argv[:2] == ["pip", "install"], argv
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in argv[2:]:
        path, _, extras = spec.partition("[")
        assert path == ".", f"pip install {spec}: README installs this repository only"
        for extra in filter(None, extras.rstrip("]").split(",")):
            assert extra in project["optional-dependencies"], f"pip install {spec}: no extra {extra!r}"


def check_command(argv: list[str]) -> None:
    """One simple command of README.md resolves as written (from the repository root, ``.venv`` entered)."""
    placeholders = [w for w in argv if "<" in w or ">" in w]
    assert not placeholders, f"{shlex.join(argv)}: {placeholders} is a placeholder, not something that runs as written"
    exe = argv[0]
    if exe in ("python", "python3", ".venv/bin/python"):
        check_python(argv)
    elif exe in ("m3-accuracy", ".venv/bin/m3-accuracy"):
        scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
        assert "m3-accuracy" in scripts
        check_m3_accuracy(argv[1:])
    elif exe == "pip":
        check_pip(argv)
    elif exe == "source":
        assert argv[1:] == [".venv/bin/activate"], argv
        assert 'VENV="${VENV:-.venv}"' in (ROOT / "scripts" / "setup.sh").read_text()  # setup.sh makes .venv
    elif exe.startswith(("./", "scripts/")):
        script = ROOT / exe
        assert script.is_file(), f"{exe}: no such script"
        assert script.stat().st_mode & 0o111, f"{exe}: not executable"
    else:
        raise AssertionError(f"README command {shlex.join(argv)!r}: this test does not know {exe!r}; teach it")


README_COMMANDS = shell_commands(README.read_text())


def test_readme_has_commands_and_its_two_commands():
    assert len(README_COMMANDS) >= 8
    assert MAIN_JOB_COMMAND in README_COMMANDS and CI_TEST_COMMAND in README_COMMANDS
    ci = (ROOT / ".ci" / "run").read_text()
    assert CI_TEST_COMMAND in ci  # CI runs the README's test command
    assert ".venv/bin/python -m pytest -q -n 2 --dist loadfile lab/tests" in ci  # and the lab's, which hold the GPU-gate record check


@pytest.mark.parametrize("command", README_COMMANDS)
def test_readme_command_resolves(command):
    for argv in simple_commands(command):
        check_command(argv)


def test_the_readme_cpu_launch_line_is_the_one_a_test_serves():
    spec = importlib.util.spec_from_file_location("chat_template_test",
                                                  ROOT / "tests" / "accuracy" / "test_chat_template.py")
    served = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(served)
    assert served.README_CPU_LAUNCH in README_COMMANDS


@pytest.mark.parametrize("argv,message", [
    (["python", "-m", "sglang.launch_server", "--model-path", "configs/minimax-m3.1-tiny", "--device", "cpu"],
     "--load-format dummy"),
    (["python", "-m", "sglang.launch_server", "--model-path", "configs/no-such-model"], "no config.json"),
    (["python", "-m", "sglang.launch_servers", "--model-path", "configs/msa-small"], "no such module"),
    (["m3-accuracy", "--model", "configs/msa-small", "--formats", "fp8", "mxfp5"], "mxfp5"),
    (["m3-accuracy", "--model", "configs/msa-small", "--", "--no-such-flag"], "--no-such-flag"),
    (["m3-accuracy", "--model", "<model>", "--formats", "fp8", "mxfp4"], "placeholder"),
    (["./scripts/nothing.sh"], "no such script"),
    (["pip", "install", ".[nothing]"], "no extra"),
    (["curl", "http://127.0.0.1:30000/server_info"], "does not know"),
])
def test_a_wrong_command_is_caught(argv, message):
    with pytest.raises((AssertionError, argparse.ArgumentError, ValueError, SystemExit)) as e:
        check_command(argv)
    if not isinstance(e.value, SystemExit):
        assert message in str(e.value)


# Paths named by the docs.

TOP = {"kernels", "sglang_m3", "accuracy", "configs", "tests", "docs", "lab", "scripts", "examples", ".ci"}
ALIASES = {"m3_kernels": "kernels/m3_kernels"}  # how the docs name the kernel package's files
SUFFIXES = (".py", ".sh", ".md", ".json", ".jsonl", ".cuh", ".yaml", ".txt", ".log", ".png", ".tgz", ".toml")
OUTPUT_FLAGS = {"--out", "--output", "--output_path", "-o", "-w"}  # what follows is written by the command
PACKAGES = {"accuracy": "accuracy", "sglang_m3": "sglang_m3", "m3_kernels": "kernels/m3_kernels",
            "training": "lab/training"}


def expand_braces(word: str) -> list[str]:
    """``a_{x,y}.json`` as ``[a_x.json, a_y.json]`` (one level, left to right)."""
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return [w for part in m.group(1).split(",") for w in expand_braces(word[:m.start()] + part + word[m.end():])]


def repo_path(word: str) -> str | None:
    """The repository path ``word`` names, relative to the root, or None when it names none (a URL, a path of
    another project, a placeholder)."""
    word = word.strip().strip("\"'").split("::", 1)[0].rstrip(".,:;)")  # a pytest node id names its file
    if word.startswith("./"):
        word = word[2:]
    if not word or any(c in word for c in " <>$`|=") or "..." in word or "://" in word:
        return None
    first = word.split("/", 1)[0]
    if first in ALIASES and "/" in word:
        word = ALIASES[first] + word[len(first):]
        first = word.split("/", 1)[0]
    if first not in TOP or ("/" not in word and not word.endswith(SUFFIXES)):
        return None
    return word


def named_paths(doc: Path) -> list[tuple[str, Path]]:
    """``(as written, resolved)`` for every repository path ``doc`` names in backticks, links or shell blocks."""
    text = doc.read_text()
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):  # links resolve from the doc's folder
        target = target.split("#", 1)[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            found.append((target, (doc.parent / target).resolve()))
    words = re.findall(r"`([^`\n]+)`", text)
    for info, body in fenced_blocks(text):
        if info.strip() in SHELLS:
            shell = body.split()
            words += [w for i, w in enumerate(shell) if i == 0 or shell[i - 1] not in OUTPUT_FLAGS]
    for span in words:
        for word in span.split():
            for variant in expand_braces(word):
                path = repo_path(variant)
                if path is not None:
                    found.append((variant, ROOT / path))
    return found


def dotted_modules(doc: Path) -> list[str]:
    """``python -m pkg.mod`` targets of this project's packages named in ``doc``."""
    mods = re.findall(r"python3? -m ([A-Za-z_][\w.]*)", doc.read_text())
    return sorted({m for m in mods if m.split(".", 1)[0] in PACKAGES})


def module_file_exists(name: str) -> bool:
    top, *rest = name.split(".")
    base = ROOT / PACKAGES[top] / Path(*rest) if rest else ROOT / PACKAGES[top]
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or (base / "__main__.py").is_file()


def exists(path: Path) -> bool:
    return any(glob.glob(str(path))) if "*" in str(path) else path.exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc):
    missing = sorted({written for written, path in named_paths(doc) if not exists(path)})
    missing += [f"python -m {m}" for m in dotted_modules(doc) if not module_file_exists(m)]
    assert not missing, f"{doc.relative_to(ROOT)} names what the repository does not hold: {missing}"


def test_the_path_check_catches_what_it_should(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("Run `scripts/run_mx_variant_h200.sh`, read [x](no/such.md), see `lab/data/none_{a,b}.json`;\n"
                   "```bash\npython -m accuracy.nothing && tests/benchmarks/bench_mx_modes.py --out lab/data/new\n```\n"
                   "Fine: `sglang/srt/server_args.py`, `lab/gpu/`, `lab/data/bench_write_h200_2026-12-01.{md,json}`, "
                   "`m3_kernels/ops/pdl.py`, `lab/data/accuracy_h200_<date>_q4_call<N>.log`, `out/acc`.\n")
    written = {w for w, path in named_paths(doc) if not exists(path)}
    assert written == {"scripts/run_mx_variant_h200.sh", "no/such.md", "lab/data/none_a.json",
                       "lab/data/none_b.json", "tests/benchmarks/bench_mx_modes.py"}
    assert [m for m in dotted_modules(doc) if not module_file_exists(m)] == ["accuracy.nothing"]
