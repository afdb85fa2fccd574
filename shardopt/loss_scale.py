"""Loss scaling (``loss_scale=``): the public face of ``shardopt.step._loss_scale``."""
from shardopt.step._loss_scale import DynamicScaler, LossScaler, StaticScaler, make_scaler  # noqa: F401
