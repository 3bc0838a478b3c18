"""The benchmarks' library: what the entry scripts in ``benchmarks/`` share. Not a script.

Every top-level file of ``benchmarks/`` is an entry script and imports from here; nothing
here imports an entry script or the tests.

- ``harness``: tables, targets, JSON reports, the machine line, a timed Lightning fit;
- ``ranks``: the multi-process launcher (gloo or NCCL), the ranks' flags, model and batches;
- ``timing``: timed calls within a budget (``bench_optimizer.py``'s tables);
- ``counting``: bytes per collective and Newton-Schulz FLOPs, counted by wrapping the calls;
- ``ns_tables``, ``step_table``: ``bench_optimizer.py``'s Newton-Schulz tables and step table;
- ``ddp_summary``, ``fsdp_summary``: ``bench_ddp.py``'s and ``bench_fsdp.py``'s settings, summaries, tables;
- ``tp_blocks``: ``bench_tp.py``'s blocks on a (data x tensor) mesh;
- ``quality_table``: ``bench_quality.py``'s table;
- ``memory``: memory per rank of one optimizer step (the meter, the flags, the tables), and
  its measurements beside what they measure: ``memory_optimizer`` (``bench_optimizer.py
  --sections memory``), ``memory_ranks`` (``bench_ddp.py``, ``bench_fsdp.py``, ``bench_tp.py``
  ``--memory``), ``memory_callbacks`` (``bench_spectra.py --memory``).

The studies built on these measurements (the scale model, the Emerging-Optimizers side by
side) live in ``studies/``.
"""

__all__ = [
    "counting",
    "ddp_summary",
    "fsdp_summary",
    "harness",
    "memory",
    "memory_callbacks",
    "memory_optimizer",
    "memory_ranks",
    "ns_tables",
    "quality_table",
    "ranks",
    "step_table",
    "timing",
    "tp_blocks",
]
