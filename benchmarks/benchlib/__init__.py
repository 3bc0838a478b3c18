"""The benchmarks' library: what the entry scripts in ``benchmarks/`` share. Not a script.

Each entry script (``benchmarks/bench_*.py``, ``scale_model.py``, ``eo_side_by_side.py``)
imports from here; nothing here imports an entry script or the tests.

- ``harness``: tables, targets, JSON reports, the machine line, a timed Lightning fit;
- ``ranks``: the multi-process launcher (gloo or NCCL), the ranks' flags, model and batches;
- ``timing``: timed calls within a budget (``bench_optimizer.py``'s tables);
- ``counting``: bytes per collective and Newton-Schulz FLOPs, counted by wrapping the calls;
- ``ns_tables``, ``step_table``: ``bench_optimizer.py``'s Newton-Schulz tables and step table;
- ``ddp_summary``: ``bench_ddp.py``'s summary and tables;
- ``scale_profiles``, ``scale_counts``, ``scale_designs``, ``scale_memory``: ``scale_model.py``'s
  hardware profiles, bytes and FLOPs per design, time per step, and memory per rank.
"""

__all__ = [
    "counting",
    "ddp_summary",
    "harness",
    "ns_tables",
    "ranks",
    "scale_counts",
    "scale_designs",
    "scale_memory",
    "scale_profiles",
    "step_table",
    "timing",
]
