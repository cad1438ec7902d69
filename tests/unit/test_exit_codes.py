"""Exit codes are named in one place (ringd/errors.py): no bare number creeps back.

An AST scan of ringd/*.py and ringwatch/*.py: the exit-code argument of every
call that ends a command (``fail``, ``_fail``, ``RingError``, ``OperatorError``,
``ConfigError``; ``sys.exit``, ``os._exit``, ``click.exceptions.Exit``) and the
default of every ``code`` parameter must not be an integer literal other
than 0 - it is one of ringd.core.errors' constants (EX_*, STATUS_*) instead.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# callee name -> position of the exit code among its positional arguments
CODE_AT = {"fail": 1, "_fail": 1, "RingError": 1, "OperatorError": 1, "ConfigError": 1,
           "exit": 0, "_exit": 0, "Exit": 0}


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _bare(node) -> bool:
    return (isinstance(node, ast.Constant) and type(node.value) is int and node.value != 0) or (
        isinstance(node, ast.UnaryOp) and _bare(node.operand))


def bare_exit_codes(path: Path):
    """(line, what) for each bare exit-code literal in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and _name(node.func) in CODE_AT:
            at = CODE_AT[_name(node.func)]
            args = [a for a in node.args[at:at + 1]] + [k.value for k in node.keywords if k.arg == "code"]
            found += [(node.lineno, f"{_name(node.func)}(... {ast.unparse(a)})") for a in args if _bare(a)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = a.posonlyargs + a.args
            defaults = list(zip(params[len(params) - len(a.defaults):], a.defaults))
            defaults += [(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            found += [(d.lineno, f"def {node.name}({p.arg}={ast.unparse(d)})")
                      for p, d in defaults if p.arg == "code" and _bare(d)]
    return found


def sources(root: Path = ROOT):
    return sorted(p for pkg in ("ringd", "ringwatch") for p in (root / pkg).glob("*.py"))


def bare_in(root: Path = ROOT):
    return [f"{p.relative_to(root)}:{line}: {what}" for p in sources(root) for line, what in bare_exit_codes(p)]


def test_no_bare_exit_code_literals():
    bad = bare_in()
    assert not bad, "exit codes come from ringd.core.errors (EX_*, STATUS_*), not bare numbers:\n" + "\n".join(bad)


def test_errors_py_names_its_codes_once():
    """RingError's default is a name, and no number is named twice under the EX_
    prefix (STATUS_* are the LSB's, a separate set)."""
    from ringd.core import errors
    ex = {k: v for k, v in vars(errors).items() if k.startswith("EX_") and isinstance(v, int)}
    assert len(set(ex.values())) == len(ex), ex
    assert errors.RingError("x").code == errors.EX_FAILURE == 1
    assert errors.EX_BAD_USAGE == 2


@pytest.mark.parametrize("text, hits", [
    ("raise fail('x', 1)\n", 1),
    ("raise OperatorError('x', code=2)\n", 1),
    ("sys.exit(1)\n", 1),
    ("raise click.exceptions.Exit(1)\n", 1),
    ("def f(message, code: int = 1): pass\n", 1),
    ("raise fail('x', EX_FAILURE)\nsys.exit(0)\ns.replace('a', 'b', 1)\nsock.setsockopt(1, 2, 1)\n", 0),
])
def test_the_scan_sees_a_bare_code(tmp_path, text, hits):
    p = tmp_path / "m.py"
    p.write_text(text)
    assert len(bare_exit_codes(p)) == hits
