"""The import rules of docs/architecture.md, read from the source (every ``import``, lazy ones inside
functions included, so a rule cannot be dodged by importing late):

- ``models/``, ``kernels/`` and ``errors/`` import nothing else of the project;
- a pipeline schedule imports only its action vocabulary (``parallel.pipeline.schedules``);
- ``parallel/`` never imports ``configs/``, ``trainer/``, ``tools/`` or ``bench/``;
- ``data/`` and ``checkpoint/`` import nothing of the project but ``errors``;
- ``configs/`` imports only ``errors``, ``models``, ``parallel`` and ``data``; ``trainer/`` never ``tools/`` or ``bench/``;
- no ``_private`` name is imported across top-level packages;
- ``import configs.schema`` imports no torch;
- no module writes ``os.environ`` when it is imported (only inside functions someone calls).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "kernels", "errors", "parallel", "configs", "data", "checkpoint", "trainer", "tools", "bench")
SCHEDULES = "parallel.pipeline.schedules"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[_module_name(path)] = (path, ast.parse(path.read_text(), str(path)))
    return out


SOURCES = _sources()


def _imports(name: str, tree: ast.Module) -> set[str]:
    """Absolute names of everything ``name`` imports, anywhere in the file."""
    is_pkg = SOURCES[name][0].name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in SOURCES)
    return found


def _project(mods: set[str]) -> set[str]:
    return {m for m in mods if m.split(".")[0] in PACKAGES}


def _violations(allowed) -> list[str]:
    return sorted(f"{name} imports {m}" for name, (_, tree) in SOURCES.items()
                  for m in _project(_imports(name, tree)) if not allowed(name, m))


def _inside(name: str, *pkgs: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in pkgs)


def test_every_installed_package_is_packaged():
    """``pip install`` ships only the packages pyproject.toml names; a new top-level package missing there
    imports from the repository root (tests, CI) but not from an installed copy."""
    import fnmatch
    import tomllib
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = [p for p in PACKAGES if p != "bench"]   # bench/ runs from a checkout
    assert [p for p in shipped if not any(fnmatch.fnmatch(p, pat) for pat in include)] == []


def test_sources_were_found():
    assert {"models.moe", "kernels.quant", "errors", "parallel.dims", "configs.schema", "trainer.train", "data.corpus",
            "checkpoint.manager",
            f"{SCHEDULES}.dualpipe"} <= set(SOURCES)


RULES = {   # rule id -> allowed(importing module, imported module)
    **{f"{pkg}-imports-nothing-else": lambda n, m, pkg=pkg: not _inside(n, pkg) or _inside(m, pkg)
       for pkg in ("models", "kernels", "errors")},
    "schedules-import-only-their-vocabulary": lambda n, m: not _inside(n, SCHEDULES) or _inside(m, SCHEDULES),
    "parallel-never-configs-trainer-tools-bench":
        lambda n, m: not _inside(n, "parallel") or not _inside(m, "configs", "trainer", "tools", "bench"),
    **{f"{pkg}-imports-only-errors": lambda n, m, pkg=pkg: not _inside(n, pkg) or _inside(m, pkg, "errors")
       for pkg in ("data", "checkpoint")},
    "configs-import-only-what-is-below":
        lambda n, m: not _inside(n, "configs") or _inside(m, "configs", "errors", "models", "parallel", "data"),
    "trainer-never-tools-or-bench": lambda n, m: not _inside(n, "trainer") or not _inside(m, "tools", "bench"),
}


@pytest.mark.parametrize("rule", RULES)
def test_import_rule(rule):
    assert _violations(RULES[rule]) == []


def _private_imports(name: str, tree: ast.Module) -> list[str]:
    """``from X import _y`` (or ``X._y``) where X is in another top-level package than ``name``."""
    top = name.split(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in PACKAGES and node.module.split(".")[0] != top:
                out += [f"{name} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return out


def test_no_private_name_crosses_a_top_level_package():
    assert [v for name, (_, tree) in SOURCES.items() for v in _private_imports(name, tree)] == []


def test_configs_schema_imports_no_torch():
    """The schema and its checks load without torch (the registries in parallel/ are read at validation)."""
    import subprocess
    import sys
    code = "import sys, configs.schema; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def _environ_writes_at_import(tree: ast.Module) -> list[int]:
    """Lines of statements run at import (module and class bodies, not function bodies) that write
    ``os.environ``: item assignment or deletion, ``setdefault``/``update``/``pop``/``clear``, ``os.putenv``."""
    lines, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and ast.unparse(node.value) in ("os.environ", "environ"):
            lines.append(node.lineno)
        if isinstance(node, ast.Call):
            fn = ast.unparse(node.func)
            if fn in ("os.putenv", "putenv") or any(fn == f"{e}.{m}" for e in ("os.environ", "environ")
                                                   for m in ("setdefault", "update", "pop", "clear", "popitem")):
                lines.append(node.lineno)
        todo.extend(ast.iter_child_nodes(node))
    return sorted(lines)


def test_no_module_writes_the_environment_at_import():
    bad = {name: lines for name, (_, tree) in SOURCES.items() if (lines := _environ_writes_at_import(tree))}
    assert bad == {}


def test_the_checks_can_fail():
    """Each rule, fed a module that breaks it, reports it (so an empty list above means something)."""
    tree = ast.parse("import os\nos.environ.setdefault('A', '1')\nos.environ['B'] = '2'\n"
                     "def f():\n    os.environ['C'] = '3'\n")
    assert _environ_writes_at_import(tree) == [2, 3]
    SOURCES["models._probe"] = (ROOT / "models" / "_probe.py",
                                ast.parse("def f():\n    from parallel.dims import ParallelDims\n"))
    SOURCES["parallel._probe"] = (ROOT / "parallel" / "_probe.py", ast.parse("from ..configs import schema\n"))
    try:
        assert "models._probe imports parallel.dims" in _violations(RULES["models-imports-nothing-else"])
        assert "parallel._probe imports configs" in _violations(RULES["parallel-never-configs-trainer-tools-bench"])
        assert _private_imports("tools._probe", ast.parse("from data.corpus import _sha, iter_docs\n"
                                                          "from tools.x import _y\n")) == ["tools._probe imports data.corpus._sha"]
    finally:
        del SOURCES["models._probe"], SOURCES["parallel._probe"]


PRODUCT = ("models", "kernels", "errors", "parallel", "configs", "data", "checkpoint", "trainer", "tools")
MAX_FUNCTION_LINES = 60


def test_no_product_function_is_longer_than_60_lines():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, (path, tree) in SOURCES.items() if name.split(".")[0] in PRODUCT
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


def test_no_issue_numbers_or_dates_in_product_code():
    """Code says what is, not when or for which ticket: dated runs live in docs/log/."""
    import re
    pattern = re.compile(r"issue #|\b20[23]\d-(0[1-9]|1[0-2])\b")       # an issue reference, a year-month, a date
    hits = [f"{path.relative_to(ROOT)}:{i}" for name, (path, _) in SOURCES.items() if name.split(".")[0] in PRODUCT
            for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
