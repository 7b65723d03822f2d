"""The penalty stage: a term the loss gains from its own gradient, by glob (``grad_penalty``,
``input_grad_penalty``), differentiated by the backward that fills ``.grad``."""
