"""Training: the fine-tuning loop (``loop``) and batching of labelled data (``data``). Above the tools and
the analysis modules: it may use them (a ScalarMix head, freezing), nothing below imports it."""
