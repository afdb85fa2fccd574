"""How ranks talk: the collectives (``_collectives`` and ``_bucket_paths``), the control group and
its messages (``_control``, ``_messages``), how pieces cross replicas (``_replicas``), the model's
other axes and parts (``_model_axes``, ``_model_parts``), and ``sync_module_states``
(``_module_sync``)."""
