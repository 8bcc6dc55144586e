"""The benchmark harness of dsa_jax (not installed with the package; run from a checkout).

    python -m benchmarks [--smoke] [--only GROUPS] ...     the suite -> benchmarks/results/*.json
    python -m benchmarks.render                             results -> BENCHMARKS.md, README block

Layout: `points` (the points as data, each with its target and a pure `met`), `measures` (how
each kind of point is measured), `suite` (runs the groups, writes the JSON), `harness` (timing,
kernel time from traces, compile counts, ceilings, machine info), `roofline` (byte and FLOP
counts), `workloads` (random weights, states and inputs; the timed step), `levers`,
`breakdown`, `hf_baseline`, `schema` (the JSON's fields), `render` (the tables), and the device
scripts `h200_*.py` with what they share in `device_script` (options, results header, JSON
writes, sections) and their helpers (`attend_checks`, `loop_checks`, `parallel_probes`, ...).
Only the public API of dsa_jax is used.
"""
