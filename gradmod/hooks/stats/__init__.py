"""The ``log`` transform's statistics: ``grad_stats`` (``GradStats``, the observers of a backward),
``rows`` (every tensor's row in few passes) and ``buffer`` (``StatBuffer``: rows kept on the device
until a log point reads them, the protocol every statistics record shares)."""
