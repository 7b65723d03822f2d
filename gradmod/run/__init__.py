"""One run: the typed config (``config``, ``checks``), building it (``runner``, ``setup``, ``factories``,
``assembly``), and its folder (``folder/``: claim, atomic writes, checkpoints, endings)."""
