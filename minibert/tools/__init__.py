"""Tools that work *on* a model without changing model.py: hook points and interventions (``hooks``),
the padding-free inference path (``fast``) and its matrix-product routes (``kernels``), layer surgery (``surgery``), accounting (``accounting``),
batches of texts (``batching``), texts to vectors (``encode``), pooling (``pooling``), progress bars
(``progress``), the one timing loop (``timing``) and the hashes of what a cache was made from
(``fingerprint``). They import the core; the core never imports them."""
