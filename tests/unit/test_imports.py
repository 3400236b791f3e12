"""The package's shape, read from the source with `ast` (nothing is imported): no module past 400 lines,
and imports that run one way: the model below the engine, the engine below the Triton glue, the
launcher and the tools, the client apart from the benchmarks, and no cycle among the launcher's modules.

Every import statement counts, wherever it is in a module: at the top, inside a function, or under
`if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from batchlm.paths import PROJECT_ROOT

MAX_LINES = 400
# Modules over MAX_LINES that are being shrunk elsewhere: path -> why it is let through for now.
# Where each import name's source lives
ROOTS = {"batchlm": PROJECT_ROOT / "batchlm", "batchlm_client": PROJECT_ROOT / "client"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every .py file of batchlm/ and client/."""
    found = {}
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The modules `name` imports (of any package), as dotted names: `from p import m` counts as `p.m`
    where m is a module of ours, else as `p`."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(importer: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{name} imports {target}" for name in MODULES if _within(name, importer)
            for target in sorted(_imports(name)) if any(_within(target, f) for f in forbidden)]


def test_no_module_is_over_400_lines():
    lengths = {str(path.relative_to(PROJECT_ROOT)): len(path.read_text().splitlines()) for path in MODULES.values()}
    long = {path: n for path, n in lengths.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


SERVING = ("batchlm.backend", "batchlm.launcher", "batchlm.frontend", "batchlm.bench", "batchlm.eval", "batchlm_client")


@pytest.mark.parametrize("importer, forbidden", [
    ("batchlm.kernels", ("batchlm.model", "batchlm.engine", *SERVING)),
    ("batchlm.model", ("batchlm.engine", *SERVING)),
    ("batchlm.engine", SERVING),
    ("batchlm.request_schema", ("batchlm.model", "batchlm.engine", *SERVING)),
    ("batchlm.backend", ("batchlm.launcher", "batchlm.frontend", "batchlm.bench", "batchlm.eval", "batchlm_client")),
    ("batchlm.frontend", ("batchlm.engine", "batchlm.backend", "batchlm.launcher", "batchlm.bench", "batchlm.eval",
                          "batchlm_client")),
    ("batchlm.launcher", ("batchlm.frontend", "batchlm.bench", "batchlm.eval", "batchlm_client")),
    ("batchlm_client", ("batchlm.engine", "batchlm.backend", "batchlm.launcher", "batchlm.frontend", "batchlm.bench",
                        "batchlm.eval")),
], ids=lambda v: v if isinstance(v, str) else None)
def test_imports_run_one_way_between_layers(importer, forbidden):
    assert not _violations(importer, forbidden)


def test_the_launcher_modules_import_each_other_without_a_cycle():
    launcher = {name for name in MODULES if _within(name, "batchlm.launcher") and name != "batchlm.launcher"}
    edges = {name: sorted(t for t in _imports(name) if t in launcher) for name in launcher}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            pytest.fail("import cycle: " + " -> ".join([*path[path.index(name):], name]))
        if name in done:
            return
        for target in edges[name]:
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(launcher):
        visit(name, [])


def test_the_checks_see_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    """The parser itself: lazy and relative imports are found, and `from p import m` names the module."""
    module = tmp_path / "probe.py"
    module.write_text("from . import attention\nfrom ..errors import InvalidArgument\n\ndef f():\n"
                      "    from batchlm.engine import engine\n    import batchlm.launcher.ports\n")
    monkeypatch.setitem(MODULES, "batchlm.model.probe", module)
    assert _imports("batchlm.model.probe") == {"batchlm.model.attention", "batchlm.errors", "batchlm.engine.engine",
                                               "batchlm.launcher.ports"}
    assert _violations("batchlm.model", ("batchlm.engine",)) == ["batchlm.model.probe imports batchlm.engine.engine"]
