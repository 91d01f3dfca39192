"""mpifl_example — a plugin package for mpifl, kept outside the mpifl package: a data set the
user generates, a small CNN, a partition and two robust aggregation rules.

Importing it registers ``bars`` (data set), ``sorted_blocks`` (partition), ``small_cnn``
(model), ``trimmed_mean`` and ``centered_clip`` (rules; the second keeps state). A job names
it in ``[plugins] modules``.
"""

from mpifl_example import data, models, rules  # noqa: F401  (importing registers them)
