"""``canon-titan sweep``: controlled comparisons across models, Canon placements and seeds.

A spec (``spec.py``) crosses axes of ``--section.key`` overrides over one or more base configs and a
list of seeds; every cell is an ordinary training run with its own dump folder (``cells.py``), its
steps set by a matched budget (``budget.py``), run here side by side (``local.py``) or as one SLURM
job array (``slurm.py``), then scored (``scores.py``). ``stats.py`` turns the scores into means
with their intervals and a verdict on every one-axis difference; ``results.py`` writes the tables,
``plots.py`` the figures, and ``guard.py`` turns a sweep into the guard of a promised result.
"""
