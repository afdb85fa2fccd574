"""Drop-in use of ShardedAdamW inside training frameworks.

Each submodule imports its framework, which is an optional extra: ``shardopt.integrations.hf``
(``pip install shardopt[hf]``: transformers and accelerate), ``shardopt.integrations.accelerate``
(``[hf]``) and ``shardopt.integrations.lightning`` (``[lightning]``). Importing this package
imports none of them.
"""
from shardopt.integrations._convert import from_torch, from_torch_adamw

__all__ = ["from_torch", "from_torch_adamw"]
