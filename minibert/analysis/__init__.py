"""Analysis built on the model's outputs: layer selection, pooling, mixing and similarity (``layers``),
probing (``probing``), fill-mask and the logit lens (``lens``), plots (``plots``) and parity reports
(``parity``). They import the core and the tools; neither imports them."""
