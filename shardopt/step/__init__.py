"""What every rank agrees on: the call and step messages (``_step_message``, ``_agreement``), the
step's one all-reduce (``_step_agreement``), the usage checks, skipped steps and the loss scale."""
