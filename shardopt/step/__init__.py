"""What every rank agrees on at a step, above the buffers it drives: the construction check and the
hyperparameter digest (``_agreement``), the step's one all-reduce (``_step_agreement``), the usage
checks, skipped steps and the loss scale. The messages' layout and the call headers are
``comm._messages``."""
