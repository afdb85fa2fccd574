"""How ranks talk: the collectives (``_collectives``, the only caller of ``torch.distributed``),
the weight all-gathers in flight (``_gathers``) and where they are waited for (``_gather_wait``),
and ``sync_module_states`` (``_module_sync``)."""
