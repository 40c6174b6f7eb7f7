"""Studies: the staged ablation, declared claims and their verdicts, and the runs' records.

ablation          the runner: `python -m fp4jax.experiments.ablation` (one run per arm and seed)
arms              named arms: a preset with recipe overrides
parallel          runs side by side, each in a process pinned to its own cores
cluster           runs as jobs of a scheduler (Slurm, or local) through submitit
code_version      the code and core count that made a run (kept one per run)
committed         the results folder in git: each finished run published, resumable
study_config      the config a study's records belong to; reruns of another refused
declaration       a study's rules, declared before its first run
hypothesis_tests  t and sign-flip tests, Holm, power and MDE over seeds
stats             paired estimates with intervals over seeds
verdicts          each declared claim's verdict from per-seed values
tokens_to_target  tokens to reach a target validation loss
report            table.md and figures, read back from the run folders
figures           the figures: validation curves, quantization-error diagnostics
horizon           E1's statistics beyond the primary, and the stress screen (E2)
sizing            seeds for a study from the spreads of one that ran
trend             a contrast against model size over a study's widths, and its value at 8B
stage_cumulative  E5's reading over its horizons: claims per horizon, the horizon contrast
"""
