"""The package's shape: layers as folders, imports pointing down, a pure core."""
import ast
from pathlib import Path

import pytest

RINGD = Path(__file__).resolve().parents[2] / "ringd"
# lowest first: a module may import its own layer and the layers before it
LAYERS = ("core", "host", "inputs", "journal", "loops", "cli")
NOT_IN_CORE = {"os", "time", "subprocess", "signal", "socket", "sqlite3", "psutil", "threading",
               "select", "selectors", "fcntl", "shutil"}


def imports(path: Path):
    """(module, line) for every import in ``path``, lazy ones inside functions too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno


def layer_modules(layer: str):
    return sorted((RINGD / layer).glob("*.py"))


def test_every_layer_is_a_package_with_a_one_line_docstring():
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((RINGD / layer / "__init__.py").read_text()))
        assert doc and "\n" not in doc.strip(), layer


def test_at_most_twelve_modules_stay_at_the_top_level():
    assert len(list(RINGD.glob("*.py"))) <= 12


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_point_down(layer):
    allowed = set(LAYERS[:LAYERS.index(layer) + 1])
    wrong = [(p.name, mod, line) for p in layer_modules(layer) for mod, line in imports(p)
             if mod.startswith("ringd.") and mod.split(".")[1] in LAYERS and mod.split(".")[1] not in allowed]
    assert not wrong, f"{layer} imports a layer above it: {wrong}"


def test_no_relative_imports():
    rel = [(str(p.relative_to(RINGD)), n.lineno) for p in RINGD.rglob("*.py")
           for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not [r for r in rel if not r[0].startswith("__main__")], rel


def test_core_touches_no_clock_file_or_process():
    wrong = [(p.name, mod, line) for p in layer_modules("core") for mod, line in imports(p)
             if mod.split(".")[0] in NOT_IN_CORE]
    assert not wrong, f"ringd/core must stay pure: {wrong}"


def test_every_module_has_a_docstring():
    missing = [str(p.relative_to(RINGD)) for p in RINGD.rglob("*.py")
               if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing
def test_no_function_is_over_100_lines():
    long = [(str(p.relative_to(RINGD)), n.name, n.end_lineno - n.lineno + 1)
            for p in RINGD.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 100]
    assert not long, long
