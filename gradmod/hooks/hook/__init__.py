"""The hook stage: each backward's local gradient, through ``Tensor.register_hook``.

``stage`` attaches one hook per tensor, ``chain`` runs the transforms of every rule on it,
``backward_end`` runs what the chains leave for the end of backward (deferred chains, the
``log`` observations) there, together.
"""
