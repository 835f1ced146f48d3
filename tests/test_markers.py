"""The suite's own rule: a test that starts ranks is marked ``multirank``, so that
``make test-fast`` (``-m "not slow and not multirank"``) starts none. tests/conftest.py checks
it; these tests run that conftest on small suites of their own."""

import shutil
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
INI = """
[pytest]
markers =
    slow: long
    multirank: starts ranks
"""


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    shutil.copytree(Path(__file__).parent / "harness", pytester.path / "harness",
                    ignore=shutil.ignore_patterns("__pycache__"))  # the conftest imports it
    return pytester


def test_a_test_asking_for_ranks_without_the_marker_stops_the_collection(suite):
    suite.makepyfile(test_one="""
        import pytest

        def test_unmarked(ranks):
            pass

        @pytest.mark.multirank
        def test_marked(ranks):
            pass
    """)
    result = suite.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*use the `ranks` fixture but are not marked @pytest.mark.multirank*"
                                 "test_one.py::test_unmarked"])


def test_a_test_that_launches_ranks_without_the_marker_fails_naming_the_command(suite):
    suite.makepyfile(test_two="""
        import subprocess, sys
        import pytest

        LAUNCH = [sys.executable, "-c", "pass", "fzero", "launch"]   # what `fzero launch` looks like

        def test_unmarked():
            subprocess.run(LAUNCH, check=True)

        @pytest.mark.multirank
        def test_marked():
            subprocess.run(LAUNCH, check=True)

        def test_a_plain_subprocess():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
    """)
    # in a process of its own: this test's own watch would see the command otherwise
    result = suite.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*test_two.py::test_unmarked starts ranks (*launch*) but is not marked "
                                 "@pytest.mark.multirank*"])
