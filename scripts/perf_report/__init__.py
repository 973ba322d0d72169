"""The pieces of scripts/perf-report.py: bench output readers, the machine's description,
the replay and callgrind runs, and one module per group of tables of docs/performance.md."""
