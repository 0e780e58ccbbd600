"""Side-by-side benchmarks: interleaved configurations, warm-up, medians, ratios measured in one run."""
