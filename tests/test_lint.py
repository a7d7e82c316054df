"""The code passes the linter (ruff; its rules and line length are in pyproject.toml), and the
package's rooms import downward only (trainer/README.md)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.tool
def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_stays_a_manual():
    """What a user runs and sets; measurements and design go to docs/."""
    assert len((REPO / "README.md").read_bytes()) <= 32_000


# Each room's floor (trainer/README.md): a module imports from its own room or a lower floor.
FLOORS = {"errors": 0, "tensors": 0, "hardware": 0, "step_parts": 0, "torchao_import": 0,
          "safe_write": 1,
          "distributed": 1, "config": 1,
          "models": 2, "optim": 3, "float8": 3, "parallel": 4, "data": 5, "checkpoint": 6,
          "faults": 7, "observe": 7, "checks": 8, "plan": 9, "run": 10}


def imports_of_each_module() -> dict[str, list[tuple[str, bool]]]:
    """Every module of trainer/ -> the trainer modules it imports, each with whether at module
    level."""
    paths = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted((REPO / "trainer").rglob("*.py"))}
    found = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        found[name] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from trainer.data import chat`: the submodule chat, where there is one
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in paths
                           else node.module
                           for alias in node.names]
            else:
                continue
            found[name] += [(t, id(node) in top) for t in targets if t.split(".")[0] == "trainer"]
    return found


def test_the_rooms_import_downward_and_no_module_imports_itself_round():
    modules = imports_of_each_module()
    room = lambda name: name.split(".")[1]  # noqa: E731
    assert {room(name) for name in modules if name != "trainer"} == set(FLOORS)
    upward = [f"{name} -> {target}" for name, targets in modules.items() if name != "trainer"
              for target, _ in targets if target != "trainer" and room(target) != room(name)
              and FLOORS[room(target)] >= FLOORS[room(name)]]
    assert not upward, upward
    # Cycles among module-level imports (an import inside a function runs later and closes none).
    graph = {name: {t for t, top in targets if top and t in modules}
             for name, targets in modules.items()}
    done, path = set(), []

    def visit(name: str) -> None:
        assert name not in path, " -> ".join(path[path.index(name):] + [name])
        if name not in done:
            path.append(name)
            for target in sorted(graph[name]):
                visit(target)
            path.pop()
            done.add(name)

    for name in sorted(graph):
        visit(name)


LONGEST_FUNCTION = 60  # lines, decorators and docstring included


def test_no_function_of_the_package_is_longer_than_a_reader_can_hold():
    long = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno
                         - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1)
                if lines > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} "
                                "lines)")
    assert not long, long
