"""The hook stage: each backward's local gradient, through ``Tensor.register_hook``.

``stage`` attaches one hook per tensor, ``chain`` runs the transforms of every rule on it,
``log_buffer`` holds the ``log`` observations until the end of backward.
"""
