"""The gradient path: backward passes as rounds of bucket reductions (``_rounds``), what each
parameter's gradient is in a round (``_reducer``), where gradients live (``_grad_store``), the
stage-2 ``p.grad`` placeholder, the launch order's guess, and the bytes held (``_held_bytes``)."""
