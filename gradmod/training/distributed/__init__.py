"""Many processes: ``strategy`` (DDP, FSDP2, TP and HSDP: wrapping, sharding, the mesh's layout),
``ranks`` (this process's rank from its launcher, torch-free) and ``peers`` (which rank ended)."""
