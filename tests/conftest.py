"""Session-wide test set-up."""

import pytest

from tests._harness import close_all


def pytest_sessionfinish(session, exitstatus):
    """Stop the rank pools when the session ends, so no worker outlives pytest."""
    close_all()


_EXTRAS = {
    "spectral_extra": "spectral extra: pip install -e '.[spectral]', then pytest -m spectral_extra",
    "graph_extra": "graph extra: pip install -e '.[graph]', then pytest -m graph_extra",
    "slow": "slow end-to-end duplicate of a default-run path: pytest -m slow",
    "opinfo_full": "the whole OpInfo sweep (~20 min): pytest tests/ops/opinfo -m opinfo_full -s",
}


def pytest_collection_modifyitems(config, items):
    """Tests of an optional extra (marked ``spectral_extra`` or ``graph_extra``: they import a large third-party
    library on every rank), ``slow`` end-to-end runs (a path the default run already covers, started once
    more as a whole ``torchrun`` job) and the whole OpInfo sweep (``opinfo_full``) run only when ``-m`` names
    their marker.

    Without the extra installed they skip (``pytest.importorskip``).
    """
    selected = config.getoption("-m") or ""
    for marker, reason in _EXTRAS.items():
        if marker in selected:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
