"""mpifl_models — a plugin package with the models researchers actually train, kept outside
mpifl: a small ResNet with BatchNorm and Dropout on CIFAR-shaped images, a regression task with
the mean squared error, and a user loss (label-smoothed cross-entropy).

Importing it registers ``cifar_like`` and ``sensor_regression`` (data sets), ``small_resnet``
(model) and ``smoothed_ce`` (loss). A job names it in ``[plugins] modules``; resnet.toml and
regression.toml beside this folder are the jobs.
"""

from mpifl_models import data, losses, models  # noqa: F401  (importing registers them)
