"""The benchmark suite of dsa_jax (not installed with the package; run from a checkout).

    python -m benchmarks [--smoke] [--only GROUPS] ...   the suite -> one results JSON
    python -m benchmarks.render [RUN.json]                one run -> BENCHMARKS.md, README block
    scripts/gpu_checks.sh                                 on a GPU: `pytest -m gpu`, then the suite

Layout: `points` (the points as data, each with its target and a pure `met`), `measures` (how
each kind of point is measured), `loop` (the serving-loop points: the device loop, speculative
decoding, the engine), `suite` (runs the groups, writes the JSON), `harness` (timing, kernel
time from traces, compile counts, ceilings, machine info), `roofline` (byte and FLOP counts),
`workloads` (random weights, states and inputs; the timed step), `levers` (design choices
against their alternative), `breakdown` (the step's stages), `hf_baseline` (the Hugging Face
block), `schema` (the JSON's fields), `render` and `render_tables` (the tables). `results/`
holds one run per card kind, `wheels/` the jax-triton wheel a GPU run installs offline.
Only the public API of dsa_jax is used (no `dsa_jax.pallas` module).
"""
