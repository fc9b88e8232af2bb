"""What the tests and the benchmarks share (engine-like faults, synthetic run directories,
a headless browser); never installed with lpx (pyproject lists its packages)."""
