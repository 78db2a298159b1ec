"""Session-wide test set-up."""

import pytest

from tests._harness import close_all


def pytest_sessionfinish(session, exitstatus):
    """Stop the rank pools when the session ends, so no worker outlives pytest."""
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
