"""The test run's own report: skipped tests are listed grouped by reason (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]


def test_skips_are_summarised_by_reason(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(
        test_some="""
        import pytest

        @pytest.mark.parametrize("i", range(3))
        def test_needs_redis(i):
            pytest.skip("redis-server is not installed")

        @pytest.mark.skip(reason="needs CUDA")
        def test_cuda():
            pass

        def test_runs():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=4)
    result.stdout.re_match_lines([r".*skipped tests by reason \(4 in all\).*", r"\s+3  redis-server is not installed",
                                  r"\s+1  needs CUDA"])  # fmt: skip


def test_no_section_without_skips(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_one="def test_runs():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "skipped tests by reason" not in result.stdout.str()
