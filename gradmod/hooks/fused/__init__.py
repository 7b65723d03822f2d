"""The fused stage: the accumulated ``.grad`` after backward, each rule's transforms at once.

``stage`` runs it; ``group`` holds the group transforms (``GroupTransform``: all of a rule's
gradients together, as ``global_norm_clip``, ``agc``, ``zclip``).
"""
