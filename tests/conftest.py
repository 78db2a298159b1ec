"""Session-wide test set-up."""

import pytest

from tests._harness import close_all


_early = []  # test modules whose background jobs pytest_collection_finish started


def pytest_collection_finish(session):
    """Start the two stalled ``torchrun`` jobs of ``tests/examples/test_training_safety.py`` as soon as the tests are
    collected, when a test reading them is selected and other tests run before that module: each job spends ~10 s
    waiting for its watchdog, which then passes beside the tests before them instead of adding to the run (see
    ``StalledJobs`` there). Not for ``--collect-only``, nor when that module runs first (its fixture starts them)."""
    if session.config.option.collectonly or not session.items:
        return
    readers = [item for item in session.items if "stalled_jobs" in getattr(item, "fixturenames", ())]
    if readers and getattr(session.items[0], "module", None) is not readers[0].module:
        readers[0].module.start_early()
        _early.append(readers[0].module)


def pytest_sessionfinish(session, exitstatus):
    """Stop the rank pools when the session ends, so no worker outlives pytest; end background jobs no test read."""
    for module in _early:
        module.stop_early()
    close_all()


_OPT_IN = {
    "slow": "slow end-to-end duplicate of a default-run path: pytest -m slow",
    "opinfo_full": "the whole OpInfo sweep (~20 min): pytest tests/ops/opinfo -m opinfo_full -s",
}


def pytest_collection_modifyitems(config, items):
    """``slow`` end-to-end runs (a path the default run already covers, started once more as a whole
    ``torchrun`` job) and the whole OpInfo sweep (``opinfo_full``) run only when ``-m`` names their marker.

    Tests of an optional extra (``spectral_extra``: neuraloperator, ``graph_extra``: torch_geometric) run by
    default, since ``run.py setup`` installs both; where the extra is missing they skip
    (``pytest.importorskip``), and ``-m "not graph_extra"`` leaves them out.
    """
    selected = config.getoption("-m") or ""
    for marker, reason in _OPT_IN.items():
        if marker in selected:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
