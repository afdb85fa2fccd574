"""What every other folder builds on: the partition math (``_layout``), flat buffers (``_flat``),
the per-parameter and per-bucket records (``_records``), the options (``_config``), hook ownership
(``_ownership``) and the torch internals in one place (``_compat``). Imports nothing else of shardopt."""
