"""Console scripts: commfuse-probe (topology report) and commfuse-bench (side-by-side benchmark)."""
