"""Every layer's per-example form, in one place: ``base`` (``Form``, what a form answers),
``layers`` (Linear, convolutions, Embedding, norms, HF ``Conv1D``, and ``register_form`` for one's
own), ``conv_grads`` (a convolution's per-example weights at the lower cost), ``attention``
(``nn.MultiheadAttention``), ``recurrent`` (RNN, LSTM, GRU), ``position_bias`` (T5's relative
position bias) and ``replay`` (any other module, by ``torch.func``)."""
