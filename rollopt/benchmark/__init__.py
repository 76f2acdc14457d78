"""``rollopt bench``: run scheduling policies side by side on one seeded workload and measure the speedup."""
