"""Tools that work *on* a model without changing model.py: hook points and interventions (``hooks``),
the padding-free inference path (``fast``), layer surgery (``surgery``) and accounting (``accounting``).
They import the core; the core never imports them."""
