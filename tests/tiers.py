"""The test tiers (issue 40; docs/testing.md): `pytest` runs the fast tier, `pytest --full` everything.

A test is in the slow tier only because of its measured time: SLOW maps its node id (a parametrized
test's id without the brackets covers every parametrization) to the seconds it took in the full run
recorded in docs/testing.md. KEEP_FAST names the tests that keep every engine, task, data format and
failure mode in the fast tier whatever their time; tests/unit/test_suite_layout.py checks that none of
them is slow and that every SLOW entry names a test that exists."""

SLOW: dict[str, float] = {}

# one test per engine, task, data format and failure mode stays in the fast tier
KEEP_FAST: dict[str, str] = {}


def is_slow(nodeid: str) -> bool:
    return nodeid in SLOW or nodeid.split("[")[0] in SLOW
