"""Benchmarks of physicsnemo_dp: every figure is a ratio to a baseline measured in the same run."""
