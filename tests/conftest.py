"""Session-wide test set-up."""

import pytest

from tests._harness import close_all


def pytest_sessionfinish(session, exitstatus):
    """Stop the rank pools when the session ends, so no worker outlives pytest."""
    close_all()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``spectral_extra`` (they import neuraloperator on every rank) run only with ``-m spectral_extra``.

    Without the ``spectral`` extra installed they skip (``pytest.importorskip``).
    """
    if "spectral_extra" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="spectral extra: pip install -e '.[spectral]', then pytest -m spectral_extra")
    for item in items:
        if "spectral_extra" in item.keywords:
            item.add_marker(skip)
