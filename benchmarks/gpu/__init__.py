"""Running the benchmarks on a GPU machine without a package registry: ``benchmarks.gpu.stage`` carries a
wheelhouse (scripts/wheelhouse.sh) and other files there in folders small enough for one call each;
``benchmarks/gpu/node.sh`` installs them there and runs a benchmark (docs/benchmarks.md: the calls)."""
