"""Test suite of physicsnemo_dp; a package so that rank processes can import test modules by name."""
