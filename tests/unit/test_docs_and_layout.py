"""The docs name only what exists, and the repository keeps the shape they describe: every repository
path, test, make target, console script, `batchlm-bench` subcommand and `python -m` module that
README.md and docs/*.md mention is there; the package's public API imports; nothing patches sys.path."""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import subprocess
import sys
import tokenize

import pytest
import tomllib

from batchlm.bench.__main__ import SUBCOMMANDS
from batchlm.paths import PROJECT_ROOT

DOCS = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
TOP = ("batchlm", "client", "scripts", "tests", "docs", "model_repository", "docker", "locustfiles")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*)(::\w+)?" % "|".join(TOP))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MAKE = re.compile(r"(?:^|`|\$ )make ([a-z][\w-]*)", re.M)
SCRIPT = re.compile(r"\.venv/bin/([\w-]+)")
BENCH = re.compile(r"(?:`|/|^\s*)batchlm-bench ([a-z][\w-]*)", re.M)
MODULE = re.compile(r"python -m ([\w.]+)")
# How the project was made, which git history and issue notes hold: work markers, and in code and tests also
# past measurements narrated in a comment (a figure belongs in a doc, beside the command that reproduces it).
WORK_HISTORY = (r"\bsessions? \d|\bissues? #?\d|\bcommit [0-9a-f]{7,}|\bbefore (?:the|this) (?:fix|change)"
                r"|\bpreviously\b")
DOC_HISTORY = re.compile(WORK_HISTORY + r"|experiments/|measurements\.md", re.I)
CODE_HISTORY = re.compile(WORK_HISTORY + r"|\bmeasured (?:on|here|in)\b[^.\n]*\d"
                          r"|\bmeasured\b[^.\n]{0,80}\d(?:\.\d+)? ?(?:ms|s|us|µs|x|%|tok/s)\b"
                          r"|\b(?:took|was|were)\b[^.\n]{0,40}\d(?:\.\d+)? ?(?:ms|s|us|µs|x|%|tok/s)\b", re.I)
CODE = ("*.py", "*.cpp", "*.h", "*.c", "*.sh", "*.pbtxt", "Makefile", "*Dockerfile")


def doc_ids() -> list[str]:
    return [str(p.relative_to(PROJECT_ROOT)) for p in DOCS]


@pytest.fixture(params=DOCS, ids=doc_ids())
def doc(request):
    return request.param


def test_every_repository_path_and_test_a_doc_names_exists(doc):
    text = doc.read_text()
    missing = []
    for match in PATH.finditer(text):
        path, test = match.group(1).rstrip("."), match.group(2)
        target = PROJECT_ROOT / path
        if not target.exists():
            missing.append(path)
        elif test and not re.search(rf"^\s*def {test[2:]}\(", target.read_text(), re.M):
            missing.append(path + test)
    for link in LINK.findall(text):
        if "://" not in link and not (doc.parent / link).exists():
            missing.append(link)
    assert not missing, f"{doc.name} names what is not in the repository: {sorted(set(missing))}"


def test_every_command_a_doc_names_exists(doc):
    text = doc.read_text()
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    scripts = set(tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    wrong = [f"make {t}" for t in MAKE.findall(text) if t not in targets]
    wrong += [f".venv/bin/{s}" for s in SCRIPT.findall(text)
              if s not in scripts and s not in ("python", "pip", "locust", "pytest")]
    wrong += [f"batchlm-bench {s}" for s in BENCH.findall(text) if s not in SUBCOMMANDS]
    wrong += [f"python -m {m}" for m in MODULE.findall(text) if importlib.util.find_spec(m.rstrip(".")) is None]
    assert not wrong, f"{doc.name} names commands that do not exist: {sorted(set(wrong))}"


def test_docs_describe_the_product_not_its_history(doc):
    found = [m.group(0) for m in DOC_HISTORY.finditer(doc.read_text())]
    assert not found, f"{doc.name} speaks of how the project was made: {found}"


def _comments(path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring-like string of a source file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        marker = "//" if path.suffix in (".cpp", ".h", ".c") else "#"
        return [(n, line[line.index(marker):]) for n, line in enumerate(text.splitlines(), 1) if marker in line]
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT
            or (tok.type == tokenize.STRING and tok.string.lstrip("rRbBuUfF").startswith(('"""', "'''")))]


def test_code_and_tests_say_why_not_how_they_came_to_be():
    files = subprocess.run(["git", "ls-files", *CODE], cwd=PROJECT_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert any(f.startswith("tests/") for f in files) and any(f.endswith(".cpp") for f in files), files
    found = [f"{f}:{n}: {m.group(0)!r}" for f in files if (PROJECT_ROOT / f).exists()
             for n, text in _comments(PROJECT_ROOT / f) for m in CODE_HISTORY.finditer(text)]
    assert not found, "comments that narrate work history or past measurements:\n" + "\n".join(found)


def test_the_history_patterns_catch_what_they_are_for():
    # NOTE: the stories are joined from their words here, so that this file itself holds none of them
    stories = [" ".join(words) for words in (
        ("# measured", "on the 2-core machine: 1.4 ms"), ("// a step took", "17.5 ms instead of 11.8 ms"),
        ("Issue", "2's smoke test"), ("# before", "the fix it hung"), ("# x5-x11 (session", "12)"))]
    for story in stories:
        assert CODE_HISTORY.search(story), story
    for fact in ("# what is measured, per engine, from t=0", "# one step costs ~5 op calls per layer"):
        assert not CODE_HISTORY.search(fact), fact


def test_the_readme_is_read_in_ten_minutes():
    assert len((PROJECT_ROOT / "README.md").read_text().splitlines()) <= 220


def test_every_bench_subcommand_has_a_module_with_main():
    for name, module in SUBCOMMANDS.items():
        spec = importlib.util.find_spec(module)
        assert spec is not None, name
        tree = ast.parse(open(spec.origin).read())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), name


def test_bench_refuses_an_unknown_subcommand_naming_the_known_ones():
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "nonsense"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "'nonsense'" in proc.stderr and "compare" in proc.stderr, proc.stderr


def test_the_public_api_imports_without_loading_torch_until_used():
    code = ("import sys, batchlm; assert 'torch' not in sys.modules; "
            "from batchlm import LLMEngine, EngineConfig, SamplingParams, RequestOutput; "
            "assert LLMEngine.__module__ == 'batchlm.engine.engine'; print(EngineConfig().max_num_seqs)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(AttributeError):
        import batchlm
        batchlm.NoSuchThing  # noqa: B018


def test_no_file_patches_sys_path():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    patching = [f for f in tracked if (PROJECT_ROOT / f).exists() and f != "tests/unit/test_docs_and_layout.py"
                and re.search(r"sys\.path\.(insert|append)", (PROJECT_ROOT / f).read_text())]
    assert not patching, patching


def test_scripts_holds_only_what_a_user_runs():
    names = sorted(p.name for p in (PROJECT_ROOT / "scripts").iterdir() if p.name != "__pycache__")
    assert names == ["build_llama_server.sh", "build_trtllm_engine.py", "default-model.txt", "gpu_smoke.sh",
                     "install_default_model.py", "install_optimum_intel.sh", "make_tiny_model.py", "serve.py",
                     "serve_trtllm.py", "setup.sh"]
