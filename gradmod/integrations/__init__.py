"""gradmod's rules inside other training loops (``gradmod.integrations.lightning``)."""
