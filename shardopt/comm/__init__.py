"""How ranks talk: the collectives (``_collectives`` and ``_bucket_paths``), the control group and
its messages (``_control``, ``_messages``), the weight all-gathers in flight (``_gathers``) and
where they are waited for (``_gather_wait``), and ``sync_module_states`` (``_module_sync``)."""
