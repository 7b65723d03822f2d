"""Curvature of a loss by glob: Hessian-vector products by double backward (``products``), the
top eigenvalues by Lanczos (``lanczos``), the trace by Hutchinson (``hutchinson``), and the
estimate that puts them together per group of parameters (``estimate``: ``gradmod.hooks.curvature``).

The products use ``torch.autograd.grad(..., create_graph=True)``: a gradient the loss takes of
itself, which rules leave as torch gives it (``gradmod.hooks.trace.fills_grad``), so the Hessian
is the plain loss's under any rule attached."""
