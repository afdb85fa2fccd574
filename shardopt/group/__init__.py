"""One owner for a bucket's life: the flat group (``_flat_group.FlatGroup``, whose backward half is
``_intake.GradIntake``) takes each gradient into its bucket, reduces it, updates this rank's shard
and gathers the new weights; beside it the scheduler of the rounds of reductions over every group
(``_rounds``), where gradients live (``_grad_store``), the stage-2 ``p.grad`` placeholder, the
launch order's guess, the bytes held (``_held_bytes``), the parameters' binding to the flat
buffers, Muon's whole-matrix packing, and where weight gathers in flight are waited for
(``_gather_wait``)."""
