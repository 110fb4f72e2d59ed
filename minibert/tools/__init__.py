"""Tools that work *on* a model without changing model.py: hook points and interventions (``hooks``),
the padding-free inference path (``fast``), layer surgery (``surgery``), accounting (``accounting``),
batches of texts (``batching``), texts to vectors (``encode``), pooling (``pooling``), progress bars
(``progress``) and the one timing loop (``timing``). They import the core; the core never imports them."""
