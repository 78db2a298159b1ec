"""Spectral models (FNO, AFNO) on ShardTensors against one process: issue 16's conformance with real model code.

The models are user code from ``examples/spectral_models.py`` (and, with the
``spectral`` extra, neuraloperator's FNO, imported unchanged); importing
``tests.examples`` puts the examples folder on ``sys.path`` for the test
process and the harness's ranks alike.
"""

from tests.examples import EXAMPLES  # noqa: F401  (puts the examples on sys.path)
