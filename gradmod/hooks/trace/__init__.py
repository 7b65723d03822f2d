"""The model's first training forward, traced: ``first_forward`` (which module calls use each
parameter) and ``output_leaves`` (the outputs' leaves, to tell a changed forward from the same)."""
