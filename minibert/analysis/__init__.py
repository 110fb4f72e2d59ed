"""Analysis built on the model's outputs: layer selection, pooling, mixing and similarity (``layers``),
probing with a control task (``probing``), fill-mask and the logit lens (``lens``), 2-D maps of the stack
(``maps``), plots (``plots``) and parity reports (``parity``). Above ``tools`` and ``models``; training,
compat and the fronts use them, nothing below imports them."""
