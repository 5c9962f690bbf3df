"""Console script commfuse-probe (topology report); commfuse-bench lives in commfuse.bench."""
