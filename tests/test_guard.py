"""The fast tier's guard (conftest.py): a test not marked `multiprocess` may not start a process,
neither in its body nor in a fixture it sets up, whatever the fixture's scope."""

import shutil
from pathlib import Path

pytest_plugins = ["pytester"]

CASES = '''
import subprocess
import pytest

@pytest.fixture(scope="module")
def module_process():
    subprocess.run(["true"])

@pytest.fixture(scope="session")
def session_process():
    subprocess.run(["true"])

def test_module_fixture(module_process):
    pass

def test_session_fixture(session_process):
    pass

def test_body():
    subprocess.run(["true"])

def test_no_process():
    pass
'''


def test_a_process_from_any_fixture_of_an_unmarked_test_is_refused(pytester):
    shutil.copy(Path(__file__).with_name("conftest.py"), pytester.path / "conftest.py")
    pytester.makepyfile(test_cases=CASES)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=2, failed=1)
    # Each refusal names the inner test (this test's own guard would name this test).
    for name in ("test_module_fixture", "test_session_fixture", "test_body"):
        assert f"test_cases.py::{name} starts a process: mark it" in result.stdout.str(), name
