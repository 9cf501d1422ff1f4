"""Tools on top of the engine: the command line, the conformance suite, benchmarks."""
