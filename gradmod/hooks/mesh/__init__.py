"""Meshes and devices: ``sharded`` (DTensor parameters and the layouts refused), ``reductions``
(DTensor gradients reduced over the device mesh, for any layout) and ``devices`` (where the hook
core takes a device's own path)."""
