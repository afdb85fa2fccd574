"""shardopt: a ZeRO-style sharded mixed-precision AdamW for data-parallel PyTorch training."""
from shardopt.comm._module_sync import sync_module_states
from shardopt.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from shardopt.estimate import MemoryEstimate, estimate_memory
from shardopt.step._loss_scale import DynamicScaler, LossScaler, StaticScaler
from shardopt.memory import MemoryReport, ddp_adamw_bytes, predict_bytes
from shardopt.muon import ShardedMuon
from shardopt._version import __version__  # noqa: F401
from shardopt.optimizer import ShardedAdamW

__all__ = [
    "DynamicScaler",
    "LossScaler",
    "MemoryEstimate",
    "MemoryReport",
    "ShardedAdamW",
    "ShardedMuon",
    "StaticScaler",
    "ddp_adamw_bytes",
    "estimate_memory",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "sync_module_states",
    "predict_bytes",
]
