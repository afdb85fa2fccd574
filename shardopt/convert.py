"""Sharded checkpoints to plain PyTorch state dicts, offline: the public face of
``shardopt.checkpoint._convert`` (``python -m shardopt.convert CKPT_DIR OUT.pt``)."""
from shardopt.checkpoint._convert import (adamw_defaults, convert_checkpoint, join_by_rule, main,  # noqa: F401
                                          split_by_part, split_by_rule)

if __name__ == "__main__":
    main()
