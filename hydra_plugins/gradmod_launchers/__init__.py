"""gradmod's Hydra launchers, here because Hydra builds a launcher only from the
``hydra_plugins`` namespace; what they do is in ``gradmod.app.launchers``."""
